"""What one transformer block runs on one GPU for one micro-batch: its GEMMs with their real
shapes, its attention call, its memory-bound (elementwise) traffic and its kernel count. The
planner prices these with a kernel table (plan/kernel_table.py); `meshloom bench kernels`
measures the same GEMM shapes, so a measured table answers the planner's questions exactly.

Shapes: a linear layer W[out, in] applied to T tokens is the forward GEMM (m, n, k) =
(T, out, in); backward is the input gradient (T, in, out) and the weight gradient (out, in, T).

Elementwise bytes per token depend on the implementation (`fused`):
- fused (torch.compile, Megatron/TransformerEngine fused kernels): each logical operation reads
  its inputs and writes its output once. Llama: 2 RMSNorms (read, write: 2·2h), 2 residual adds
  (read 2, write 1: 2·3h), SwiGLU over F/t (read 2, write 1), RoPE on q and k (read, write:
  2(q+kv)); GPT: 2 LayerNorms, 2 dropout + residual (read 2, write 1, 1-byte mask), bias + GeLU
  over 4h/t (read, write), and RoPE as Llama's where the model has it (`has_rope`). Eager
  attention moves every score through softmax (and dropout for GPT); fused attention keeps them
  on chip.
- K/V expansion (`expand_kv`, grouped-query attention only, either way): K and V copied out to
  every query head, read 2kv and write 2q. A profiled H100 step of the compiled 1B Llama spent
  5.6 ms in these and the RoPE kernels against 5.4 ms at these bytes (docs/kernel-tables.md).
- eager (PyTorch eager as meshloom's Llama block is written, models/llama.py): RMSNorm in fp32
  (up-cast, square, mean, scale, gain, down-cast: 40h bytes and 7 kernels per norm), RoPE on q
  and k in fp32 (about 48 bytes per element and 10 kernels each), grouped-query K/V repeated to
  every head, the attention output made contiguous, 2 residual adds, SiLU and the product as
  two kernels (10F/t bytes). GPT eager: LayerNorm (read, write), dropout and residual as two
  kernels each, bias + GeLU as two.
- complex RoPE (`rope_complex`, torchtitan's and Meta's Llama reference: q and k up-cast to
  fp32, viewed as complex, multiplied by the complex frequencies, cast back): per element of q
  and k a cast (read 2, write 4), the complex multiply (read 4, write 4) and a cast back (read
  4, write 2), 20 bytes and 3 kernels each, eager or compiled alike, since Inductor does not
  generate code for complex operators and runs the multiply as its eager kernel
  (pytorch/torchtitan#15: "Torchinductor does not support code generation for complex
  operators").
- fp32 residual stream (`residual_stream`, fused only: a trainer that keeps the stream between
  blocks in fp32): each residual add reads the fp32 stream and the 16-bit branch and writes
  fp32 ((8 + e)h), each norm reads fp32 and writes its output in the compute dtype
  ((4 + e)h: `fp32`, flash-attn's fused dropout-add-LayerNorm with `residual_in_fp32`) or in
  fp32 (8h: `fp32_cast`, a norm that keeps its input's dtype under fp32-parameter autocast,
  TinyLlama), which autocast then casts once for each projection that reads it (read 4h,
  write eh, one kernel each: `norm_casts`).
Backward moves twice the forward's bytes (every op reads the output gradient and what it saved,
and writes the input gradient) with twice its kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.plan.models import ModelShape

IMPLEMENTATIONS = ("fused", "eager")
COMPLEX_ROPE_BYTES = 20.0  # per element of q and k at 2-byte activations: cast, multiply, cast


@dataclass(frozen=True)
class Gemm:
    name: str
    m: int
    n: int
    k: int
    count: float = 1.0  # how many times this GEMM runs (experts of a rank, heads of a batch)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def backward(self) -> tuple[Gemm, Gemm]:
        """(input gradient, weight gradient) of the forward C[m, n] = A[m, k] W[k, n]."""
        return (Gemm(self.name + ".dgrad", self.m, self.k, self.n, self.count),
                Gemm(self.name + ".wgrad", self.k, self.n, self.m, self.count))


def _linear(name: str, tokens: int, out: int, inp: int, count: float = 1.0) -> Gemm:
    return Gemm(name, tokens, out, inp, count)


ATTENTION_GEMMS = ("wq", "wk", "wv", "wo")


def block_gemms(shape: ModelShape, tokens: int, tp: int, expert_rows: float = 0.0,
                local_experts: int = 0, ffn_tokens: int | None = None,
                expert_tp: int = 1) -> list[Gemm]:
    """The forward GEMMs of one block on one tp rank for `tokens` local tokens. For an MoE
    block, `expert_rows` routed rows per local expert and `local_experts` experts on the rank,
    each 1/`expert_tp` of an expert (1: the feed-forward is not split over tp, plan/moe.py),
    its router and shared expert on `ffn_tokens` (default `tokens`; the rank's slice under
    SP)."""
    h, t = shape.hidden, tp
    q, kv = shape.q_dim // t, shape.kv_dim // t
    if shape.arch == "gpt":  # one fused q/k/v projection (narrower k and v under GQA)
        f = shape.ffn_hidden
        return [_linear("qkv", tokens, q + 2 * kv, h), _linear("proj", tokens, h, q),
                _linear("fc1", tokens, f // t, h), _linear("fc2", tokens, h, f // t)]
    out = [_linear("wq", tokens, q, h), _linear("wk", tokens, kv, h),
           _linear("wv", tokens, kv, h), _linear("wo", tokens, h, q)]
    if not shape.is_moe:
        f = shape.ffn_hidden // t
        return out + [_linear("w1", tokens, f, h), _linear("w3", tokens, f, h),
                      _linear("w2", tokens, h, f)]
    ft = tokens if ffn_tokens is None else ffn_tokens
    out.append(_linear("router", ft, shape.n_experts, h))
    if shape.shared_hidden:
        fs = shape.shared_hidden
        out += [_linear("shared.w1", ft, fs, h), _linear("shared.w3", ft, fs, h),
                _linear("shared.w2", ft, h, fs)]
    rows = max(1, round(expert_rows))
    if local_experts and expert_rows > 0:
        fe = shape.moe_hidden // expert_tp
        out += [_linear("experts.w1", rows, fe, h, local_experts),
                _linear("experts.w3", rows, fe, h, local_experts),
                _linear("experts.w2", rows, h, fe, local_experts)]
    return out


def head_gemm(shape: ModelShape, tokens: int, tp: int) -> Gemm:
    return _linear("head", tokens, shape.vocab // tp, shape.hidden)


def all_gemms(shape: ModelShape, tokens: int, tp: int) -> list[Gemm]:
    """Every distinct GEMM of a dense model's step (forward, input and weight gradients): what
    `meshloom bench kernels` measures for a model."""
    fwd = block_gemms(shape, tokens, tp) + [head_gemm(shape, tokens, tp)]
    out = []
    for g in fwd:
        out += [g, *g.backward()]
    return out


def _expands_kv(shape: ModelShape, expand_kv: bool) -> bool:
    return expand_kv and shape.kv_heads != shape.heads


def norm_casts(shape: ModelShape, fused_qkv: bool, fused_swiglu: bool) -> int:
    """Projections that read a block's two norm outputs, each through its own autocast cast
    when the norms write fp32 (`residual_stream=fp32_cast`): q, k and v (one under
    `fused_qkv`, and in GPT blocks), and the feed-forward's first: GPT's fc1, a SwiGLU's gate
    and up (one op under `fused_swiglu`: Megatron's linear_fc1, xformers' packed SwiGLU, which
    casts its input once), an MoE block's router and its experts' dispatch."""
    attention = 1 if fused_qkv or shape.arch == "gpt" else 3
    if shape.arch == "gpt":
        return attention + 1
    if shape.is_moe:
        return attention + 2
    return attention + (1 if fused_swiglu else 2)


def stream_casts(shape: ModelShape, stream: str, fused_qkv: bool, fused_swiglu: bool) -> int:
    """The autocast casts of the norms' outputs one block launches: `norm_casts` when the
    norms write fp32 (`stream` `fp32_cast`), none otherwise."""
    return norm_casts(shape, fused_qkv, fused_swiglu) if stream == "fp32_cast" else 0


def _stream_bytes(h: float, e: int, whole: int, stream: str, casts: int,
                  mask: float = 0.0) -> float:
    """The fused block's two residual adds and two norms (with GPT's dropout masks), per
    token, for a `stream` of implementation.RESIDUAL_STREAMS: 16-bit (read 2, write 1 per
    add; read, write per norm), or fp32 with the norms writing the compute dtype (`fp32`) or
    fp32 and the norms' `casts` (`fp32_cast`); adds and norms on the 1/t slice under SP, the
    casts of the whole tensor the projections read."""
    if stream == "16bit":
        return (4 * h * e + 2 * (3 * h * e + mask)) / whole
    norm_out = e if stream == "fp32" else 4
    per = (2 * ((8 + e) * h + mask) + 2 * (4 + norm_out) * h) / whole
    return per + (casts * (4 + e) * h if stream == "fp32_cast" else 0.0)


def elementwise_bytes_per_token(shape: ModelShape, tp: int, sp: bool, e: int, impl: str,
                                ffn_elems: float | None = None, expand_kv: bool = True,
                                rope_complex: bool = False, stream: str = "16bit",
                                casts: int = 0) -> float:
    """HBM bytes one block's memory-bound kernels move in forward, per local token, excluding
    the attention scores (`score_bytes_per_entry`). `ffn_elems`: an MoE block's feed-forward
    elementwise width per token (plan/moe.py), replacing the dense SwiGLU's F/t. `expand_kv`:
    K and V are copied out to every query head (Implementation.expand_kv). `rope_complex`: RoPE
    runs on complex numbers (Implementation.rope_complex), the same bytes eager or compiled.
    `stream` with `casts` (`norm_casts`): the fused block's residual stream
    (Implementation.residual_stream); the eager count keeps its own norms."""
    h, t = shape.hidden, tp
    whole = t if sp else 1  # norms and residuals run on a 1/t slice of the sequence under SP
    q, kv = shape.q_dim / t, shape.kv_dim / t
    complex_rope = COMPLEX_ROPE_BYTES * (q + kv) * e / 2
    # RoPE as a compiled or hand-fused block runs it; a complex one Inductor cannot fuse.
    fused_rope = complex_rope if rope_complex else 2 * (q + kv) * e
    expand = 2 * (q + kv) * e if _expands_kv(shape, expand_kv) else 0.0
    if shape.arch == "gpt":
        f = shape.ffn_hidden / t
        mask = h if shape.has_dropout else 0  # a 1-byte mask per residual branch
        # RoPE (no position table, no ALiBi): the trainers that run such a block fuse it.
        rope = fused_rope if shape.has_rope else 0.0
        if impl == "fused":
            return (_stream_bytes(h, e, whole, stream, casts, mask) + 2 * f * e + rope
                    + expand)
        # eager: LayerNorm read+write, dropout (read, write, mask) then add (read 2, write 1)
        # twice, bias add and GeLU as separate passes over 4h/t (no bias: the GeLU's only).
        drop = 2 * h * e + mask if shape.has_dropout else 0
        mlp_passes = 2 if shape.has_linear_bias else 1
        return ((2 * 2 * h * e + 2 * (drop + 3 * h * e)) / whole + mlp_passes * 2 * f * e
                + rope + expand)
    mlp = 3 * shape.ffn_hidden / t if ffn_elems is None else ffn_elems
    if impl == "fused":
        return (_stream_bytes(h, e, whole, stream, casts) + mlp * e + fused_rope
                + expand)
    norms = 2 * 40 * h * e / 2  # 40h bytes per norm at e = 2 (fp32 internals scale with it)
    rope = complex_rope if rope_complex else 48 * (q + kv) * e / 2
    contiguous = 2 * q * e
    residual = 2 * 3 * h * e
    swiglu = mlp * e * 10 / 3  # silu (read, write) and the product (read 2, write 1)
    return (norms + residual) / whole + rope + expand + contiguous + swiglu


def score_bytes_per_entry(shape: ModelShape, e: int, flash: bool) -> float:
    """Bytes per attention score (per head, query and key) an unfused attention moves in
    forward: scale-mask-softmax read and write, and for GPT dropout's read, write and mask.
    Fused attention keeps the scores on chip: 0."""
    if flash:
        return 0.0
    return (2 * e + 2 * e + 1) if shape.has_dropout else 2 * e


def block_kernels(shape: ModelShape, impl: str, flash: bool, expand_kv: bool = True,
                  rope_complex: bool = False, casts: int = 0) -> int:
    """Kernels one block's forward launches (backward: twice as many). Counted from meshloom's
    block as written (eager) and from a compiled block (fused: the GEMMs, attention, and one
    fused kernel per run of elementwise work between them, RoPE's among them), plus `casts`
    autocast casts of fp32 norm outputs (fused, `residual_stream=fp32_cast`)."""
    gemms = 4 if shape.arch == "gpt" else 7
    if shape.is_moe:
        gemms = 4 + 1 + (3 if shape.shared_hidden else 0) + 3
    attention = 1 if flash else 4  # QK^T, softmax, (dropout), AV
    repeat = 2 if _expands_kv(shape, expand_kv) else 0
    complex_rope = 2 * 3 if rope_complex and shape.has_rope else 0
    rope = complex_rope or (1 if shape.has_rope else 0)
    if impl == "fused":
        return gemms + attention + 6 + rope + repeat + casts
    if shape.arch == "gpt":
        return gemms + attention + 2 * 3 + 2 * 2 + 2 + 2 + rope + repeat
    rope = complex_rope or 2 * 10
    moe = 12 if shape.is_moe else 0  # route, top-k, sort, gather, scatter, combine
    return gemms + attention + 2 * 7 + rope + repeat + 1 + 2 + 2 + moe
