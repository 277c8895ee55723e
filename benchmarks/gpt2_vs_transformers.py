"""meshloom's GPT-2 beside transformers' GPT2LMHeadModel: one forward + backward step on the same
batch with the same weights, one process, rounds interleaved; the ratio ours / theirs.

    python benchmarks/gpt2_vs_transformers.py                   # GPT-2 small's widths, 2 layers
    python benchmarks/gpt2_vs_transformers.py --layers 12       # the whole 124M model (slow on CPU)

Both models run fp32 in training mode with dropout 0 and PyTorch's SDPA attention (transformers'
`attn_implementation="sdpa"`), and the same loss (cross-entropy of the logits, computed outside
the model). The weights are transformers' random initialisation, copied into ours through
models/gpt2_hf.py, so the check that both give the same logits also covers the import.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import paired, parser, provenance, round_order, summary  # noqa: E402

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "results" / "gpt2_vs_transformers.json"
VARIANTS = ("ours", "transformers")


def parse_args(argv: list[str] | None):
    p = parser(__doc__)
    p.add_argument("--layers", type=int, default=2, help="blocks (GPT-2 small has 12)")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=10, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.steps < 2 or args.warmup < 0 or min(args.layers, args.batch, args.seq) < 1:
        p.error("need --steps >= 2, --warmup >= 0 and positive --layers, --batch, --seq")
    if args.dim % args.heads:
        p.error(f"--dim={args.dim} must be divisible by --heads={args.heads}")
    return args


def build(args):
    """(ours, theirs): transformers' random GPT-2 and the same weights in meshloom's GPT2."""
    import transformers

    from meshloom.models import gpt2_hf
    from meshloom.models.gpt2 import build_model

    torch.manual_seed(args.seed)
    hf_cfg = transformers.GPT2Config(
        n_embd=args.dim, n_layer=args.layers, n_head=args.heads, vocab_size=args.vocab,
        n_positions=max(1024, args.seq), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0, attn_implementation="sdpa")
    theirs = transformers.GPT2LMHeadModel(hf_cfg).train()
    cfg = gpt2_hf.config_from_hf(hf_cfg.to_dict())
    ours = build_model(cfg, seed=0).train()
    state = {}
    for name, w in theirs.state_dict().items():
        for ours_name, t in gpt2_hf.split_hf(name, w.detach().clone(), cfg):
            state[ours_name] = t
    if cfg.tie_embeddings:
        state.pop("output.weight", None)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"output.weight"}, (missing, unexpected)
    return ours, theirs


def logits_of(model, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return getattr(out, "logits", out)


def step(model, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """One forward + backward: (wall seconds, CPU seconds of this process). Gradients are
    dropped first (as an optimizer loop's zero_grad(set_to_none=True) would). On a shared
    machine the CPU time is the steadier measure: waiting for a core is not counted."""
    model.zero_grad(set_to_none=True)
    t0, c0 = time.perf_counter(), time.process_time()
    loss = F.cross_entropy(logits_of(model, x).flatten(0, 1), y.flatten())
    loss.backward()
    return time.perf_counter() - t0, time.process_time() - c0


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ours, theirs = build(args)
    models = {"ours": ours, "transformers": theirs}
    g = torch.Generator().manual_seed(args.seed + 1)
    data = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
    x, y = data[:, :-1], data[:, 1:]
    with torch.no_grad():
        diff = float((logits_of(ours, x) - logits_of(theirs, x)).abs().max())
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    cpu: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(args.warmup + args.steps):
        for v in round_order(list(VARIANTS), i):
            wall, used = step(models[v], x, y)
            if i >= args.warmup:
                times[v].append(wall)
                cpu[v].append(used)
    # Same gradients (first layer's query weight, and the token table), as a sanity check.
    grad_diff = max(
        float((ours.layers[0].attn.q_proj.weight.grad
               - theirs.transformer.h[0].attn.c_attn.weight.grad[:, :args.dim].t()).abs().max()),
        float((ours.wte.weight.grad - theirs.transformer.wte.weight.grad).abs().max()))
    runs = {v: {**summary(t), "cpu": summary(cpu[v])} for v, t in times.items()}
    ratio = runs["ours"]["median_s"] / runs["transformers"]["median_s"]
    cpu_ratio = runs["ours"]["cpu"]["median_s"] / runs["transformers"]["cpu"]["median_s"]
    result = {
        "config": {"layers": args.layers, "dim": args.dim, "heads": args.heads,
                   "vocab": args.vocab, "batch": args.batch, "seq": args.seq,
                   "steps": args.steps, "warmup": args.warmup,
                   "threads": torch.get_num_threads(), "device": "cpu", "dtype": "fp32",
                   "params": sum(p.numel() for p in ours.parameters()),
                   "attention": "sdpa (both)", "transformers": _transformers_version(),
                   **provenance()},
        "runs": runs,
        "ratio_ours_to_transformers": ratio,
        "paired_ratio_ours_to_transformers": paired(times["ours"], times["transformers"]),
        "cpu_ratio_ours_to_transformers": cpu_ratio,
        "paired_cpu_ratio_ours_to_transformers": paired(cpu["ours"], cpu["transformers"]),
        "check": {"max_abs_logit_diff": diff, "max_abs_grad_diff": grad_diff,
                  "ok": diff <= 1e-4 and grad_diff <= 1e-4},
        "time_note": "forward + backward of one batch per step, rounds interleaved (the order "
                     "rotates each round); ratio: median ours / median transformers; paired: "
                     "median of the per-round ratios; cpu_*: the same from the process's CPU "
                     "time, which does not count waiting for a core on a shared machine",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.layers} layers, dim {args.dim}, batch {args.batch} x {args.seq}: ours "
          f"{runs['ours']['median_s'] * 1e3:.0f} ms, transformers "
          f"{runs['transformers']['median_s'] * 1e3:.0f} ms, ratio {ratio:.3f} (paired "
          f"{result['paired_ratio_ours_to_transformers']:.3f}); CPU time ratio {cpu_ratio:.3f} "
          f"(paired {result['paired_cpu_ratio_ours_to_transformers']:.3f}); logits agree to "
          f"{diff:.1g}")
    return result


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
