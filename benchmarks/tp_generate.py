"""Tensor-parallel generation with a KV cache: prefill and decode tokens/s at tp = 1, 2, 4.

Every degree runs the same model (same seed, random weights: speed does not depend on them) on
the same random prompt, in launches of tp ranks: the model cut by `Llama.TP_PLAN` over tp ranks
(tp=1: the plain model), then `generate_cached` greedy for `--new-tokens` tokens (eos ignored).
The prefill is the prompt's forward pass and the first token; decode is every later token, one
forward pass each. Each round launches every degree once (`--warmup` untimed generations, then
one timed), in an order that rotates every round; a generation's times are its slowest rank's.
Each rank runs `--threads` torch threads (default 1: a core per rank, as a GPU per rank).

Why small-model decoding does not speed up with tp: each decode step moves a few KB, but in
2 * n_layers + 2 collectives (an all-reduce after attention and after the MLP of every layer,
one for the vocabulary-parallel embedding, one all-gather of the logits), and each costs a fixed
latency however small it is. The script measures that latency (an all-reduce of one step's
activations on the same group) and reports the collectives' predicted share of a decode step.
The prefill does the same number of collectives for a whole prompt, so it is compute bound and
gains from tp where decoding cannot.

    python benchmarks/tp_generate.py                       # small preset (8 heads, 4 KV), tp 1,2,4
    python benchmarks/tp_generate.py --tps 1,2 --new-tokens 32 --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from meshloom import comm
from meshloom.comm import CommCounter
from meshloom.inference import make_pick
from meshloom.mesh import Mesh, ParallelDims
from meshloom.models.generate import generate_cached
from meshloom.models.llama import LlamaConfig, build_model, config_from_preset
from meshloom.parallel.tensor import padded_vocab
from meshloom.parallel.tensor_plan import TensorParallel, check_tp_dims

# benchmarks/ is a folder of scripts, not a package: make its shared modules importable however
# this file was loaded (as a script, or by path from a test).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import (  # noqa: E402
    cpu_unless_gpus,
    init_rank,
    launch,
    paired,
    parser,
    provenance,
    round_order,
    threads_per_rank,
    write_result,
)

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "tp_generate.json"
LATENCY_PROBES = 50  # all-reduces timed to measure one's latency
LATENCY_NOTE = (
    "a decode step of a small model is latency bound under tp: per token it runs "
    "2 * n_layers + 1 all-reduces (attention and MLP outputs of every layer, the vocabulary-"
    "parallel embedding) and 1 all-gather of the last position's logits, each carrying only a "
    "few KB, so each costs about the fixed latency of a collective. comm_share_estimate = "
    "collectives_per_token x the measured all-reduce latency / the decode step time: where it "
    "approaches the time tp saves on the matmuls, more ranks cannot help. The prefill runs the "
    "same collectives once for the whole prompt, so its matmuls dominate and it does gain")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--tps", default="1,2,4", help="comma-separated tp degrees, run in order")
    p.add_argument("--preset", default="small", choices=["tiny", "demo", "small"])
    p.add_argument("--heads", type=int, default=8, help="override the preset's n_heads (0: keep)")
    p.add_argument("--kv-heads", type=int, default=4,
                   help="override the preset's n_kv_heads (0: keep); tp must divide it")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=1, help="sequences generated together")
    p.add_argument("--repeats", type=int, default=5,
                   help="rounds: each launches every degree for one timed generation")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed generations in each launch before the timed one")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per rank: 1 = one core per rank, as one device per rank "
                        "on GPUs; 0 = the machine's cores shared out (cores // tp)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    try:
        args.tps = [int(t) for t in args.tps.split(",") if t]
    except ValueError:
        p.error("--tps: comma-separated integers")
    if not args.tps or len(set(args.tps)) != len(args.tps) or min(args.tps) < 1:
        p.error("--tps: give distinct degrees >= 1")
    if args.threads < 0:
        p.error("--threads must be >= 0")
    if args.repeats < 1 or args.warmup < 0 or args.new_tokens < 2 or args.prompt_len < 1:
        p.error("need --repeats >= 1, --warmup >= 0, --new-tokens >= 2, --prompt-len >= 1")
    cfg = model_config(args)
    if args.prompt_len + args.new_tokens - 1 > cfg.max_seq_len:
        p.error(f"--prompt-len + --new-tokens - 1 exceeds max_seq_len={cfg.max_seq_len}")
    for tp in args.tps:
        problem = check_tp_dims(tp, n_heads=cfg.n_heads, kv_heads=cfg.kv_heads,
                                ffn_hidden=cfg.hidden)
        if problem:
            p.error(problem.replace("parallel.tp", "tp"))
    return args


def model_config(args: argparse.Namespace) -> LlamaConfig:
    overrides = {k: v for k, v in (("n_heads", args.heads), ("n_kv_heads", args.kv_heads)) if v}
    return config_from_preset(args.preset, **overrides)


# ----------------------------------------------------------------------------- one rank


def allreduce_latency(mesh: Mesh, shape: tuple[int, ...], device: torch.device) -> float:
    """Median seconds of one all-reduce of a decode step's activations on the tp group."""
    x = torch.zeros(shape, device=device)
    times = []
    for _ in range(LATENCY_PROBES):
        t0 = time.perf_counter()
        dist.all_reduce(x, group=mesh.group("tp"))
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class CollectiveClock:
    """Wall time spent inside the collectives tensor-parallel decoding issues (all-reduce, and
    the all-gather of the logits), waiting for the other ranks included: what tp adds to a
    step. Wraps the functions `meshloom.comm` calls, for the duration of a `with` block."""

    def __init__(self):
        self.seconds, self.calls = 0.0, 0

    def _timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0
                self.calls += 1
        return run

    def __enter__(self) -> CollectiveClock:
        self._saved = (comm.dist.all_reduce, comm._all_gather_flat)
        comm.dist.all_reduce = self._timed(self._saved[0])
        comm._all_gather_flat = self._timed(self._saved[1])
        return self

    def __exit__(self, *exc) -> None:
        comm.dist.all_reduce, comm._all_gather_flat = self._saved


