"""`meshloom plan --explain`: one layout's step and memory, term by term, so a user can see why
it wins (or does not fit)."""

from __future__ import annotations

from meshloom.plan.implementation import loss_kind, pytorch_pipelined
from meshloom.plan.search import Candidate

GB = 1e9


def _ms(x: float) -> str:
    return f"{1e3 * x:10.2f} ms"


def explain(c: Candidate) -> str:
    t, d, mem = c.timing, c.timing.detail, c.memory
    step = t.step_time_s
    lines = [f"layout {c.short()}  ({'fits' if c.fits else 'DOES NOT FIT'})",
             f"rates: {d['rates']}",
             "implementation: " + ", ".join(f"{k}={str(v).lower()}"
                                            for k, v in d["implementation"].items()),
             f"step {1e3 * step:.2f} ms on the busiest GPU; {c.tokens_per_s_per_gpu:,.0f} "
             f"tokens/s per GPU; {c.tflops_per_gpu:.0f} model TFLOP/s ({c.mfu:.1%} MFU)",
             "", "compute (every micro-batch, forward + backward, recompute included):"]
    for name, secs in d["compute_s"].items():
        lines.append(f"  {name:<28}{_ms(secs)}  {100 * secs / step:5.1f}%")
    lines.append(f"  {'= compute':<28}{_ms(t.compute)}")
    lines.append("communication (exposed waits on the step; hidden runs under compute):")
    for axis, parts in d["comm_s"].items():
        exposed, hidden = parts.get("exposed", 0.0), parts.get("hidden")
        if not exposed and not hidden:
            continue
        extra = f"   hidden {_ms(hidden).strip()}" if hidden else ""
        lines.append(f"  {axis + ' exposed':<28}{_ms(exposed)}  {100 * exposed / step:5.1f}%"
                     f"{extra}")
        calls = parts.get("calls") or {}
        for op, secs in (parts.get("ops") or {}).items():
            made = calls.get(op)
            starts = (f", {made['calls']:,} calls starting in {_ms(made['fixed_s']).strip()}"
                      if made else "")
            if made and made.get("nccl"):
                starts += f" ({made['nccl']})"
            lines.append(f"    {op:<26}{_ms(secs)} in all{starts}")
    lines.append(f"  {'pipeline bubble':<28}{_ms(t.bubble)}  {100 * t.bubble / step:5.1f}%")
    lines.append(f"  {'optimizer, clip, accumulate':<28}{_ms(t.optimizer)}  "
                 f"{100 * t.optimizer / step:5.1f}%")
    lines.append(f"  {'= step':<28}{_ms(step)}")
    lines += ["", f"memory per GPU (pipeline rank {mem.rank}):"]
    piped = pytorch_pipelined(c.impl, c.layout)
    for name in ("params", "grads", "optimizer", "activations", "buffers", "context"):
        lines.append(f"  {name:<28}{getattr(mem, name) / GB:10.2f} GB")
        if name == "activations" and mem.counted_as:
            lines.append(f"    counted as: {mem.counted_as}")
        if name == "activations" and mem.loss:
            lines.append(f"    the loss ({loss_kind(c.impl, c.layout)}) over its logits and the "
                         f"final norm's input, held at the peak: {mem.loss / GB:.2f} GB")
        if name == "buffers" and mem.root_unit:
            lines.append(f"    ZeRO-3's root unit, gathered forward to backward "
                         f"(fsdp_root={d['implementation']['fsdp_root']}): "
                         f"{mem.root_unit / GB:.2f} GB")
        if name == "grads" and piped:
            lines.append("    the stage's whole gradients in the reduce dtype, reduce-scattered "
                         "once after its last backward, which makes the shards "
                         f"(pp_fsdp=pytorch): {mem.whole_grads / GB:.2f} GB")
        elif name == "grads" and mem.whole_grads:
            lines.append("    whole gradients summed over the step's micro-batches, "
                         f"reduce-scattered once (fsdp_no_sync): {mem.whole_grads / GB:.2f} GB")
        if name == "buffers" and mem.held_units:
            why = "pp_fsdp=pytorch, held for the step" if piped else "reshard_after_forward=false"
            lines.append(f"    ZeRO-3's units, every one gathered at the peak "
                         f"({why}): {mem.held_units / GB:.2f} GB")
    lines.append(f"  {'= total':<28}{mem.total / GB:10.2f} GB of {c.gpu_memory / GB:.0f} GB")
    return "\n".join(lines)
