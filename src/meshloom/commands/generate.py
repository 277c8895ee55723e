"""`meshloom generate`: text from a checkpoint, tensor-parallel over --tp ranks, KV-cached.

The request is checked here, in the parent process, before any rank starts (one line and exit
status 2 if it cannot run). tp=1 runs in this process; tp > 1 launches tp ranks through
`torch.distributed.run` (torchrun), each running `python -m meshloom.inference`. Rank 0 prints
the text on stdout; everything else goes to stderr. The work itself is meshloom.inference,
imported only when the command runs (it imports torch; the parser must not).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

EXAMPLE = ("examples:\n"
           "  meshloom generate --checkpoint runs/tiny --prompt 'def ' --temperature 0\n"
           "  meshloom generate --checkpoint runs/tiny/checkpoints/step_0000020 --tp 2 \\\n"
           "      --prompt 'import ' --max-new-tokens 200 --temperature 0.8 --top-k 40 --seed 1")


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text from a checkpoint (tensor parallel, "
                       "KV cache)", epilog=EXAMPLE,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, metavar="DIR",
                   help="a run folder (its newest intact checkpoint is used) or a checkpoint "
                        "folder (step_NNNNNNN), saved under any training layout")
    p.add_argument("--prompt", required=True, help="the text to continue")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks to run on")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=40, help="0 = sample from the whole vocabulary")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed (the same on every rank, so all ranks agree)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ignore-eos", action="store_true",
                   help="keep going past the tokenizer's end-of-text token")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (text, token counts, tokens/s) instead of the text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from meshloom.inference import GenerateError, Request, prepare
    from meshloom.launch import EXIT_BAD_INPUT

    req = Request(path=args.checkpoint, prompt=args.prompt, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_k=args.top_k or None, seed=args.seed,
                  tp=args.tp, device=args.device, stop_at_eos=not args.ignore_eos)
    try:
        prep = prepare(req)
    except GenerateError as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    # The ranks load the checkpoint checked here, not whichever is newest when they start.
    req = replace(req, path=str(prep.checkpoint))
    if req.tp == 1:
        return _in_process(req, args.json)
    return _torchrun(req, args.json)


def _in_process(req, as_json: bool) -> int:
    from meshloom.inference import main as rank_main

    rank_args = ["--request", json.dumps(asdict(req))] + (["--json"] if as_json else [])
    return rank_main(rank_args)


def _torchrun(req, as_json: bool) -> int:
    from meshloom.launch import Launch, torchrun

    rank_args = ["--request", json.dumps(asdict(req))] + (["--json"] if as_json else [])
    return torchrun(Launch("meshloom.inference", rank_args, req.tp, what="generate"))