def _threads(args: argparse.Namespace, tp: int) -> int:
    return args.threads or threads_per_rank(tp)


def _rank_main(args: argparse.Namespace, rank: int, world: int) -> dict:
    torch.set_num_threads(_threads(args, world))
    device = init_rank(args, rank, world)
    mesh = Mesh(ParallelDims(tp=world), rank, device.type, CommCounter())
    cfg = model_config(args)
    model = build_model(cfg, args.seed, device).eval()
    tp = TensorParallel(model, model.TP_PLAN, mesh) if world > 1 else None
    g = torch.Generator().manual_seed(args.seed + 1)
    prompt = torch.randint(0, cfg.vocab_size, (args.batch, args.prompt_len), generator=g)
    prompt = prompt.to(device)
    pick = make_pick(tp, 0.0, None, None)  # greedy: every degree must give the same tokens
    for _ in range(args.warmup + 1):  # the last generation is the timed one
        dist.barrier()
        mesh.counter.reset()
        with CollectiveClock() as clock:
            gen = generate_cached(model, prompt, args.new_tokens, temperature=0, pick=pick)
    calls = {op: n for (_, op), n in mesh.counter.calls.items()}  # the last generation's
    latency = allreduce_latency(mesh, (args.batch, 1, cfg.dim), device) if world > 1 else 0.0
    mine = {"prefill_s": gen.prefill_s, "decode_s": gen.decode_s, "tokens": gen.tokens.cpu(),
            "decode_steps": gen.decode_steps, "calls": calls, "latency_s": latency,
            "collective_s": clock.seconds,
            "params": cfg.num_params()}
    out: list = [None] * world
    dist.all_gather_object(out, mine)
    return {"ranks": out}


def _one_launch(args: argparse.Namespace, tp: int) -> dict:
    """One generation timed on tp ranks: its slowest rank's times."""
    a = copy.copy(args)
    a.nproc = tp
    ranks = launch(_rank_main, a)["ranks"]
    return {"prefill_s": max(r["prefill_s"] for r in ranks),
            "decode_s": max(r["decode_s"] for r in ranks),
            "latency_s": max(r["latency_s"] for r in ranks),
            # In collectives, waiting included; the rank that waited least shows what tp costs.
            "collective_s": min(r["collective_s"] for r in ranks),
            "tokens": ranks[0]["tokens"], "decode_steps": ranks[0]["decode_steps"],
            "calls": ranks[0]["calls"], "params": ranks[0]["params"]}


# ----------------------------------------------------------------------------- report


