"""Training metrics: throughput, MFU, memory, comm bytes -> console, metrics.jsonl, TensorBoard."""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import torch

# Dense bf16 peak TFLOP/s by device-name fragment (published figures; see docs/metrics.md).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0,
               "4090": 165.0, "3090": 71.0, "V100": 125.0, "TITAN RTX": 130.0}


def device_peak_flops(device: torch.device, configured_tflops: float = 0.0) -> float | None:
    """Peak FLOP/s for MFU: the configured value, else the table for the GPU; None on CPU."""
    if configured_tflops > 0:
        return configured_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in PEAK_TFLOPS.items():
            if key.lower() in name.lower():
                return tflops * 1e12
    return None


def peak_memory_bytes(device: torch.device) -> int:
    """Peak allocated bytes on a GPU (CUDA allocator); peak resident set size on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def peak_reserved_bytes(device: torch.device) -> int | None:
    """Peak bytes the CUDA caching allocator reserved (allocated + cached); None off CUDA."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_reserved(device))
    return None


def _fmt_count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"


def _fmt_time(s: float) -> str:
    s = int(max(0, s))
    if s >= 3600:
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    return f"{s // 60}:{s % 60:02d}"


class ProgressBar:
    """One updating line on a terminal; occasional plain lines when output is a file or a pipe."""

    def __init__(self, total: int, start: int = 0, stream: TextIO | None = None, width: int = 24):
        self.total, self.start, self.width = total, start, width
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()
        self._last_plain = -1
        self._plain_every = max(1, (total - start) // 20)

    def update(self, done: int, fields: str) -> None:
        elapsed = time.perf_counter() - self.t0
        rate = (done - self.start) / elapsed if elapsed > 0 and done > self.start else 0.0
        eta = (self.total - done) / rate if rate > 0 else 0.0
        filled = int(self.width * done / max(1, self.total))
        bar = "#" * filled + "." * (self.width - filled)
        text = f"[{bar}] {done}/{self.total} {fields} | eta {_fmt_time(eta)}"
        if self.tty:
            self.stream.write("\r" + text + "\x1b[K")
            if done >= self.total:
                self.stream.write("\n")
            self.stream.flush()
        elif done >= self.total or done - self._last_plain >= self._plain_every or done == 1:
            self._last_plain = done
            print(text, file=self.stream, flush=True)

    def message(self, text: str) -> None:
        """A line that must not be overwritten by the bar."""
        if self.tty:
            self.stream.write("\r\x1b[K")
        print(text, file=self.stream, flush=True)


class MetricsLogger:
    """Writes metrics.jsonl and TensorBoard events and drives the console on the main rank;
    on every rank, that rank's memory at the logged steps (`memory/rank{R}.jsonl`)."""

    def __init__(self, run_dir: Path, *, main: bool, total_steps: int, start_step: int,
                 tensorboard: bool = False, rank: int | None = None):
        self.main = main
        self.file = open(run_dir / "metrics.jsonl", "a") if main else None  # noqa: SIM115
        # Each rank writes its own memory file: the per-rank picture of `meshloom report`
        # without gathering anything over the network.
        self.memory = None
        if rank is not None:
            (run_dir / "memory").mkdir(parents=True, exist_ok=True)
            self.memory = open(run_dir / "memory" / f"rank{rank}.jsonl", "a")  # noqa: SIM115
        self.bar = ProgressBar(total_steps, start_step) if main else None
        self.tb = None
        if main and tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        """Called on every rank with that rank's record of a logged step."""
        if self.memory is not None:
            mine = {k: record.get(k) for k in ("step", "peak_mem_bytes", "peak_mem_reserved_bytes")
                    if record.get(k) is not None}
            self.memory.write(json.dumps(mine) + "\n")
            self.memory.flush()
        if not self.main:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.tb.add_scalar(key, value, record["step"])
                elif isinstance(value, dict):
                    for sub, v in value.items():
                        self.tb.add_scalar(f"{key}/{sub}", v, record["step"])

    def progress(self, step: int, loss: float, tokens_per_s: float, extra: str = "") -> None:
        if self.bar is not None:
            self.bar.update(step, f"loss {loss:.4f} | {_fmt_count(tokens_per_s)} tok/s{extra}")

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.message(text)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.memory is not None:
            self.memory.close()
        if self.tb is not None:
            self.tb.close()


def live_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     optim_params: list[torch.Tensor]) -> dict[str, int]:
    """Bytes this rank holds right now in parameters, gradients and optimizer state, counted
    from the live tensors' storages (each storage once: flat buffers, shards and their views)."""
    def unique(tensors) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None:
                st = t.untyped_storage()
                seen[st.data_ptr()] = st.nbytes()
        return sum(seen.values())

    params = list(model.parameters())
    return {
        "params": unique(params + list(optim_params)),
        "grads": unique([p.grad for p in params] + [p.grad for p in optim_params]),
        "optimizer": unique(t for st in optimizer.state.values() for t in st.values()
                            if torch.is_tensor(t) and t.ndim > 0),
    }
