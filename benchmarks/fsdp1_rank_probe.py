"""One rank of an FSDP1 run on one GPU: its memory held and allocated in FSDP1's order, its
blocks computed for real, its collectives replaced by local copies of their sizes. Built to test
the guess left on the planner's worst llm-foundry row (docs/plan-validation.md, "Left over
20%"): that MPT-30B at 8192 tokens, 8 GPUs, full recompute, one sequence per micro-batch runs
slow because its rank sits near the 80 GB where the caching allocator has to flush and retry,
which one GPU can show without the other seven. Needs CUDA for the answer; runs on the CPU at
toy sizes for its tests:

    python benchmarks/fsdp1_rank_probe.py --seqs 4096,8192 --out fsdp1_rank_probe.json

Each (sequence length, mode) runs in a fresh process, so one allocator's history never carries
into the next. Mode `full` holds what the run's rank held: the fp32 flat-parameter shards, their
fp32 gradient shards and AdamW's two moments (16 bytes a parameter over `--dp`); mode `light`
holds only the parameter shards, so the same compute runs with some 45 GB more room; mode
`expandable` is `full` under the caching allocator's expandable segments
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which the 2023 stack did not have), which
cannot fragment the same way. The same step slower in `full` than in `light` is the
allocator's price; the allocator's own counters (`num_alloc_retries`, the inactive split bytes)
say where it came from, and `expandable` whether fragmentation is the cause. Beside the measurement
stands the planner's compute for the same micro-batch, priced at the kernel the probe runs
(SDPA's), so the probe also checks that.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "gpu_check" / "fsdp1_rank_probe.json"
MODES = ("full", "light", "expandable")
sys.path.insert(0, str(HERE))


@dataclass(frozen=True)
class Dims:
    """An MPT block's sizes (biases on every linear and norm, GELU MLP, learned positions)."""
    hidden: int = 7168  # MPT-30B, as llm-foundry's yamls and runs.json give it
    layers: int = 48
    heads: int = 56
    ffn: int = 28672
    vocab: int = 50368


# (name, shape) of one block's parameters in its flat parameter, in FSDP1's order of
# registration; the shapes are functions of the dims.
def block_params(d: Dims) -> list[tuple[str, tuple[int, ...]]]:
    h, f = d.hidden, d.ffn
    return [("ln1_w", (h,)), ("ln1_b", (h,)), ("qkv_w", (3 * h, h)), ("qkv_b", (3 * h,)),
            ("out_w", (h, h)), ("out_b", (h,)), ("ln2_w", (h,)), ("ln2_b", (h,)),
            ("fc1_w", (f, h)), ("fc1_b", (f,)), ("fc2_w", (h, f)), ("fc2_b", (h,))]


def root_params(d: Dims, seq: int) -> list[tuple[str, tuple[int, ...]]]:
    """The root unit: tied token embedding, learned positions (one row a position), final norm."""
    return [("wte", (d.vocab, d.hidden)), ("wpe", (seq, d.hidden)),
            ("lnf_w", (d.hidden,)), ("lnf_b", (d.hidden,))]


def numel(params: list[tuple[str, tuple[int, ...]]]) -> int:
    return sum(torch.Size(s).numel() for _, s in params)


