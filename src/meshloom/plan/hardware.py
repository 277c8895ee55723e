"""GPU and cluster presets: peak throughput, memory and link bandwidths.

Peak FLOP/s, memory sizes and link rates are the published figures in
`../shared/reference/published.md` (vendor specs for the few GPUs it does not list, marked
below). What a collective actually gets out of a link is one measured ratio from the same file:
8 H100s reach an all-reduce bus bandwidth of about 370 GB/s over NVLink 4, whose 900 GB/s is the
sum of both directions, i.e. 450 GB/s each way. We apply that fraction (LINK_EFFICIENCY) to every
link, NVLink or network, quoted per direction.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from meshloom.plan import PlanError, nccl

GB = 1e9
# Compute slows while a collective runs beside it (the two share SMs and memory bandwidth):
# Lee et al., "Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning" (arXiv 2507.03114), measured GPT and Llama training on 4 A100s and H100s (and two
# AMD parts): "an average computational slowdown of 18.9%, with a maximum of 40.0%". The
# planner charges this fraction of every hidden collective's time (plan/timing.py).
OVERLAP_SLOWDOWN = 0.189
MIB = 2**20 / GB  # a MiB in GB
LINK_EFFICIENCY = 370.0 / 450.0  # measured NCCL bus bandwidth / one-way NVLink 4 rate (H100)
# A collective call's cost is NCCL's own model (plan/nccl.py: src/graph/tuning.cc, NVIDIA/nccl
# at b6475625): NCCL prices each algorithm and protocol it may use and runs the cheapest; the
# rates above are the bandwidth of the ring with the Simple protocol, the pair it picks for
# large messages. A send is priced as that pair's two-rank ring's one step (8.4 us to start,
# 3.4 us a step over NVLink, 5.7 over PCIe, 14.0 over the network: nccl.send_start_us), and an
# all-to-all (one grouped kernel whose sends to every peer run at once) as one start and one
# hop over the slowest link it uses: NCCL has no cost model for either.


@dataclass(frozen=True)
class GPU:
    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core peak
    memory_gb: float  # GB = 1e9 bytes: what the driver reports where measured, else marketed
    hbm_gbps: float  # memory bandwidth, GB/s (the optimizer step is bound by it)
    intra_gbps: float  # one-way GPU-to-GPU bandwidth inside a node, GB/s
    inter_gbps: float  # one-way network bandwidth per GPU between nodes, GB/s
    intra_link: str = "nvlink"  # what joins the GPUs of a node: "nvlink" or "pci"
    # For NCCL's protocol choice (plan/nccl.py): the GPU's generation (LL128 and the
    # per-channel caps) and the node's CPU vendor (LL's cap and each network step's posting
    # cost across nodes).
    generation: str = "other"
    cpu: str = "intel"


GPUS: dict[str, GPU] = {
    # published.md: H100 SXM 989 TFLOP/s, 80 GB at 3.35 TB/s, NVLink 4 900 GB/s both ways,
    # 400 Gb/s network per GPU.
    # Memory: what the driver reports, not the marketed "80 GB" (which is 80 GiB): nvidia-smi's
    # memory.total on the lent H100 was 81559 MiB (benchmarks/measured/h100-2026-11-22/env.txt).
    # CPU: a DGX H100's two Intel Xeon Platinum 8480C (NVIDIA's DGX H100 datasheet).
    "h100": GPU("h100", 989.0, 81559 * MIB, 3350.0, 450.0, 50.0, generation="hopper"),
    # Meta's Grand Teton H100 (torchtitan's published H100 runs): "96GB HBM2e with 2.4 TB/sec
    # peak memory bandwidth", 400 Gb/s RDMA per GPU, run at its default 500 W power limit
    # (torchtitan benchmarks/llama3_h100_202412_torchtitan.md). Its compute is priced as the
    # SXM part's at the clock a 500 W limit leaves it (plan/kernels/h100-96gb.json,
    # `at_power_limit`); its GPUs' exact peak is not published, so MFU stays against 989.
    "h100-96gb": GPU("h100-96gb", 989.0, 96.0, 2400.0, 450.0, 50.0, generation="hopper"),
    # Vendor spec (not in published.md): same compute and links as H100, 141 GB at 4.8 TB/s.
    "h200": GPU("h200", 989.0, 141.0, 4800.0, 450.0, 50.0, generation="hopper"),
    # published.md: A100 312 TFLOP/s, 2.0 TB/s, NVLink 600 GB/s; the Megatron-LM cluster had
    # 8 x 200 Gb/s HDR InfiniBand per node of 8 GPUs = 25 GB/s per GPU.
    # nvidia-smi reports 81920 MiB for an A100-SXM4-80GB and 40960 MiB for the 40 GB part
    # (public nvidia-smi listings; docs/plan.md cites them).
    # CPU: a DGX A100's two AMD EPYC 7742 (NVIDIA's DGX A100 datasheet; Selene, Megatron-LM's
    # cluster, is built of them).
    "a100-80g": GPU("a100-80g", 312.0, 81920 * MIB, 2000.0, 300.0, 25.0, generation="ampere",
                    cpu="amd"),
    "a100-40g": GPU("a100-40g", 312.0, 40960 * MIB, 1555.0, 300.0, 25.0, generation="ampere",
                    cpu="amd"),
    # Vendor spec (not in published.md): Titan RTX, the GPU of the Hugging Face FSDP blog;
    # 130 TFLOP/s fp16 tensor, 24 GB at 672 GB/s, PCIe 3.0 x16 between the two cards.
    "titan-rtx-24g": GPU("titan-rtx-24g", 130.0, 24.0, 672.0, 16.0, 12.5, "pci"),
}


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    n_gpus: int
    gpus_per_node: int = 8
    # Coefficient of variation of single compute actions' durations (a forward or backward of
    # one micro-batch on one stage). 0 = every action takes its nominal time. A pipeline waits
    # for the later of its inputs, so variation lengthens the step (timing.JITTER_SAMPLES). No
    # published figure exists for GPUs, so presets leave it at 0; `--action-cv` sets a measured
    # one (docs/plan.md).
    action_cv: float = 0.0
    # Kernel rates (plan/compute.py): None = the GPU's committed table (plan/kernels/), a path
    # = a table measured with `meshloom bench kernels`, "datasheet" = peak and bandwidth only.
    kernels: str | None = None
    # NVLink wired GPU to GPU on a board of this many GPUs, with no NVSwitch (0: switched, every
    # GPU reaching any other at its whole NVLink rate). A four-GPU SXM board is wired so: each
    # GPU splits its links evenly over its three peers (NVIDIA lists its NVSwitch platforms as
    # the eight-GPU HGX baseboards: the NVSwitch page of its AI Enterprise vGPU documentation;
    # the even split is the wiring that uses all 18 links). A pair then gets 1/(n - 1) of a GPU's
    # NVLink, and a ring over k of the board's GPUs (NCCL's rings over every pair's links) at
    # most (k - 1)/(n - 1) of it.
    nvlink_mesh: int = 0

    def _intra_gbps(self, members: int) -> float:
        """One-way NVLink GB/s a ring over `members` GPUs of one node gets per GPU."""
        if self.nvlink_mesh > 1:
            return self.gpu.intra_gbps * min(1.0, (members - 1) / (self.nvlink_mesh - 1))
        return self.gpu.intra_gbps

    @property
    def nodes(self) -> int:
        return -(-self.n_gpus // self.gpus_per_node)

    def bus_bandwidth(self, size: int, stride: int) -> float:
        """Bus bandwidth (NCCL's convention) of a ring collective over `size` ranks, `stride`
        apart in rank order: the intra-node link if the whole group sits in one node. Across
        nodes every GPU has its own network port (the rail-optimised clusters of
        published.md: 400 Gb/s per GPU), and NCCL splits a collective over parallel rings
        (channels) that leave a node through different GPUs' ports: with k members of the
        group in each node, k ports carry the inter-node hops at once, so the bus bandwidth is
        k x the per-GPU network rate, at most the intra-node link's."""
        if stride * size <= self.gpus_per_node:
            return self._intra_gbps(size) * GB * LINK_EFFICIENCY
        per_node = max(1, min(size, self.gpus_per_node // stride))
        gbps = min(self._intra_gbps(max(2, per_node)), per_node * self.gpu.inter_gbps)
        return gbps * GB * LINK_EFFICIENCY

    def link_bandwidth(self, size: int, stride: int) -> float:
        """Bytes/s one GPU sends to another member of a group (point-to-point, all-to-all):
        NVLink inside a node, else its own network port."""
        inside = stride * size <= self.gpus_per_node
        gbps = self._intra_gbps(2) if inside else self.gpu.inter_gbps
        return gbps * GB * LINK_EFFICIENCY

    def crosses_nodes(self, size: int, stride: int) -> bool:
        return stride * size > self.gpus_per_node

    def nodes_spanned(self, size: int, stride: int) -> int:
        """Nodes a group of `size` ranks, `stride` apart in rank order, reaches into."""
        if not self.crosses_nodes(size, stride):
            return 1
        per_node = max(1, min(size, self.gpus_per_node // stride))
        return -(-size // per_node)

    def nccl_group(self, size: int, stride: int) -> nccl.Group:
        """A group of `size` ranks, `stride` apart in rank order, as NCCL's cost model sees
        it (plan/nccl.py)."""
        nodes = self.nodes_spanned(size, stride)
        if nodes > 2:  # NCCL's bandwidth rests on the network graph: a channel is a port
            channel = self.gpu.inter_gbps
        else:
            channel = nccl.NVLINK_PER_CH.get(self.gpu.generation, self.gpu.intra_gbps)
        return nccl.Group(size, nodes, self.gpu.intra_link, self.gpu.generation, self.gpu.cpu,
                          self.bus_bandwidth(size, stride) / GB, channel)

    def collective(self, op: str, nbytes: float, size: int, stride: int,
                   protocols: str = "auto") -> nccl.Call:
        """One NCCL call of `op` moving `nbytes` (the whole tensor) over `size` ranks `stride`
        apart, with the algorithm and protocol NCCL would pick (`protocols="simple"`: the ring
        with the Simple protocol only, NCCL_ALGO=Ring NCCL_PROTO=Simple)."""
        return nccl.call(op, nbytes, self.nccl_group(size, stride), protocols)

    def send_latency(self, size: int, stride: int) -> float:
        """Seconds a point-to-point send (size 2) or an all-to-all over `size` ranks costs
        before its bytes: NCCL's start and one hop over the slowest link the group uses."""
        if size <= 1:
            return 0.0
        link = "net" if self.crosses_nodes(size, stride) else self.gpu.intra_link
        return 1e-6 * nccl.send_start_us(link)


# The command-line flag of each figure make_cluster overrides, for its errors.
OVERRIDE_FLAGS = {"peak_tflops": "--peak-tflops", "memory_gb": "--gpu-memory-gb",
                  "intra_gbps": "--intra-node-gbps", "inter_gbps": "--inter-node-gbps",
                  "hbm_gbps": "--hbm-gbps"}


def make_cluster(gpu: str, n_gpus: int, gpus_per_node: int = 8, *,
                 peak_tflops: float | None = None, memory_gb: float | None = None,
                 intra_gbps: float | None = None, inter_gbps: float | None = None,
                 hbm_gbps: float | None = None, action_cv: float = 0.0,
                 kernels: str | None = None, nvlink_mesh: int = 0) -> Cluster:
    """A cluster from a GPU preset, with any figure overridden."""
    if gpu not in GPUS:
        import difflib
        near = difflib.get_close_matches(gpu, list(GPUS), n=1)
        hint = f" (did you mean '{near[0]}'?)" if near else ""
        raise PlanError(f"--gpu: unknown GPU '{gpu}'{hint}; one of {', '.join(GPUS)} (another "
                        "GPU: the nearest preset with its figures given, --peak-tflops, "
                        "--gpu-memory-gb, --hbm-gbps and the link rates)")
    if n_gpus < 1:
        raise PlanError(f"--gpus={n_gpus} must be at least 1")
    if gpus_per_node < 1:
        raise PlanError(f"--gpus-per-node={gpus_per_node} must be at least 1")
    if n_gpus > gpus_per_node and n_gpus % gpus_per_node:
        # Every term that crosses nodes (bus bandwidth, ports, node spans) assumes equal nodes;
        # a short last node would be priced as a full one.
        full, rest = divmod(n_gpus, gpus_per_node)
        raise PlanError(f"--gpus={n_gpus} is {full} nodes of --gpus-per-node={gpus_per_node} "
                        f"and {rest} over; the planner prices equal nodes: plan --gpus "
                        f"{full * gpus_per_node} or {(full + 1) * gpus_per_node}")
    overrides = {k: v for k, v in dict(peak_tflops=peak_tflops, memory_gb=memory_gb,
                                       intra_gbps=intra_gbps, inter_gbps=inter_gbps,
                                       hbm_gbps=hbm_gbps).items()
                 if v is not None}
    for key, value in overrides.items():
        if not value > 0:
            raise PlanError(f"{OVERRIDE_FLAGS[key]}={value} must be positive")
    if not 0.0 <= action_cv < 1.0:
        raise PlanError(f"--action-cv={action_cv} must be in [0, 1)")
    if nvlink_mesh and (nvlink_mesh < 2 or nvlink_mesh != gpus_per_node):
        raise PlanError(f"--nvlink-mesh={nvlink_mesh}: the GPUs wired to each other on one board, "
                        f"at least 2, and a node is one board: it must equal --gpus-per-node "
                        f"({gpus_per_node})")
    if kernels not in (None, "datasheet"):
        from meshloom.plan.kernel_table import load
        load(kernels)  # a bad file is a one-line error now, not mid-search
    return Cluster(replace(GPUS[gpu], **overrides), n_gpus, min(gpus_per_node, n_gpus),
                   action_cv, kernels, nvlink_mesh)