def main(argv: list[str] | None = None) -> dict:
    """Run every tp degree, print a table, write the JSON to --out and return the same dict."""
    args = parse_args(argv)
    cpu_unless_gpus(args, max(args.tps))
    cfg = model_config(args)
    prompt_tokens = args.batch * args.prompt_len
    load_start = list(os.getloadavg())  # the machine's load: others' jobs slow every rendezvous
    # One launch per degree and round; the order rotates every round and runs backwards every
    # other cycle, so a machine whose load drifts slows every degree alike.
    samples: dict[int, list[dict]] = {tp: [] for tp in args.tps}
    for rnd in range(args.repeats):
        for tp in round_order(args.tps, rnd):
            samples[tp].append(_one_launch(args, tp))
    runs = {}
    first = samples[args.tps[0]]
    for tp, got in samples.items():
        pre, dec = [g["prefill_s"] for g in got], [g["decode_s"] for g in got]
        steps = got[0]["decode_steps"]
        passes = steps + 1  # the prefill, then one forward pass per decode step
        per_pass = {op: n / passes for op, n in got[0]["calls"].items()}
        decode_step_s = statistics.median(dec) / steps
        latency = statistics.median(g["latency_s"] for g in got)
        runs[tp] = {
            "ranks": tp, "threads_per_rank": _threads(args, tp),
            "prefill_s": pre, "decode_s": dec,
            "prefill_tokens_per_s": prompt_tokens / statistics.median(pre),
            "decode_tokens_per_s": args.batch * steps / statistics.median(dec),
            "decode_ms_per_step": decode_step_s * 1e3,
            "paired_prefill_speedup": paired([f["prefill_s"] for f in first], pre),
            "paired_decode_speedup": paired([f["decode_s"] for f in first], dec),
            "collectives_per_token": per_pass,
            "decode_bytes_per_token": (
                0 if tp == 1 else 4 * args.batch * (per_pass.get("all_reduce", 0) * cfg.dim
                                                    + padded_vocab(cfg.vocab_size, tp))),
            "allreduce_latency_us": latency * 1e6,
            "comm_share_estimate": sum(per_pass.values()) * latency / decode_step_s,
            "collective_share": statistics.median(
                g["collective_s"] / (g["prefill_s"] + g["decode_s"]) for g in got),
            "agrees_with_first": all(torch.equal(g["tokens"], first[0]["tokens"]) for g in got),
            "params": got[0]["params"],
        }
    base = runs[args.tps[0]]
    for r in runs.values():
        r["prefill_speedup"] = r["prefill_tokens_per_s"] / base["prefill_tokens_per_s"]
        r["decode_speedup"] = r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    result = {
        "config": {"tps": args.tps, "preset": args.preset, "n_heads": cfg.n_heads,
                   "n_kv_heads": cfg.kv_heads, "dim": cfg.dim, "n_layers": cfg.n_layers,
                   "params": cfg.num_params(), "prompt_len": args.prompt_len,
                   "new_tokens": args.new_tokens, "batch": args.batch, "repeats": args.repeats,
                   "warmup": args.warmup, "threads": args.threads, "device": args.device,
                   "backend": "nccl" if args.device == "cuda" else "gloo",
                   **provenance(),
                   "load_average": {"start": load_start, "end": list(os.getloadavg())}},
        "runs": {str(tp): r for tp, r in runs.items()},
        "reference_tp": args.tps[0],
        "latency_note": LATENCY_NOTE,
        "time_note": "medians over the rounds of the slowest rank's time, each rank running "
                     "threads_per_rank torch threads; with more ranks x threads than cores the "
                     "times also measure oversubscription. paired_*_speedup: median over the "
                     "rounds of the first degree's time / this one's in the same round",
        "check": {"ok": all(r["agrees_with_first"] for r in runs.values()),
                  "what": "greedy tokens identical at every tp degree"},
    }
    return write_result(result, args.out, _print_table)


def _print_table(r: dict) -> None:
    c = r["config"]
    print(f"{c['preset']} (dim {c['dim']}, {c['n_layers']} layers, {c['n_heads']} heads, "
          f"{c['n_kv_heads']} KV; {c['params'] / 1e6:.2f}M params), batch {c['batch']}, "
          f"prompt {c['prompt_len']}, {c['new_tokens']} new tokens, {c['backend']} on "
          f"{c['device']}, medians of {c['repeats']} rounds")
    print(f"{'tp':>3}{'thr':>4}{'prefill tok/s':>14}{'x':>6}{'px':>6}{'decode tok/s':>13}"
          f"{'x':>6}{'px':>6}{'ms/tok':>8}{'colls':>6}{'AR us':>7}{'est%':>6}{'in%':>5}")
    for tp, v in r["runs"].items():
        colls = sum(v["collectives_per_token"].values())
        print(f"{tp:>3}{v['threads_per_rank']:>4}{v['prefill_tokens_per_s']:14.0f}"
              f"{v['prefill_speedup']:6.2f}{v['paired_prefill_speedup']:6.2f}"
              f"{v['decode_tokens_per_s']:13.1f}{v['decode_speedup']:6.2f}"
              f"{v['paired_decode_speedup']:6.2f}{v['decode_ms_per_step']:8.2f}{colls:6.0f}"
              f"{v['allreduce_latency_us']:7.0f}{100 * v['comm_share_estimate']:5.0f}%"
              f"{100 * v['collective_share']:4.0f}%")
    print("x: speedup over the first degree (px: paired, same round); colls: collectives per "
          "token; AR us: one all-reduce of a step's activations; est%: colls x AR / ms/tok; "
          "in%: share of the generation spent inside collectives (least-waiting rank)")
    print(f"greedy tokens identical at every tp: {r['check']['ok']}")


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["check"]["ok"] else 1)
