"""Faults injected into real training runs, for the tests, through the seam the training loop
calls at two fixed points of every step (meshloom.faults.install): the loop itself knows
nothing of them.

A fault is `kind:R:S` (rank R at 0-based step S): `kill` (SIGKILL), `term` (SIGTERM), `raise`
(an exception), `stall` (sleeps forever); or `nan:S` (rank 0's gradients become NaN). It fires
on the first attempt of a run only (a rank restarted by --max-restarts runs cleanly), or on
every attempt with a trailing `:always`.

In this process or forked ranks: `with injected("kill:1:2"): train(cfg)`. In a `meshloom train`
subprocess: run it with `env("kill:1:2")`, which puts fault_site/ on PYTHONPATH: its
sitecustomize installs the fault named by MESHLOOM_FAULT in every Python process of the run.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from meshloom import faults

SITE = Path(__file__).resolve().parent / "fault_site"


@dataclass
class Fault:
    kind: str
    rank: int
    step: int
    always: bool = False

    @classmethod
    def parse(cls, spec: str) -> Fault:
        parts = spec.split(":")
        always = parts[-1] == "always"
        parts = parts[:-1] if always else parts
        if parts[0] == "nan":
            return cls("nan", 0, int(parts[1]), always)
        return cls(parts[0], int(parts[1]), int(parts[2]), always)

    def _now(self, rank: int, step: int) -> bool:
        first = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
        return (first or self.always) and rank == self.rank and step == self.step

    def step_started(self, rank: int, step: int) -> None:
        if not self._now(rank, step):
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.kind == "raise":
            raise RuntimeError(f"fault injected by MESHLOOM_FAULT at step {step + 1}")
        elif self.kind == "stall":
            while True:
                time.sleep(3600)

    def gradients_ready(self, rank: int, step: int, params: list[torch.Tensor]) -> None:
        if self.kind == "nan" and self._now(rank, step):
            next(p for p in params if p.grad is not None).grad.fill_(float("nan"))


@contextlib.contextmanager
def injected(spec: str) -> Iterator[None]:
    """The fault `spec` ("" for none) is installed in this process while the block runs."""
    remove = faults.install(Fault.parse(spec)) if spec else None
    try:
        yield
    finally:
        if remove is not None:
            remove()


def env(spec: str) -> dict[str, str]:
    """The environment for a `meshloom train` subprocess whose ranks get the fault `spec`."""
    # This checkout's meshloom first (a relative PYTHONPATH would not hold in the run's folder).
    src = str(SITE.parents[1] / "src")
    path = os.pathsep.join(p for p in (str(SITE), src, os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONUNBUFFERED": "1", "MESHLOOM_FAULT": spec, "PYTHONPATH": path}


def install_from_env() -> None:
    spec = os.environ.get("MESHLOOM_FAULT", "")
    if spec:
        faults.install(Fault.parse(spec))
