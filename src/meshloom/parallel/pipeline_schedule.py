"""Pipeline schedules as data, and the simulator that predicts (and draws) them.

A schedule is, for every pipeline rank, an ordered list of `Action`s: compute (F forward, B
backward, I input-gradient, W weight-gradient) and communication (SEND_F / RECV_F for
activations, SEND_B / RECV_B for their gradients), each for one (stage, micro-batch). Stage s
lives on rank s % pp as its chunk s // pp (Megatron's interleaved placement; one chunk per rank
without virtual stages). The executor (`pipeline.py`) runs any such list; `simulate()` runs the
same lists on a clock to predict the timeline and the bubble.

Schedules:
- gpipe: all forwards, then all backwards;
- 1f1b: p - r - 1 warm-up forwards on rank r, then one forward / one backward, then the rest of
  the backwards (at most p - r micro-batches' activations alive);
- interleaved_1f1b: v chunks per rank, forwards in groups of p micro-batches chunk after chunk,
  backwards likewise with the chunks reversed (Narayanan et al. 2021);
- zb_h1: backward split into I (input gradient, on the critical path) and W (weight gradient,
  deferred into what would be bubbles); stage r runs its Ws r micro-batches late, so every
  stage holds 1F1B's first-stage peak of p micro-batches (Qi et al. 2023, ZB-H1);
- interleaved_zb: interleaved 1F1B's forwards and input gradients, each rank's weight gradients
  put where it would otherwise wait (`filled_lists`); with v = 1 it is ZB-H1. `w_order="lagged"`
  gives the same forwards and input gradients with each W run r input-gradient passes after
  its own on rank r, as PyTorch's ScheduleInterleavedZeroBubble places them (`lagged_lists`):
  what the planner prices for a torchtitan run.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from operator import itemgetter
from typing import NamedTuple

from meshloom.config import Config, ModelDims, closest
from meshloom.mesh import ParallelDims

COMPUTE = ("F", "B", "I", "W")
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb")
INTERLEAVED = ("interleaved_1f1b", "interleaved_zb")  # the ones that take virtual stages
SPLIT_BACKWARD = ("zb_h1", "interleaved_zb")  # backward as I (input grad) and W (weight grad)


class Action(NamedTuple):
    """One step of a rank's list. A tuple, not a dataclass: the simulator looks actions up in a
    dict hundreds of thousands of times per planned layout, and a tuple hashes in C."""

    kind: str  # F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B
    stage: int
    mb: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.mb}"


def stage_rank(stage: int, pp: int) -> int:
    return stage % pp


W_ORDERS = ("filled", "lagged")


def compute_lists(schedule: str, pp: int, m: int, v: int = 1,
                  ranks: Sequence[int] | None = None, w_order: str = "filled"
                  ) -> list[list[Action]]:
    """Each rank's compute actions in execution order (only those of `ranks` if given).
    `w_order` places interleaved_zb's weight passes: "filled" (meshloom's, `filled_lists`) or
    "lagged" (PyTorch's, `lagged_lists`)."""
    ranks = range(pp) if ranks is None else ranks
    if w_order not in W_ORDERS:
        raise ValueError(f"unknown w_order {w_order!r}; one of {', '.join(W_ORDERS)}")
    if schedule not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; one of {', '.join(SCHEDULES)}")
    problem = virtual_stages_problem(schedule, v) or microbatch_count_problem(schedule, pp, m)
    if problem:
        raise ValueError(problem)
    if schedule == "gpipe":
        return [[Action("F", r, k) for k in range(m)] + [Action("B", r, k) for k in range(m)]
                for r in ranks]
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp, m) for r in ranks]
    if schedule == "interleaved_1f1b":
        return [_interleaved(r, pp, m, v) for r in ranks]
    if schedule == "interleaved_zb" and w_order == "lagged":
        return [lagged_lists(r, pp, m, v) for r in ranks]
    if schedule == "interleaved_zb":
        lists = filled_lists(pp, m, v)
        return [list(lists[r]) for r in ranks]
    return zero_bubble_lists(pp, m, ranks)


