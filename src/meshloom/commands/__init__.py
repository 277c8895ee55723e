"""The `meshloom` command line: one module per command in this package, each registering its
parser (`add_parser`) and running it. Only a command's own code imports torch, when it runs, so
`meshloom --help` and bad-input errors stay fast.

    meshloom train | layout | report | plan | generate | convert | checkpoint | bench
"""

from __future__ import annotations

import argparse
import sys

from meshloom.commands import bench, checkpoint, convert, generate, plan, report, train
from meshloom.launch import EXIT_BAD_INPUT


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        print(f"meshloom: error: {message} (see meshloom --help)", file=sys.stderr)
        sys.exit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="meshloom", description="Train transformers with any mix of parallelism.")
    sub = ap.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in (train, report, plan, generate, convert, checkpoint, bench):
        command.add_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "nproc", 0) < 0:
        print(f"meshloom: error: --nproc={args.nproc} must be >= 1", file=sys.stderr)
        return EXIT_BAD_INPUT
    if getattr(args, "max_restarts", 0) < 0:
        print(f"meshloom: error: --max-restarts={args.max_restarts} must be >= 0",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    return args.func(args)

