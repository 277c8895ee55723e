"""Smoke test of benchmarks/zero3_accumulation.py: a tiny run on 2 Gloo ranks. Every variant
(meshloom's ZeRO-3 and FSDP2, each reducing every micro-batch or once a step) trains the same
parameters, and meshloom's comm follows from the mode alone: the same gathers, a quarter of the
reduce-scatter bytes with four micro-batches."""

from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

VARIANTS = ["zero3", "zero3_once", "fsdp2", "fsdp2_once"]


def test_zero3_accumulation_smoke(tmp_path):
    out = tmp_path / "zero3_accumulation.json"
    bench = load_benchmark("zero3_accumulation")
    result = bench.main(["--nproc", "2", "--preset", "tiny", "--steps", "2", "--warmup", "1",
                         "--batch", "4", "--seq", "16", "--micro-batches", "4",
                         "--out", str(out)])
    assert json.loads(out.read_text()) == result
    v = result["variants"]
    assert list(v) == VARIANTS and result["check"]["allclose"]
    each, once = v["zero3"]["comm"]["by_op"], v["zero3_once"]["comm"]["by_op"]
    assert once["all_gather"] == each["all_gather"]
    assert once["reduce_scatter"] * 4 == each["reduce_scatter"]
    assert v["fsdp2"]["comm"] is None and v["fsdp2_once"]["comm"] is None
    for name in VARIANTS:
        assert len(v[name]["times_s"]) == 2
        m = v[name]["memory_bytes"]
        assert m["step_peak"] >= m["state"] > 0
    assert v["zero3_once"]["paired_ratio_to_zero3"] > 0
    assert v["fsdp2_once"]["paired_ratio_to_fsdp2"] > 0


def test_micro_batches_must_split_the_batch(capsys):
    bench = load_benchmark("zero3_accumulation")
    for argv in (["--micro-batches", "1"], ["--batch", "6", "--micro-batches", "4"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
        assert "must be 2 or more and divide --batch" in capsys.readouterr().err
