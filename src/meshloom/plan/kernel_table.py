"""Kernel rates as data: how fast one GPU runs the kernels a training step is made of.

A table (`plan/kernels/<gpu>.json`, schema in docs/plan.md) lists bf16 GEMM throughput per
(m, n, k), attention kernel throughput per (sequence, head width, causal, direction), the
streaming HBM bandwidth and the gap each kernel launch leaves. Every number is either measured
on that GPU by `meshloom bench kernels` (`kind: measured`) or taken from a published
microbenchmark and cited per number (`kind: published`). Nothing in a table is fitted to
end-to-end training throughput: the planner's step times are built from these rates, and the
validation against published runs (benchmarks/planner_validation.py) is a prediction.

A shape measured by several sources is one point, their mean. Lookups between points:
- GEMM: a shape in the table is answered exactly. Otherwise the rate is the inverse-distance
  weighted mean (power 2) of the `GEMM_NEIGHBOURS` nearest points, distance measured in
  log2(m), log2(n), log2(k): GEMM efficiency follows the size of each dimension on a log scale
  (tile quantisation, the depth k of the reduction), and a near shape is the best guide. The
  rate is capped by the nearest measured shape at least as large in every dimension (a smaller
  GEMM is not faster), so shapes below the table are never priced above its smallest points.
- Attention: per (head width, causal, direction), linear in log2(seq) between the two nearest
  sequence lengths, clamped at the ends; the nearest head width when the asked one is missing.
  A missing `bwd` row is derived from `fwd` and `fwd_bwd` at the same point (FlashAttention's
  FLOP convention: bwd = 2.5 x fwd, fwd_bwd = 3.5 x fwd, so the times subtract).
- Other attention kernels (rows with `"kernel"`: `"fa1"`, FlashAttention 1; `"triton"`, the
  Triton FlashAttention of 2023 trainers; `"cudnn"`, cuDNN's fused flash attention) are
  published or measured beside FlashAttention-2 in the same benchmark, often for fewer shapes.
  A kernel no benchmark publishes in numbers is priced as the kernel its authors measured it
  against (`PRICED_AS`) until a table has rows of its own.
  Such a kernel runs at FlashAttention-2's rate for the asked shape times its ratio to
  FlashAttention-2 in the nearest series it was published for (head width, mask, direction),
  at the asked sequence length: the shape dependence the table knows, scaled by what the
  benchmark showed between the two kernels.
- A table may take such a kernel's ratio from another GPU's table that publishes it
  (`"attention_ratio_from": {"triton": {"table": "a100-80g", "why": ..., "sources": [...]}}`)
  where no benchmark of that kernel on its own GPU exists and both kernels run the same
  instructions on both GPUs: the H100 table prices FlashAttention 1 and the 2023 Triton kernel
  at their A100 ratios to FlashAttention-2 (neither uses Hopper's instructions). Derived, not
  measured: the table says why, the rates line names the table the ratio came from, and no
  ratio is borrowed twice (the lending table must publish the kernel itself).
- fp8 GEMMs (`gemm_fp8`, Hopper tables): rows of one benchmark that ran the same shapes in fp8
  (e4m3 operands, 16-bit output) and in 16-bit. The planner prices an fp8 GEMM at the table's
  16-bit rate for its shape times the fp8/16-bit speed ratio that benchmark measured at the
  same arithmetic intensity, 1 / (1/m + 1/n + 1/k) (flops per operand element moved): fp8
  halves the bytes a flop needs and doubles the tensor cores' peak, so how much of that a shape
  gains follows how compute-bound it is, and the ratio is linear in log2 of the intensity
  between the benchmark's points, clamped at its ends (shapes of one intensity, a GEMM and its
  transposes, are one point, their mean); a shape the rows have is answered as measured. A
  ratio of one kernel family against itself on one GPU, applied to the table's own 16-bit
  shapes (`fp8_speedup`).
- A power limit (`"at_power_limit"`, with `compute_from` only): a GPU run below the power its
  lender was measured at runs its tensor cores at a lower clock. The table cites bf16 GEMM
  rates measured on the GPU itself at its limit; the lender's GEMM rows (and, unless
  `"attention": false`, its attention rows: the same tensor cores under the same cap) are
  scaled by the geometric mean of those rates over the lender's at the same shapes. One
  factor, measured, not fitted to a training run; fp8 GEMMs follow through their ratio.
- Head width: each kernel is compiled for a few head widths and runs a model's head padded up to
  the next one, doing that width's FLOPs (`padded_head_dim`). A width the table measured is
  answered as measured; any other is looked up at its padded width, and the rate in the model's
  FLOPs is that times head_dim / padded.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache, lru_cache
from pathlib import Path

from meshloom.plan import PlanError

TABLE_DIR = Path(__file__).resolve().parent / "kernels"
GEMM_NEIGHBOURS = 4
DIRECTIONS = ("fwd", "bwd", "fwd_bwd")
# "fa2": FlashAttention-2 class (SDPA's flash backend); "cudnn": cuDNN's fused flash attention
# (SDPA's cuDNN backend, which PyTorch 2.11 picks on an H100; Transformer Engine's on Hopper);
# "sdpa": whichever of the two PyTorch's SDPA picks on the table's GPU (`sdpa_kernel`).
ATTENTION_KERNELS = ("sdpa", "fa2", "fa1", "triton", "cudnn")
# GPUs on which SDPA puts cuDNN's attention first: PyTorch >= 2.9 with cuDNN >= 9.9 does on
# compute capability 9.0 and 10.0 (sdp_utils.cpp `check_prefer_cudnn_attention`,
# pytorch/pytorch#162073); earlier releases run FlashAttention-2 there (`--fix
# attention_kernel=fa2`).
SDPA_PREFERS_CUDNN = frozenset({"h100", "h100-96gb", "h200"})


def sdpa_kernel(table: KernelTable) -> str:
    """The kernel SDPA runs on `table`'s GPU: cuDNN's where it comes first and the table prices
    it, else FlashAttention-2."""
    prefers = table.gpu in SDPA_PREFERS_CUDNN and "cudnn" in table.other_attention
    return "cudnn" if prefers else "fa2"


# The head widths each kernel is compiled for. FlashAttention-2 rounds a head up to a multiple
# of 32 up to 128 and of 64 beyond (flash_api.cpp `head_size_rounded`; its releases differ
# above 128, not up to it); FlashAttention 1 runs its 32-, 64- or
# 128-wide kernel (fmha_api.cpp `run_fmha_fwd`); the Triton FlashAttention (flash-attn's
# flash_attn_triton.py, copied into llm-foundry) pads to the next power of two, at least 16
# (`BLOCK_HEADDIM`).


def padded_head_dim(head_dim: int, kernel: str) -> int:
    """The head width `kernel` runs a model's `head_dim` heads at."""
    if kernel == "fa1":
        return next((w for w in (32, 64, 128) if head_dim <= w), head_dim)
    if kernel == "triton":
        return max(16, 1 << (head_dim - 1).bit_length())
    if kernel == "cudnn":  # cuDNN's SDPA takes any head width that is a multiple of 8
        return -(-head_dim // 8) * 8
    step = 32 if head_dim <= 128 else 64
    return -(-head_dim // step) * step


# Kernels without a published rate of their own, priced as the kernel their authors measured
# them against, with why (quoted in benchmarks/published/triton_attention_kernel.txt). The
# Triton FlashAttention llm-foundry ran (flash-attn's flash_attn_triton.py on triton-pre-mlir)
# was only ever compared with FlashAttention 1 in words, by both parties that ran the two: its
# author ("Overall Triton forward + backward is slightly slower than CUDA forward + backward",
# the module's docstring, when the CUDA kernel was FlashAttention 1) and llm-foundry ("In our
# experience, `triton` is slightly faster than `flash`", TUTORIAL.md, when `flash` was
# flash-attn 1.0.3). The "Triton" bars of the FlashAttention-2 paper are another kernel: its
# benchmark script imports OpenAI's `triton.ops.flash_attention`.
PRICED_AS = {"triton": "fa1"}


# FlashAttention's FLOP convention (per direction, relative to one forward).
ATTENTION_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


@dataclass(frozen=True)
class KernelTable:
    gpu: str
    kind: str  # "measured" or "published"
    device: str
    path: str
    gemm: tuple[tuple[int, int, int, float], ...]  # (m, n, k, TFLOP/s)
    attention: tuple[tuple[int, int, bool, str, float], ...]  # (seq, head_dim, causal, dir, TF/s)
    hbm_gbps: float | None  # achieved streaming bandwidth, GB/s
    launch_us: float | None  # gap per kernel launch, microseconds
    # Other attention kernels' rows, by kernel name, in the form of `attention`.
    other_attention: dict = field(default_factory=dict, compare=False, hash=False)
    # A fused AdamW step's achieved bandwidth, GB/s (fp32 weight, gradient and two moments: 28
    # bytes per parameter over its time); None: the planner streams it at hbm_gbps.
    optimizer_gbps: float | None = None
    # Kernels priced at their ratio to FlashAttention-2 in another GPU's table: kernel -> the
    # lending table's name (`attention_ratio_from`).
    ratio_from: dict = field(default_factory=dict, compare=False, hash=False)
    # fp8 over 16-bit GEMM speed by arithmetic intensity (`gemm_fp8`): ((intensity, ratio), ...)
    # in increasing intensity; empty where no fp8 benchmark was published (no fp8 pricing).
    fp8_ratio: tuple = field(default=(), compare=False, hash=False)
    # The same ratios by shape, (m, n, k) -> ratio: a shape the table has is answered as is.
    fp8_shapes: dict = field(default_factory=dict, compare=False, hash=False)
    # `at_power_limit`: (watts, factor on the lender's rates, attention scaled too, lender).
    power_limit: tuple | None = field(default=None, compare=False, hash=False)
    # Answers already worked out: a search asks about the same few dozen shapes thousands of
    # times.
    _memo: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def gemm_tflops(self, m: int, n: int, k: int) -> float:
        """bf16 TFLOP/s of C[m, n] = A[m, k] B[k, n] on this GPU."""
        key = (max(1, int(m)), max(1, int(n)), max(1, int(k)))
        rate = self._memo.get(key)
        if rate is None:
            rate = self._memo[key] = _gemm_rate(self.gemm, *key)
        return rate

    def gemm_seconds(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        if m <= 0 or n <= 0 or k <= 0:
            return 0.0
        return count * 2.0 * m * n * k / (self.gemm_tflops(m, n, k) * 1e12)

    def fp8_speedup(self, m: int, n: int, k: int) -> float:
        """How many times faster this GPU runs C[m, n] = A[m, k] B[k, n] with fp8 operands
        than in bf16 (`gemm_fp8`); a PlanError where the table has no fp8 rows."""
        if not self.fp8_ratio:
            raise PlanError(f"kernel table {self.gpu}: no fp8 GEMM rows (gemm_fp8), so float8 "
                            "cannot be priced on it (fp8 tensor cores: Hopper and later)")
        key = ("fp8", int(m), int(n), int(k))
        ratio = self._memo.get(key)
        if ratio is None:
            ratio = self._memo[key] = self.fp8_shapes.get(key[1:]) or _fp8_rate(
                self.fp8_ratio, m, n, k)
        return ratio

    def attention_tflops(self, seq: int, head_dim: int, causal: bool, direction: str,
                         kernel: str = "fa2") -> float:
        """TF/s of a fused attention kernel, FlashAttention's FLOP convention."""
        seq, head_dim, causal = int(seq), int(head_dim), bool(causal)
        key = ("attention", seq, head_dim, causal, direction, kernel)
        rate = self._memo.get(key)
        if rate is None:
            rate = self._memo[key] = self._attention_tflops(seq, head_dim, causal, direction,
                                                            kernel)
        return rate

    def _attention_tflops(self, seq: int, head_dim: int, causal: bool, direction: str,
                          kernel: str) -> float:
        if kernel == "sdpa":
            kernel = sdpa_kernel(self)
        measured = kernel == "fa2" and any(p[1] == head_dim for p in self.attention)
        width = head_dim if measured else padded_head_dim(head_dim, kernel)
        useful = head_dim / width
        rate = _attention_rate(self.attention, seq, width, causal, direction)
        if kernel == "fa2":
            return rate * useful
        return rate * useful * self.attention_ratio(seq, width, causal, direction, kernel)

    def attention_ratio(self, seq: int, width: int, causal: bool, direction: str,
                        kernel: str) -> float:
        """`kernel`'s speed over FlashAttention-2's at `seq` in the nearest series a benchmark
        ran both in: this table's, or the lending table's (`ratio_from`)."""
        priced = self.priced_as(kernel)
        lender = self.borrowed_ratio(kernel)
        table = for_gpu(lender) if lender else self
        rows = table.other_attention.get(priced) if table is not None else None
        if not rows:
            via = f"priced as {priced}, which is " if priced != kernel else ""
            raise PlanError(f"kernel table {self.gpu}: no '{kernel}' attention rows ({via}"
                            f"published for {', '.join(_tables_with(priced)) or 'no GPU'})")
        d, c, direction_of = _nearest_series(rows, width, causal, direction)
        return (_series_rate(rows, seq, d, c, direction_of)
                / _series_rate(table.attention, seq, d, c, direction_of))

    def priced_as(self, kernel: str) -> str:
        """The kernel whose rows price `kernel` here: its own where this table has or borrows
        them, else the kernel `PRICED_AS` names for it."""
        if self.other_attention.get(kernel) or kernel in self.ratio_from:
            return kernel
        return PRICED_AS.get(kernel, kernel)

    def borrowed_ratio(self, kernel: str) -> str | None:
        """The table `kernel`'s ratio to FlashAttention-2 is borrowed from, if it is."""
        kernel = self.priced_as(kernel)
        if self.other_attention.get(kernel):
            return None
        return self.ratio_from.get(kernel)

    def prices(self, kernel: str) -> bool:
        """Whether this table has a rate for `kernel`, its own, borrowed or through
        `PRICED_AS`."""
        if kernel in ("fa2", "sdpa"):
            return self.has_attention
        kernel = self.priced_as(kernel)
        return bool(self.other_attention.get(kernel)) or kernel in self.ratio_from

    @property
    def has_attention(self) -> bool:
        return bool(self.attention)


def attention_flops(batch_heads: float, q_len: float, kv_len: float, head_dim: int,
                    causal: bool, direction: str) -> float:
    """FLOPs of a fused attention call as FlashAttention counts them: 4·q·kv·d per head forward
    (QK^T and PV), halved when causal, x2.5 backward."""
    f = 4.0 * batch_heads * q_len * kv_len * head_dim * (0.5 if causal else 1.0)
    return f * ATTENTION_FLOP_FACTOR[direction]


def gemm_intensity(m: float, n: float, k: float) -> float:
    """A GEMM's flops per operand element moved, up to a constant: 2mnk / 2(mk + kn + mn)."""
    return 1.0 / (1.0 / max(1.0, m) + 1.0 / max(1.0, n) + 1.0 / max(1.0, k))


def _fp8_rate(points: tuple, m: float, n: float, k: float) -> float:
    """The fp8/16-bit ratio at a shape's intensity: linear in log2 between `points`, clamped."""
    x = math.log2(gemm_intensity(m, n, k))
    if x <= math.log2(points[0][0]):
        return points[0][1]
    for (i0, r0), (i1, r1) in zip(points, points[1:], strict=False):
        x0, x1 = math.log2(i0), math.log2(i1)
        if x <= x1:
            return r0 + (r1 - r0) * (x - x0) / (x1 - x0) if x1 > x0 else (r0 + r1) / 2
    return points[-1][1]


def _gemm_rate(points: tuple, m: int, n: int, k: int) -> float:
    if not points:
        raise PlanError("kernel table has no GEMM rows")
    q = (math.log2(m), math.log2(n), math.log2(k))
    scored = []
    for pm, pn, pk, rate in points:
        here = (math.log2(pm), math.log2(pn), math.log2(pk))
        d2 = sum((a - b) ** 2 for a, b in zip(q, here, strict=True))
        if d2 == 0.0:
            return rate
        scored.append((d2, rate))
    scored.sort()
    near = scored[:GEMM_NEIGHBOURS]
    weights = [1.0 / d2 for d2, _ in near]
    rate = sum(w * r for w, (_, r) in zip(weights, near, strict=True)) / sum(weights)
    # A GEMM no larger in any dimension than a measured one does not run faster than it: the
    # nearest such point caps the estimate (weights far above would otherwise lift a small
    # shape beyond anything measured at its size).
    cover = [(sum((a - math.log2(b)) ** 2 for a, b in zip(q, p[:3], strict=True)), p[3])
             for p in points if p[0] >= m and p[1] >= n and p[2] >= k]
    return min(rate, min(cover)[1]) if cover else rate


def _attention_rate(points: tuple, seq: int, head_dim: int, causal: bool, direction: str) -> float:
    if direction not in DIRECTIONS:
        raise PlanError(f"attention direction {direction!r}: one of {', '.join(DIRECTIONS)}")
    if not points:
        raise PlanError("kernel table has no attention rows")
    dims = sorted({p[1] for p in points}, key=lambda d: (abs(math.log2(d / head_dim)), d))
    for d in dims:
        for c in (causal, not causal):  # the other mask only if this one was never measured
            rate = _series_rate(points, seq, d, c, direction)
            if rate is not None:
                return rate
    raise PlanError(f"kernel table: no attention rows usable for {direction}")


def _nearest_series(points: tuple, head_dim: int, causal: bool, direction: str) -> tuple:
    """(head width, mask, direction) of the published series nearest the asked one: the
    nearest head width, then the same mask, then the same direction before fwd_bwd."""
    have = {p[1:4] for p in points}
    order = sorted(have, key=lambda k: (abs(math.log2(k[0] / head_dim)), k[0], k[1] != causal,
                                        k[2] != direction, k[2] != "fwd_bwd"))
    return order[0]


def _tables_with(kernel: str) -> list[str]:
    return [name for name in available()
            if (table := for_gpu(name)) is not None and table.other_attention.get(kernel)]


def _series_rate(points: tuple, seq: int, d: int, causal: bool, direction: str) -> float | None:
    series = {p[0]: p[4] for p in points if p[1] == d and p[2] == causal and p[3] == direction}
    if not series and direction == "bwd":  # derive from fwd and fwd_bwd at common lengths
        fwd = {p[0]: p[4] for p in points if p[1] == d and p[2] == causal and p[3] == "fwd"}
        both = {p[0]: p[4] for p in points if p[1] == d and p[2] == causal
                and p[3] == "fwd_bwd"}
        for s in set(fwd) & set(both):
            t_bwd = 3.5 / both[s] - 1.0 / fwd[s]  # per unit of forward FLOPs
            if t_bwd > 0:
                series[s] = 2.5 / t_bwd
    if not series:
        return None
    xs = sorted(series)
    if seq <= xs[0]:
        return series[xs[0]]
    if seq >= xs[-1]:
        return series[xs[-1]]
    hi = next(i for i, x in enumerate(xs) if x >= seq)
    a, b = xs[hi - 1], xs[hi]
    w = (math.log2(seq) - math.log2(a)) / (math.log2(b) - math.log2(a))
    return series[a] + w * (series[b] - series[a])


def load(path: str | Path) -> KernelTable:
    """Read and check a kernel table; any defect is a one-line PlanError naming the file."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise PlanError(f"kernel table {path}: no such file") from None
    except OSError as exc:
        raise PlanError(f"kernel table {path}: not readable JSON ({exc})") from None
    return _parsed(str(path), text)


# Keyed by the file's bytes, not its name or time stamp: a search reads the same few tables
# hundreds of times (every evaluation prices with one), and a file rewritten in place is read
# afresh. The table's memo of answered shapes lives on with it.
@lru_cache(maxsize=64)
def _parsed(where: str, text: bytes) -> KernelTable:
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise PlanError(f"kernel table {where}: not readable JSON ({exc})") from None
    return parse(raw, where)


def parse(raw: dict, where: str = "<table>") -> KernelTable:
    def bad(msg: str) -> PlanError:
        return PlanError(f"kernel table {where}: {msg}")

    if not isinstance(raw, dict):
        raise bad("must be a JSON object")
    if raw.get("compute_from") is not None:
        raw = _with_compute_of(raw, bad)
    for key in ("gpu", "kind", "gemm"):
        if key not in raw:
            raise bad(f"missing key '{key}'")
    if raw["kind"] not in ("measured", "published"):
        raise bad(f"kind={raw['kind']!r} must be 'measured' or 'published'")
    sources = raw.get("sources") or {}
    gemm = []
    for i, row in enumerate(raw["gemm"]):
        try:
            m, n, k, rate = int(row["m"]), int(row["n"]), int(row["k"]), float(row["tflops"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"gemm row {i} needs integer m, n, k and a number tflops") from None
        if min(m, n, k) < 1 or not rate > 0:
            raise bad(f"gemm row {i}: sizes must be positive and tflops > 0")
        _check_source(raw, row, sources, f"gemm row {i}", bad)
        gemm.append((m, n, k, rate))
    if not gemm:
        raise bad("has no gemm rows")
    attention, other = [], {}
    for i, row in enumerate(raw.get("attention") or []):
        try:
            item = (int(row["seq"]), int(row["head_dim"]), bool(row["causal"]),
                    str(row["direction"]), float(row["tflops"]))
        except (KeyError, TypeError, ValueError):
            raise bad(f"attention row {i} needs seq, head_dim, causal, direction, tflops") \
                from None
        if item[3] not in DIRECTIONS or not item[4] > 0 or min(item[:2]) < 1:
            raise bad(f"attention row {i}: direction one of {', '.join(DIRECTIONS)}, "
                      "positive sizes and tflops")
        _check_source(raw, row, sources, f"attention row {i}", bad)
        kernel = row.get("kernel", "fa2")
        if kernel not in ATTENTION_KERNELS or kernel == "sdpa":
            raise bad(f"attention row {i}: kernel={kernel!r} must be one of "
                      f"{', '.join(k for k in ATTENTION_KERNELS if k != 'sdpa')}")
        if kernel == "fa2":
            attention.append(item)
        else:
            other.setdefault(kernel, []).append(item)
    for kernel, rows in other.items():  # a ratio needs FlashAttention-2 at the same points
        for seq, d, c, direction, _ in rows:
            if _series_rate(tuple(attention), seq, d, c, direction) is None:
                raise bad(f"'{kernel}' attention rows need FlashAttention-2 rows of the same "
                          f"head width, mask and direction (head_dim={d}, causal={c}, "
                          f"{direction})")
    scalars = {}
    for key in ("hbm_gbps", "launch_us", "optimizer_gbps"):
        entry = raw.get(key)
        value = entry.get("value") if isinstance(entry, dict) else entry
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not value > 0):
            raise bad(f"{key} must be a positive number or null")
        if isinstance(entry, dict) and value is not None:
            _check_source(raw, entry, sources, key, bad)
        scalars[key] = float(value) if value is not None else None
    ratio_from = _ratio_from(raw, other, sources, bad)
    fp8, fp8_shapes = _fp8_ratio(raw, sources, bad)
    gemm = _mean_duplicates(gemm, 3)
    power = _power_limit(raw, gemm, sources, bad)
    if power is not None:
        factor, scale_attention = power[1], power[2]
        gemm = tuple((*row[:3], row[3] * factor) for row in gemm)
        if scale_attention:
            attention = [(*row[:4], row[4] * factor) for row in attention]
            other = {k: [(*row[:4], row[4] * factor) for row in v] for k, v in other.items()}
    return KernelTable(str(raw["gpu"]), raw["kind"], str(raw.get("device", raw["gpu"])), where,
                       gemm, _mean_duplicates(attention, 4),
                       scalars["hbm_gbps"], scalars["launch_us"],
                       {k: _mean_duplicates(v, 4) for k, v in other.items()},
                       scalars["optimizer_gbps"], ratio_from, fp8, fp8_shapes, power)


def _power_limit(raw: dict, lender_gemm: tuple, sources: dict, bad) -> tuple | None:
    """`at_power_limit` as (watts, factor, attention scaled too, lender), or None. The factor
    is the geometric mean, over the cited GEMMs measured on this GPU at its limit, of each
    rate over the lender's rate for the same shape: the clock the cap leaves, as the GEMMs
    felt it. Only a table that borrows its compute (`compute_from`) takes one: a table
    measured on its own GPU was measured at that GPU's limit."""
    given = raw.get("at_power_limit")
    if given is None:
        return None
    if raw.get("compute_from") is None:
        raise bad("at_power_limit scales rates taken with compute_from; a table with its own "
                  "rows was measured at its own limit")
    if not isinstance(given, dict):
        raise bad("at_power_limit must be an object: {watts, gemm: [rows], attention}")
    watts, rows = given.get("watts"), given.get("gemm")
    if isinstance(watts, bool) or not isinstance(watts, (int, float)) or not watts > 0:
        raise bad(f"at_power_limit: watts must be a positive number (got {watts!r})")
    scale_attention = given.get("attention", True)
    if not isinstance(scale_attention, bool):
        raise bad("at_power_limit: attention must be true or false")
    if not isinstance(rows, list) or not rows:
        raise bad("at_power_limit needs gemm rows measured at the limit")
    logs = []
    for i, row in enumerate(rows):
        try:
            m, n, k, rate = int(row["m"]), int(row["n"]), int(row["k"]), float(row["tflops"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"at_power_limit gemm row {i} needs integer m, n, k and a number "
                      "tflops") from None
        if min(m, n, k) < 1 or not rate > 0:
            raise bad(f"at_power_limit gemm row {i}: sizes must be positive and tflops > 0")
        _check_source(raw, row, sources, f"at_power_limit gemm row {i}", bad)
        logs.append(math.log(rate / _gemm_rate(lender_gemm, m, n, k)))
    factor = math.exp(sum(logs) / len(logs))
    return float(watts), factor, scale_attention, str(raw["compute_from"])


def _fp8_ratio(raw: dict, sources: dict, bad) -> tuple[tuple, dict]:
    """The `gemm_fp8` rows as ((intensity, fp8 / 16-bit speed), ...) by intensity, and the
    same ratios by shape. Each row gives one shape's fp8 `tflops` and the same benchmark's
    16-bit `bf16_tflops`, each cited in a published table (`source`, `bf16_source`). Shapes
    of one intensity (a GEMM and its transposes: a measured table's forward and input
    gradient) are one point, their mean."""
    by_shape: dict[tuple, list[float]] = {}
    for i, row in enumerate(raw.get("gemm_fp8") or []):
        try:
            m, n, k = int(row["m"]), int(row["n"]), int(row["k"])
            fp8, half = float(row["tflops"]), float(row["bf16_tflops"])
        except (KeyError, TypeError, ValueError):
            raise bad(f"gemm_fp8 row {i} needs integer m, n, k and numbers tflops, "
                      "bf16_tflops") from None
        if min(m, n, k) < 1 or not fp8 > 0 or not half > 0:
            raise bad(f"gemm_fp8 row {i}: sizes must be positive and both rates > 0")
        _check_source(raw, row, sources, f"gemm_fp8 row {i}", bad)
        _check_source(raw, {"source": row.get("bf16_source")}, sources,
                      f"gemm_fp8 row {i} (bf16_source)", bad)
        by_shape.setdefault((m, n, k), []).append(fp8 / half)
    shapes = {key: sum(v) / len(v) for key, v in by_shape.items()}
    by_dims: dict[tuple, list[float]] = {}
    for key, ratio in shapes.items():
        by_dims.setdefault(tuple(sorted(key)), []).append(ratio)
    points = sorted((gemm_intensity(*dims), sum(v) / len(v)) for dims, v in by_dims.items())
    return tuple(points), shapes


def _ratio_from(raw: dict, other: dict, sources: dict, bad) -> dict:
    """Check `attention_ratio_from` and return kernel -> lending table. Each entry names a
    committed table that publishes the kernel itself, says why the ratio carries over, and (in
    a published table) cites its sources."""
    given = raw.get("attention_ratio_from") or {}
    if not isinstance(given, dict):
        raise bad("attention_ratio_from must be an object: kernel -> {table, why, sources}")
    out = {}
    for kernel, entry in given.items():
        if kernel not in ATTENTION_KERNELS or kernel in ("fa2", "sdpa"):
            raise bad(f"attention_ratio_from: kernel {kernel!r} must be one of "
                      f"{', '.join(k for k in ATTENTION_KERNELS if k not in ('fa2', 'sdpa'))}")
        if not isinstance(entry, dict) or not entry.get("table") or not entry.get("why"):
            raise bad(f"attention_ratio_from[{kernel!r}] needs 'table' and 'why'")
        if other.get(kernel):
            raise bad(f"attention_ratio_from[{kernel!r}]: the table has its own '{kernel}' rows")
        name = str(entry["table"])
        if name == raw.get("gpu"):
            raise bad(f"attention_ratio_from[{kernel!r}]: a table cannot lend to itself")
        path = TABLE_DIR / f"{name}.json"
        try:
            lender = json.loads(path.read_text())
        except (OSError, ValueError):
            raise bad(f"attention_ratio_from[{kernel!r}]: no readable committed table "
                      f"{path.name}") from None
        if lender.get("compute_from") is not None or not any(
                r.get("kernel") == kernel for r in lender.get("attention") or []):
            raise bad(f"attention_ratio_from[{kernel!r}]: {name} does not publish "
                      f"'{kernel}' rows itself")
        if raw["kind"] == "published":
            cited = entry.get("sources") or []
            if not cited or any(key not in sources for key in cited):
                raise bad(f"attention_ratio_from[{kernel!r}]: a published table cites sources "
                          "listed in 'sources' for why the ratio carries over")
        out[kernel] = name
    return out


def _with_compute_of(raw: dict, bad) -> dict:
    """A table whose GPU has the compute of another's (`"compute_from": "<committed table>"`: the
    same die, SMs and clocks, e.g. the H200 and the H100) takes that table's GEMM (fp8 too) and
    attention rows (and the attention ratios it borrows), with their sources, and keeps its own
    bandwidth and launch figures."""
    name = raw["compute_from"]
    if "gemm" in raw or "attention" in raw or "gemm_fp8" in raw:
        raise bad("has both compute_from and its own gemm, gemm_fp8 or attention rows")
    path = TABLE_DIR / f"{name}.json"
    try:
        base = json.loads(path.read_text())
    except (OSError, ValueError):
        raise bad(f"compute_from={name!r}: no readable committed table {path.name}") from None
    if base.get("compute_from") is not None:
        raise bad(f"compute_from={name!r} takes its compute from another table itself")
    sources = {**(base.get("sources") or {}), **(raw.get("sources") or {})}
    return {**raw, "gemm": base.get("gemm", []), "attention": base.get("attention") or [],
            "gemm_fp8": base.get("gemm_fp8") or [],
            "attention_ratio_from": base.get("attention_ratio_from") or {},
            "sources": sources}


def _mean_duplicates(rows: list[tuple], key_len: int) -> tuple:
    """One point per shape: sources that measured the same shape (e.g. two software
    generations) are averaged rather than one of them chosen."""
    groups: dict[tuple, list[float]] = {}
    for row in rows:
        groups.setdefault(row[:key_len], []).append(row[-1])
    return tuple((*k, sum(v) / len(v)) for k, v in groups.items())


def _check_source(raw: dict, row: dict, sources: dict, what: str, bad) -> None:
    """A published number names its source, and the source must be listed."""
    if raw["kind"] != "published":
        return
    key = row.get("source")
    if key is None or key not in sources:
        raise bad(f"{what}: a published table cites a source listed in 'sources' for every "
                  f"number (got {key!r})")


@cache
def for_gpu(name: str) -> KernelTable | None:
    """The committed table for a GPU preset, or None when there is none."""
    path = TABLE_DIR / f"{name}.json"
    return load(path) if path.exists() else None


def available() -> list[str]:
    return sorted(p.stem for p in TABLE_DIR.glob("*.json"))
