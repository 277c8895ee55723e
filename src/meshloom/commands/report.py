"""`meshloom report RUN_DIR`: a run's pictures and, for a pipelined run, its measured timeline
against the simulator's (meshloom.report)."""

from __future__ import annotations

import argparse
import sys

from meshloom.launch import EXIT_BAD_INPUT


def run(args: argparse.Namespace) -> int:
    from meshloom.report import ReportError, format_report, report

    try:
        result = report(args.run_dir)
    except ReportError as e:
        print(f"meshloom: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(format_report(result))
    if result["hint"]:
        print(result["hint"], file=sys.stderr)
    return 0


def add_parser(sub) -> None:
    rep = sub.add_parser("report", help="pictures of a run: loss, tokens/s, memory per rank, "
                         "comm per axis; a pipelined run's timeline vs the simulator's")
    rep.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (run.dir)")
    rep.set_defaults(func=run)
