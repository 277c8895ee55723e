"""Expert parallel: the experts of every MoE block split over the `ep` ranks.

Each ep rank keeps experts [c * E/ep, (c + 1) * E/ep) of every MoE block (c its ep coordinate)
and computes them for the tokens of all the ranks of its ep group. The ep ranks are data (x
context) parallel ranks (mesh.py, EXPERT_AXES): each routes its own tokens, then
- dispatch: the split sizes (assignments per expert) are exchanged, then the token rows, each
  to the rank holding its expert (one all-to-all with uneven splits);
- the received rows are regrouped expert by expert and the local experts run as one grouped
  computation (GroupedExperts);
- combine: the outputs go back by the reverse all-to-all, and the source rank weights and sums
  them (so the router's gradient stays local).
Backward runs the same two all-to-alls in reverse (comm.all_to_all_rows). Per MoE layer and
micro-batch that is A x dim x bytes each way forward and again backward, A the rank's kept
assignments (tokens x top_k when dropless): what tests/test_expert_parallel.py holds the counter
to.

Gradients: an expert's gradient on its rank already sums the contributions of the whole ep
group's tokens; it is then summed over the ranks holding the same experts ("edp") and divided by
the data x context degree, like every dense gradient. expert_dp.py builds those strategies.
Expert parameters carry an `EPSplit` (placement.py), so checkpoints hold them in their global
shape [E, ...] and any ep resumes any other.
"""

from __future__ import annotations

import torch
from torch import nn

from meshloom import comm
from meshloom.config import Config
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.moe import GroupedExperts, moe_blocks
from meshloom.placement import TPSplit, carry_tags, ep_split, mark_sp_partial, set_ep_split

AXIS = "ep"


def check_ep_config(cfg: Config, dims: ParallelDims, model=None) -> str | None:
    """Why parallel.ep, or a mixture-of-experts model, cannot run on this layout (one line),
    or None."""
    p, ep = cfg.parallel, cfg.parallel.ep
    experts = getattr(model, "n_experts", 0) or 0
    if ep > 1 and not experts:
        return f"parallel.ep={ep} needs a mixture-of-experts model (model.n_experts > 0)"
    if ep > 1 and experts % ep:
        return f"parallel.ep={ep} must divide model.n_experts={experts}"
    if ep > 1 and p.mode == "dp":
        return "parallel.ep > 1 cannot be combined with parallel.mode=dp"
    if ep > 1 and p.rank_devices != 1:
        return "parallel.ep > 1 cannot be combined with parallel.rank_devices"
    if not experts:
        return None
    # Under sequence parallel with context parallel each tp rank's slice of its cp rank's two
    # zigzag chunks must lie in one chunk (models/moe.py routes by chunk order).
    if p.sequence_parallel and dims.cp > 1 and dims.tp % 2:
        return (f"parallel.tp={dims.tp} must be even with parallel.sequence_parallel and "
                f"parallel.cp={dims.cp} for a mixture-of-experts model (each tp rank's part of "
                "the sequence must lie in one zigzag chunk)")
    return None


def is_expert(p: torch.Tensor) -> bool:
    """A parameter (or optimizer piece of one) split over the ep ranks."""
    return ep_split(p) is not None


class ExpertDispatch:
    """MoE.dispatcher under expert parallel: rows sorted by (global) expert -> the ranks
    holding those experts -> their outputs back, in the same order."""

    def __init__(self, mesh: Mesh, n_experts: int):
        self.mesh, self.ep = mesh, mesh.size(AXIS)
        self.local = n_experts // self.ep

    def __call__(self, x: torch.Tensor, counts: torch.Tensor,
                 experts: GroupedExperts) -> torch.Tensor:
        ep, n_local = self.ep, self.local
        send = counts.view(ep, n_local)
        # How many rows each rank sends to each of my experts (a tiny all-to-all, on the device
        # for NCCL; bookkeeping, counted apart from the token rows).
        recv = comm.all_to_all(send.reshape(-1, 1).to(x.device), self.mesh, AXIS,
                               [n_local] * ep, [n_local] * ep,
                               label="all_to_all_splits").view(ep, n_local).cpu()
        send_rows, recv_rows = send.sum(1).tolist(), recv.sum(1).tolist()
        got = comm.all_to_all_rows(x, self.mesh, AXIS, send_rows, recv_rows)
        # `got` is by source rank, then by my expert; the experts want it by expert.
        sizes = recv.reshape(-1)
        starts = (sizes.cumsum(0) - sizes).view(ep, n_local)
        order = torch.cat([torch.arange(int(starts[r, e]), int(starts[r, e] + recv[r, e]))
                           for e in range(n_local) for r in range(ep)]
                          or [torch.zeros(0, dtype=torch.int64)]).to(x.device)
        y = experts(got[order], recv.sum(0))
        back = y[torch.argsort(order)]  # by source rank again
        return comm.all_to_all_rows(back, self.mesh, AXIS, recv_rows, send_rows)