def _one_f_one_b(r: int, pp: int, m: int) -> list[Action]:
    warm = min(pp - r - 1, m)
    out = [Action("F", r, k) for k in range(warm)]
    for i in range(m - warm):
        out += [Action("F", r, warm + i), Action("B", r, i)]
    return out + [Action("B", r, k) for k in range(m - warm, m)]


def _interleaved(r: int, pp: int, m: int, v: int, offset: int = 2) -> list[Action]:
    """Interleaved 1F1B's order on rank r: (v - 1) x pp warm-up forwards, plus `offset` per rank
    after r (2: a whole backward takes two forwards' time; 1 when it is split, see
    filled_lists), then forward/backward pairs."""
    total = m * v

    def fwd(k: int) -> Action:  # the k-th forward on this rank
        chunk = (k // pp) % v
        return Action("F", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    def bwd(k: int) -> Action:
        chunk = v - 1 - (k // pp) % v
        return Action("B", chunk * pp + r, (k // (pp * v)) * pp + k % pp)

    warm = min((pp - r - 1) * offset + (v - 1) * pp, total)
    out = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        out += [fwd(warm + i), bwd(i)]
    return out + [bwd(k) for k in range(total - warm, total)]


def zero_bubble_lists(pp: int, m: int, ranks: Sequence[int] | None = None
                      ) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023): 1F1B's order with the backward split into I and W, where stage r
    delays its W passes by r micro-batches. Every stage then keeps p micro-batches in flight
    (F done, W not yet), the first stage's 1F1B peak, and the delayed Ws fill the cool-down
    bubbles: with F = I = W the step takes 3m + p - 1 units (m >= p) against 1F1B's
    3m + 3(p - 1), a bubble of (p - 1) / (3m + p - 1)."""
    lists = []
    for r in range(pp) if ranks is None else ranks:
        warm = min(pp - r - 1, m)
        out = [Action("F", r, k) for k in range(warm)]
        w = 0  # next micro-batch whose W runs
        for j in range(m):
            if j < m - warm:
                out.append(Action("F", r, warm + j))
            out.append(Action("I", r, j))
            if j >= r:  # W runs r micro-batches behind I
                out.append(Action("W", r, w))
                w += 1
        out += [Action("W", r, k) for k in range(w, m)]
        lists.append(out)
    return lists


def _split_order(r: int, pp: int, m: int, v: int) -> list[Action]:
    """Rank r's forwards and input-gradient passes in interleaved_zb's order: interleaved
    1F1B's (1F1B's for v = 1) with every backward an I, warmed up by p - 1 - r forwards beyond
    (v - 1) x p (an I takes one forward's time, not two)."""
    return [Action("I", a.stage, a.mb) if a.kind == "B" else a
            for a in (_one_f_one_b(r, pp, m) if v == 1 else _interleaved(r, pp, m, v, offset=1))]


def lagged_lists(r: int, pp: int, m: int, v: int) -> list[Action]:
    """interleaved_zb with its weight passes placed as PyTorch's ScheduleInterleavedZeroBubble
    places them: after rank r's k-th input-gradient pass (k >= r) comes the W of its
    (k - r)-th, the rest at the end. ZB-H1's rule (`zero_bubble_lists`) over the interleaved
    order; for v = 1 it is ZB-H1's lists. Same F/I order, unit-clock bubble and peaks as
    `filled_lists`; benchmarks/pp_lists_vs_torch.py checks it action for action."""
    out, done, w = [], [], 0
    for a in _split_order(r, pp, m, v):
        out.append(a)
        if a.kind == "I":
            done.append(a)
            if len(done) > r:
                out.append(Action("W", done[w].stage, done[w].mb))
                w += 1
    return out + [Action("W", a.stage, a.mb) for a in done[w:]]


@lru_cache(maxsize=256)
def filled_lists(pp: int, m: int, v: int) -> tuple[tuple[Action, ...], ...]:
    """interleaved_zb: interleaved 1F1B's order of forwards and input-gradient passes (1F1B's for
    v = 1), every backward split into I and W, and each W put where its rank would otherwise
    wait. An I takes one forward's time, not a whole backward's two, so rank r warms up with
    (v - 1) x p + (p - 1 - r) forwards, not interleaved 1F1B's (v - 1) x p + 2 (p - 1 - r). The
    lists are laid out once on a unit clock (F = I = W = 1, no transfer time): at each tick a
    rank runs its next F or I if what it needs has finished, else its oldest pending W; a rank
    holding p micro-batches of its layers (v x p chunk activations, forward done, W not) clears
    a W before the next forward, so no rank holds more: 1F1B's first-rank peak, below
    interleaved 1F1B's (v x p + p - 1 on the first rank). On that clock the step takes
    3mv + p - 1 units against interleaved 1F1B's 3mv + 3(p - 1) (F = 1, B = 2): a bubble of
    (p - 1) / (3mv + p - 1), ZB-H1's with v x m micro-batch chunks; for v = 1 the lists are
    ZB-H1's (tests/test_pipeline_schedule.py). The F and I order is the one torch's
    ScheduleInterleavedZeroBubble runs (benchmarks/pp_lists_vs_torch.py); the Ws are placed
    otherwise (torch's placement: `lagged_lists`), with the same bubble. The layout runs every
    action once or raises: lists it returns cannot deadlock."""
    n = pp * v
    order = [_split_order(r, pp, m, v) for r in range(pp)]
    cap = v * pp
    done: dict[Action, int] = {}
    pos, alive = [0] * pp, [0] * pp
    pending: list[deque[Action]] = [deque() for _ in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]

    def ready(a: Action, tick: int) -> bool:
        if a.kind == "F":
            needs = [Action("F", a.stage - 1, a.mb)] if a.stage > 0 else []
        else:
            needs = [Action("F", a.stage, a.mb)] + (
                [Action("I", a.stage + 1, a.mb)] if a.stage < n - 1 else [])
        return all(done.get(d, tick + 1) <= tick for d in needs)

    tick = 0
    while any(pos[r] < len(order[r]) or pending[r] for r in range(pp)):
        ran = []
        for r in range(pp):
            nxt = order[r][pos[r]] if pos[r] < len(order[r]) else None
            if pending[r] and (nxt is None or (nxt.kind == "F" and alive[r] >= cap)
                               or not ready(nxt, tick)):
                ran.append((r, pending[r].popleft()))
            elif nxt is not None and ready(nxt, tick):
                ran.append((r, nxt))
                pos[r] += 1
        if not ran:  # not seen on any tested size; fail loudly, not forever
            raise ValueError(f"interleaved_zb: no rank can run at tick {tick} (pp={pp}, m={m}, "
                             f"v={v})")
        for r, a in ran:
            done[a] = tick + 1
            out[r].append(a)
            if a.kind == "I":
                pending[r].append(Action("W", a.stage, a.mb))
            alive[r] += {"F": 1, "W": -1}.get(a.kind, 0)
        tick += 1
    return tuple(tuple(acts) for acts in out)


def with_communication(lists: list[list[Action]], pp: int, n_stages: int) -> list[list[Action]]:
    """Insert the receive before and the send after every compute action that crosses a stage
    boundary (activations forward, their gradients backward)."""
    out = []
    for acts in lists:
        full = []
        for a in acts:
            if a.kind == "F":
                if a.stage > 0:
                    full.append(Action("RECV_F", a.stage, a.mb))
                full.append(a)
                if a.stage < n_stages - 1:
                    full.append(Action("SEND_F", a.stage, a.mb))
            elif a.kind in ("B", "I"):
                if a.stage < n_stages - 1:
                    full.append(Action("RECV_B", a.stage, a.mb))
                full.append(a)
                if a.stage > 0:
                    full.append(Action("SEND_B", a.stage, a.mb))
            else:
                full.append(a)
        out.append(full)
    return out


def build_schedule(schedule: str, pp: int, m: int, v: int = 1, w_order: str = "filled"
                   ) -> list[list[Action]]:
    """Every rank's full action list (compute and communication)."""
    return with_communication(compute_lists(schedule, pp, m, v, w_order=w_order), pp, pp * v)


# ---------------------------------------------------------------- rules a config must meet
# The one copy of each pipeline rule: meshloom.validation runs check_pp_config() before launch,
# the planner's search runs it on every candidate, and compute_lists() asks the first two.


def virtual_stages_problem(schedule: str, v: int) -> str | None:
    if v != 1 and schedule not in INTERLEAVED:
        return (f"parallel.pp_virtual_stages={v} needs parallel.pp_schedule=interleaved_1f1b "
                f"or interleaved_zb (not {schedule})")
    return None


def microbatch_count_problem(schedule: str, pp: int, m: int) -> str | None:
    # Interleaving sends micro-batches through the chunks in groups of pp.
    if schedule in INTERLEAVED and m % pp:
        return (f"parallel.pp_schedule={schedule} needs the micro-batch count ({m}) to be "
                f"a multiple of parallel.pp={pp}")
    return None


def pipeline_microbatches(cfg: Config, dims: ParallelDims) -> int:
    """Micro-batches per step and pipeline: parallel.pp_microbatches, or what train.micro_batch
    implies, or pp x virtual stages."""
    p, local = cfg.parallel, cfg.train.global_batch // dims.dp
    if p.pp_microbatches:
        return p.pp_microbatches
    if cfg.train.micro_batch:
        return local // cfg.train.micro_batch
    return dims.pp * p.pp_virtual_stages


def check_pp_config(cfg: Config, dims: ParallelDims, model: ModelDims) -> str | None:
    """The first reason the pipeline settings cannot run this model, as one line; or None."""
    p, t = cfg.parallel, cfg.train
    if p.pp_schedule not in SCHEDULES:
        return (f"parallel.pp_schedule: unknown schedule '{p.pp_schedule}'"
                f"{closest(p.pp_schedule, list(SCHEDULES))}; one of {', '.join(SCHEDULES)}")
    if dims.pp == 1:
        return None
    v, stages = p.pp_virtual_stages, dims.pp * p.pp_virtual_stages
    problem = virtual_stages_problem(p.pp_schedule, v)
    if problem:
        return problem
    if p.pp_layers:
        if not (len(p.pp_layers) == stages and sum(p.pp_layers) == model.n_layers
                and min(p.pp_layers) >= 1):
            return (f"parallel.pp_layers={p.pp_layers} must list {stages} stage sizes (pp x "
                    f"pp_virtual_stages) of at least 1 layer each, adding up to model.n_layers="
                    f"{model.n_layers}")
    elif stages > model.n_layers:
        return (f"parallel.pp={dims.pp} x parallel.pp_virtual_stages={v} = {stages} stages "
                f"exceeds model.n_layers={model.n_layers} (a stage needs at least one layer)")
    local = t.global_batch // dims.dp
    m = pipeline_microbatches(cfg, dims)
    if local % m:
        return (f"parallel.pp_microbatches={m} must divide the per-pipeline batch {local} "
                f"(train.global_batch {t.global_batch} / data-parallel degree {dims.dp}); set "
                "parallel.pp_microbatches")
    if p.pp_microbatches and t.micro_batch and local // p.pp_microbatches != t.micro_batch:
        return (f"train.micro_batch={t.micro_batch} and parallel.pp_microbatches="
                f"{p.pp_microbatches} disagree (per-pipeline batch {local}); set one of them")
    problem = microbatch_count_problem(p.pp_schedule, dims.pp, m)
    if problem:
        return problem
    if model.tie_embeddings and p.zero_stage >= 2:
        return (f"tied embeddings across pipeline stages need parallel.zero_stage <= 1 (got "
                f"{p.zero_stage}): the two copies' whole gradients are summed between the first "
                "and the last stage")
    if not p.pp_timeout_s > 0:  # "not >": NaN from TOML fails too
        return f"parallel.pp_timeout_s={p.pp_timeout_s} must be > 0"
    return None


# ---------------------------------------------------------------- simulator


@dataclass
class Timeline:
    """What ran where and when: per rank, (start, end, action) of each compute action."""

    spans: list[list[tuple[float, float, Action]]] = field(default_factory=list)

    @property
    def makespan(self) -> float:
        return max((s[-1][1] for s in self.spans if s), default=0.0) - self.start

    @property
    def start(self) -> float:
        return min((s[0][0] for s in self.spans if s), default=0.0)

    def bubble(self) -> float:
        """Idle fraction of the step, averaged over ranks: 1 - busy / (ranks x makespan)."""
        busy = sum(e - s for spans in self.spans for s, e, _ in spans)
        total = self.makespan * len(self.spans)
        return 1.0 - busy / total if total else 0.0


Cost = Callable[[Action], float]


def unit_cost(a: Action) -> float:
    """F = B = 1 per stage; a split backward is I = W = 1 (then B = I + W = 2 is not used)."""
    return 1.0


def simulate(lists: list[list[Action]], cost: Cost = unit_cost, latency: float = 0.0,
             blocking_sends: bool = False) -> Timeline:
    """Run each rank's list in order on a clock: an action starts when its rank is free and the
    actions it depends on have finished (plus `latency` across ranks). Sends cost their rank
    nothing (they are asynchronous, meshloom's), or with `blocking_sends` hold it for the
    transfer's `latency`, the receiver getting the data when the send ends (a trainer that
    waits on every send before computing on). Raises ValueError naming the stuck actions if the
    lists deadlock."""
    pp = len(lists)
    done: dict[Action, float] = {}
    free = [0.0] * pp
    pos = [0] * pp
    spans: list[list[tuple[float, float, Action]]] = [[] for _ in range(pp)]
    n_stages = 1 + max((max(map(itemgetter(1), acts)) for acts in lists if acts), default=0)
    backward = "I" if any("I" in set(map(itemgetter(0), acts)) for acts in lists) else "B"
    hop = 0.0 if blocking_sends else latency  # a blocking send has already spent it
    send_cost = latency if blocking_sends else 0.0
    # A rank runs on until an action waits on one not yet finished, and is woken when that one
    # finishes, so a blocked rank is not looked at again on every pass. An action's start is
    # the max of the same finish times whichever rank runs first, so no clock depends on it.
    waiting: dict[tuple, list[int]] = {}
    runnable = list(range(pp - 1, -1, -1))
    while runnable:
        r = runnable.pop()
        acts, p, clock, rank_spans = lists[r], pos[r], free[r], spans[r]
        while p < len(acts):
            a = acts[p]
            start, blocked = clock, None
            for d in _dep_keys(a, n_stages, backward):
                end = done.get(d)
                if end is None:
                    blocked = d
                    break
                if d[0] in _SENDS:
                    end += hop
                if end > start:
                    start = end
            if blocked is not None:
                waiting.setdefault(blocked, []).append(r)
                break
            kind = a[0]
            if kind in COMPUTE:
                clock = start + cost(a)
                rank_spans.append((start, clock, a))
            else:
                clock = start + (send_cost if kind in _SENDS else 0.0)
            done[a] = clock
            p += 1
            woken = waiting.pop(a, None)
            if woken:
                runnable.extend(woken)
        pos[r], free[r] = p, clock
    if any(pos[r] < len(lists[r]) for r in range(pp)):
        stuck = [str(lists[r][pos[r]]) for r in range(pp) if pos[r] < len(lists[r])]
        raise ValueError(f"pipeline schedule deadlocks: ranks wait on {', '.join(stuck)}")
    return Timeline(spans)


_SENDS = frozenset({"SEND_F", "SEND_B"})


def _dep_keys(a: Action, n_stages: int, backward: str) -> tuple[tuple, ...]:
    """What must have finished before `a` can start (on any rank), as plain tuples: they equal
    and hash as the Actions they name, and cost no Python constructor (`backward`: the kind
    that ends a micro-batch's backward on a stage, "I" when it is split, else "B")."""
    kind, s, k = a
    if kind == "F":
        return (("RECV_F", s, k),) if s > 0 else ()
    if kind == "B" or kind == "I":
        return (("F", s, k), ("RECV_B", s, k)) if s < n_stages - 1 else (("F", s, k),)
    if kind == "RECV_F":
        return (("SEND_F", s - 1, k),)
    if kind == "RECV_B":
        return (("SEND_B", s + 1, k),)
    if kind == "SEND_F":
        return (("F", s, k),)
    if kind == "SEND_B":
        return ((backward, s, k),)
    return (("I", s, k),)  # W