def padded(n: int, dp: int) -> int:
    """FSDP1 pads a flat parameter to a multiple of the world size before sharding it."""
    return -(-n // dp) * dp


def views(flat: torch.Tensor, params: list[tuple[str, tuple[int, ...]]]) -> dict:
    out, at = {}, 0
    for name, shape in params:
        n = torch.Size(shape).numel()
        out[name] = flat[at:at + n].view(shape)
        at += n
    return out


def block_forward(x: torch.Tensor, w: dict, heads: int) -> torch.Tensor:
    """MPT's block: pre-norm attention (causal, SDPA) and a GELU MLP, each added to the stream."""
    b, s, h = x.shape
    a = F.layer_norm(x, (h,), w["ln1_w"], w["ln1_b"])
    q, k, v = F.linear(a, w["qkv_w"], w["qkv_b"]).view(b, s, 3, heads, h // heads) \
        .permute(2, 0, 3, 1, 4)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, h)
    x = x + F.linear(o, w["out_w"], w["out_b"])
    m = F.layer_norm(x, (h,), w["ln2_w"], w["ln2_b"])
    return x + F.linear(F.gelu(F.linear(m, w["fc1_w"], w["fc1_b"])), w["fc2_w"], w["fc2_b"])


class Rank:
    """What one rank holds between steps, and its FSDP1 step with the collectives local."""

    def __init__(self, d: Dims, seq: int, dp: int, mode: str, device: torch.device,
                 dtype: torch.dtype, seed: int = 0) -> None:
        self.d, self.seq, self.dp, self.mode, self.device, self.dtype = d, seq, dp, mode, device, \
            dtype
        self.units = [block_params(d)] * d.layers + [root_params(d, seq)]
        g = torch.Generator(device=device).manual_seed(seed)
        # Every rank's shard is this one: a gathered unit repeats it dp times, which changes
        # what the values are, not what the kernels do or the bytes they move.
        self.shards = [torch.randn(padded(numel(u), dp) // dp, generator=g, device=device)
                       .mul_(0.02) for u in self.units]
        full = mode != "light"
        self.grads = [torch.zeros_like(s) for s in self.shards] if full else None
        self.moments = [(torch.zeros_like(s), torch.zeros_like(s)) for s in self.shards] \
            if full else None

    def held_bytes(self) -> int:
        n = sum(s.numel() for s in self.shards)
        return n * 4 * (1 if self.mode == "light" else 4)

    def gather(self, i: int) -> torch.Tensor:
        """The unit's unsharded 16-bit flat parameter: FSDP1 casts its shard to the compute
        dtype (a temporary `_mp_shard`) and all-gathers that into a fresh buffer."""
        low = self.shards[i].to(self.dtype)
        flat = torch.empty(low.numel() * self.dp, dtype=self.dtype, device=self.device)
        flat.view(self.dp, -1).copy_(low.expand(self.dp, -1))
        return flat

    def reduce_scatter(self, i: int, grad: torch.Tensor) -> None:
        """The unit's unsharded gradient summed to one shard (a reduce-scatter reads it all
        and writes a shard), cast to fp32 and accumulated into the rank's gradient shard."""
        n = padded(grad.numel(), self.dp)
        if n != grad.numel():
            grad = F.pad(grad, (0, n - grad.numel()))
        shard = grad.view(self.dp, -1).sum(0)
        if self.grads is not None:
            self.grads[i].add_(shard.float())

    def micro_batch(self, tokens: torch.Tensor, targets: torch.Tensor,
                    prefetch: bool = True) -> float:
        """One micro-batch as FSDP1 runs it under full recompute (non-reentrant): the root unit
        gathered from the start of forward to the end of backward, each block gathered for its
        forward and again for its recompute and backward, the next one gathered as this one's
        backward finishes (BACKWARD_POST), its gradient reduced and freed. Returns the loss."""
        d, blocks = self.d, self.d.layers
        root_flat = self.gather(blocks).requires_grad_()
        root = views(root_flat[:numel(self.units[-1])], self.units[-1])
        emb = F.embedding(tokens, root["wte"]) + root["wpe"][: tokens.shape[1]]
        inputs, x = [], emb.detach()
        with torch.no_grad():
            for i in range(blocks):
                flat = self.gather(i)
                inputs.append(x)
                x = block_forward(x, views(flat, self.units[i]), d.heads)
                del flat
        x = x.requires_grad_()
        hidden = F.layer_norm(x, (d.hidden,), root["lnf_w"], root["lnf_b"])
        logits = F.linear(hidden, root["wte"])
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        grad, logits = x.grad, logits.detach()
        nxt = self.gather(blocks - 1)
        for i in reversed(range(blocks)):
            flat = nxt.requires_grad_()
            xi = inputs[i].requires_grad_()
            out = block_forward(xi, views(flat, self.units[i]), d.heads)
            out.backward(grad)
            grad, flat_grad = xi.grad, flat.grad
            inputs[i] = xi = out = None
            del flat
            nxt = self.gather(i - 1) if i and prefetch else None
            self.reduce_scatter(i, flat_grad)
            del flat_grad
            if i and nxt is None:
                nxt = self.gather(i - 1)
        emb.backward(grad)
        self.reduce_scatter(blocks, root_flat.grad)
        # Composer evaluates the training metrics after every micro-batch's backward: two
        # eager cross entropies over the kept logits (plan/trainers.py, train_metrics=composer).
        with torch.no_grad():
            for _ in range(2):
                F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        return loss.item()

    def optimizer_step(self, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.95),
                       eps: float = 1e-8) -> None:
        """Composer's DecoupledAdamW, one parameter at a time (its temporaries included)."""
        if self.grads is None:
            return
        for p, g, (m, v) in zip(self.shards, self.grads, self.moments, strict=True):
            m.mul_(betas[0]).add_(g, alpha=1 - betas[0])
            v.mul_(betas[1]).addcmul_(g, g, value=1 - betas[1])
            p.addcdiv_(m, v.sqrt().add_(eps), value=-lr)
            g.zero_()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocator_stats(device: torch.device) -> dict | None:
    if device.type != "cuda":
        return None
    s = torch.cuda.memory_stats(device)
    keys = ("num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
            "allocated_bytes.all.peak", "reserved_bytes.all.peak", "inactive_split_bytes.all.peak")
    return {k: s.get(k) for k in keys}


def run_config(d: Dims, seq: int, dp: int, mode: str, micro_batches: int, device: torch.device,
               dtype: torch.dtype, seed: int = 0) -> dict:
    """One (length, mode) in this process: one untimed micro-batch and optimizer step, then
    `micro_batches` timed ones and a timed optimizer step."""
    rank = Rank(d, seq, dp, mode, device, dtype, seed)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    data = torch.randint(0, d.vocab, (micro_batches + 1, 1, seq + 1), generator=g).to(device)
    rank.micro_batch(data[0, :, :-1], data[0, :, 1:])
    rank.optimizer_step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = allocator_stats(device)
    times, losses = [], []
    for k in range(1, micro_batches + 1):
        t = time.perf_counter()
        losses.append(rank.micro_batch(data[k, :, :-1], data[k, :, 1:]))
        sync(device)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    rank.optimizer_step()
    sync(device)
    opt_s = time.perf_counter() - t
    after = allocator_stats(device)
    return {"seq": seq, "mode": mode, "held_gb": rank.held_bytes() / 1e9,
            "micro_batch_s": times, "optimizer_s": opt_s, "losses": losses,
            "tokens_per_s": seq * micro_batches / sum(times),
            "allocator_before": before, "allocator_after": after}


def planned(d: Dims, seq: int, dp: int, gpu: str, accum: int) -> dict:
    """The planner's compute for one such micro-batch (forward, recompute and backward), priced
    at SDPA's kernel on `gpu`, with llm-foundry's implementation keys (plan/trainers.py)."""
    from meshloom.plan.hardware import make_cluster
    from meshloom.plan.models import from_dims
    from meshloom.plan.search import search
    from meshloom.plan.trainers import trainer_impl

    shape = from_dims("gpt", d.hidden, d.layers, d.heads, d.vocab, ffn_hidden=d.ffn,
                      tied=True, positions=seq, dropout=False, linear_bias=True)
    keys = {**trainer_impl("llm-foundry"), "attention_kernel": "sdpa", "tp": 1, "pp": 1,
            "cp": 1, "dp": dp, "zero": 3, "recompute": "full", "micro_batch": 1}
    best = search(shape, make_cluster(gpu, dp), seq, dp * accum, keys, top=1)[0]
    compute = best.timing.detail["compute_s"]
    return {"compute_s_per_micro_batch": {k: v / accum for k, v in compute.items()},
            "micro_batch_s": sum(compute.values()) / accum,
            "memory_gb": round(best.memory.total / 1e9, 2)}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="4096,8192", help="sequence lengths, comma-separated")
    p.add_argument("--modes", default="full,light,expandable")
    p.add_argument("--dp", type=int, default=8, help="the run's data-parallel size")
    p.add_argument("--micro-batches", type=int, default=3, help="timed micro-batches")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--dims", default=None,
                   help="hidden,layers,heads,ffn,vocab (default MPT-30B's)")
    p.add_argument("--cap-mib", type=int, default=81559,
                   help="the caching allocator's limit on a larger GPU (default: an H100 80GB's "
                        "81559 MiB, so an H200 probes the same pressure)")
    p.add_argument("--gpu", default="h100", help="the planner's GPU preset to compare with")
    p.add_argument("--accum", type=int, default=21, help="the run's accumulation steps")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # SEQ,MODE: child process
    args = p.parse_args(argv)
    try:
        args.seqs = [int(s) for s in args.seqs.split(",")]
        args.d = Dims(*(int(x) for x in args.dims.split(","))) if args.dims else Dims()
    except (TypeError, ValueError):
        p.error(f"--seqs {args.seqs!r} and --dims {args.dims!r} must be integers, "
                "--dims five of them")
    args.modes = args.modes.split(",")
    if bad := [m for m in args.modes if m not in MODES]:
        p.error(f"unknown mode(s) {bad}: one of {', '.join(MODES)}")
    if args.d.hidden % args.d.heads:
        p.error(f"hidden {args.d.hidden} is not a multiple of heads {args.d.heads}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    if args.one:
        seq, mode = args.one.split(",")
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_mib * 2**20 / total),
                                                       device)
        result = run_config(args.d, int(seq), args.dp, mode, args.micro_batches, device, dtype)
        print("RESULT " + json.dumps(result))
        return result
    rows = []
    for seq in args.seqs:
        for mode in args.modes:
            cmd = [sys.executable, __file__, "--one", f"{seq},{mode}", "--dp", str(args.dp),
                   "--micro-batches", str(args.micro_batches), "--device", args.device,
                   "--dtype", args.dtype, "--cap-mib", str(args.cap_mib)]
            if args.dims:
                cmd += ["--dims", args.dims]
            env = dict(os.environ)
            if mode == "expandable":
                env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
            done = subprocess.run(cmd, capture_output=True, text=True, env=env)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if done.returncode or not line:
                tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
                rows.append({"seq": seq, "mode": mode, "error": tail[0]})
            else:
                rows.append(json.loads(line[0][len("RESULT "):]))
            print(json.dumps({k: rows[-1].get(k) for k in
                              ("seq", "mode", "tokens_per_s", "held_gb", "error")}))
    from _launch import provenance, write_result

    result = {"dims": asdict(args.d), "dp": args.dp, "dtype": args.dtype,
              "cap_mib": args.cap_mib,
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "rows": rows,
              "planned": {str(s): planned(args.d, s, args.dp, args.gpu, args.accum)
                          for s in args.seqs},
              "config": provenance()}
    return write_result(result, args.out, lambda r: None)


if __name__ == "__main__":
    main()