@torch.no_grad()
def apply_expert_parallel(model: nn.Module, mesh: Mesh) -> int:
    """Keep this ep rank's experts of every MoE block (tagged with their place in the global
    [E, ...] tensors) and route through all-to-all. Returns the number of MoE blocks."""
    ep, me = mesh.size(AXIS), mesh.coord(AXIS)
    blocks = moe_blocks(model)
    for name, moe in blocks:
        n = moe.settings.n_experts
        if n % ep:
            raise ValueError(f"{name}: {n} experts do not split over parallel.ep={ep}")
        lo, size = me * (n // ep), n // ep
        for pname in ("w1", "w3", "w2"):
            old = getattr(moe.experts, pname)
            new = nn.Parameter(old[lo:lo + size].clone(), requires_grad=old.requires_grad)
            carry_tags(old, new)
            set_ep_split(new, TPSplit(dim=0, global_shape=tuple(old.shape), offset=lo))
            setattr(moe.experts, pname, new)
        moe.dispatcher = ExpertDispatch(mesh, n)
    return len(blocks)


def routing_metrics(model: nn.Module, mesh: Mesh, n_layers: int, n_experts: int,
                    sequence_parallel: bool = False) -> dict:
    """What the MoE blocks' routing did this step, over all the ranks: `aux_loss` (the summed
    per-layer load-balancing losses, each the mean over micro-batches and ranks: what
    `aux_loss_coef` multiplies), `tokens_dropped` (assignments over capacity), and
    `expert_load` (assignments per expert per layer, before the capacity limit). Each rank
    reports the tokens it routed; collective over the data x context ranks and the pipeline,
    and over tp under sequence parallel (without it, tp ranks route the same tokens and are
    counted once)."""
    loads = torch.zeros(n_layers, n_experts, dtype=torch.float64)
    aux = torch.zeros(n_layers, dtype=torch.float64)
    dropped = torch.zeros(n_layers, dtype=torch.float64)
    seen = torch.zeros(n_layers, dtype=torch.float64)
    for name, moe in moe_blocks(model):
        layer = next(int(part) for part in name.split(".") if part.isdigit())
        st = moe.reset_stats()
        loads[layer] += torch.as_tensor(st.load, dtype=torch.float64).cpu()
        aux[layer] += float(st.aux)
        dropped[layer] += float(st.dropped)
        seen[layer] += st.micro_batches
    packed = torch.cat([loads.flatten(), aux, dropped, seen]).to(mesh.device)
    for axis in (mesh.replica_axis, "pp", *(("tp",) if sequence_parallel else ())):
        comm.all_reduce(packed, mesh, axis, label="all_reduce_scalars")
    packed = packed.cpu()
    loads = packed[:n_layers * n_experts].view(n_layers, n_experts)
    aux, dropped, seen = packed[n_layers * n_experts:].view(3, n_layers)
    return {"aux_loss": float((aux / seen.clamp(min=1)).sum()),
            "tokens_dropped": int(dropped.sum()),
            "expert_load": loads.long().tolist()}


class SequenceShards:
    """models.moe.SequenceSplit when a sequence's tokens are spread over ranks: context parallel
    (zigzag chunks r and 2cp-1-r of 2cp on cp rank r) and/or sequence parallel (the tp ranks
    each hold a contiguous part of what their cp rank holds; with cp, tp even, so that each part
    lies in one zigzag chunk). Routing statistics of whole sequences are summed or gathered
    over those ranks (bookkeeping traffic, counted under its own ops)."""

    def __init__(self, mesh: Mesh, sequence_parallel: bool):
        self.mesh = mesh
        self.cp = mesh.size("cp")
        self.tp = mesh.size("tp") if sequence_parallel else 1
        self.axes = [a for a, n in (("tp", self.tp), ("cp", self.cp)) if n > 1]
        self.ranks = self.cp * self.tp
        # Data x context parallel averages gradients over cp; tp sums its partial ones.
        self.grad_scale = self.cp
        self.n_chunks = 2 * self.cp * max(1, self.tp // 2) if self.cp > 1 else self.tp
        self.chunk_ids = self.chunk_of(mesh.coord("cp") * self.tp + mesh.coord("tp")
                                       if self.tp > 1 else mesh.coord("cp"))

    def chunk_of(self, index: int) -> tuple[int, ...]:
        """Chunk ids of the rank at `index` = cp coordinate x tp + tp coordinate (the order of
        `gather`), in the order its tokens come."""
        r, t = divmod(index, self.tp)
        if self.cp == 1:
            return (t,)
        zigzag = (r, 2 * self.cp - 1 - r)
        if self.tp == 1:
            return zigzag
        half = self.tp // 2
        return (zigzag[t // half] * half + t % half,)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.detach().clone()
        for axis in self.axes:
            comm.all_reduce(t, self.mesh, axis, label="all_reduce_routing")
        return t

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[cp x tp, *t.shape]: every rank's t, cp major (tp gathered first, then cp)."""
        t = t.detach().contiguous()
        shape = t.shape
        for axis in self.axes:
            out = t.new_empty((self.mesh.size(axis) * t.shape[0], *t.shape[1:]))
            comm.all_gather_into(out, t, self.mesh, axis, label="all_gather_routing")
            t = out
        return t.view(self.ranks, *shape)


def split_sequences(model: nn.Module, mesh: Mesh, sequence_parallel: bool) -> None:
    """Context or sequence parallel: every MoE routes whole sequences of which it sees parts;
    under sequence parallel each tp rank routes its own part, so the MoE's parameters get
    partial gradients there (summed over tp after backward, like a norm's)."""
    sp = sequence_parallel and mesh.size("tp") > 1
    if mesh.size("cp") == 1 and not sp:
        return
    for _, moe in moe_blocks(model):
        moe.split = SequenceShards(mesh, sp)
        if sp:
            for p in moe.parameters():
                mark_sp_partial(p)
