"""`meshloom plan` quotes, under its table, how far plans on the chosen GPU have landed from
measured runs (plan/accuracy.py): the committed validation summarised per GPU preset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshloom.plan import accuracy

ROOT = Path(__file__).resolve().parents[1]
VALIDATION = ROOT / "benchmarks" / "results" / "planner" / "validation.json"
PLAN = ["plan", "--model", "gpt2", "--gpus", "8", "--seq", "1024", "--global-batch", "16",
        "--top", "1"]


def _row(set_name: str, gpu: str, gpus: int, error: float, trainer: str | None = None) -> dict:
    row = {"set": set_name, "gpu": gpu, "gpus": gpus, "error": error}
    if trainer:
        row["trainer"] = trainer
    return row


def test_the_packaged_file_is_the_committed_validation_summarised():
    """plan/accuracy.json is `summarise` of validation.json's rows, so the figures `meshloom
    plan` prints cannot drift from the validation docs/plan.md shows."""
    rows = json.loads(VALIDATION.read_text())["rows"]
    assert json.loads(accuracy.ACCURACY_FILE.read_text()) == json.loads(
        json.dumps(accuracy.summarise(rows)))
    summary = json.loads(VALIDATION.read_text())["summary"]
    h100 = accuracy.for_gpu("h100")
    assert h100["meshloom"]["runs"] == summary["meshloom-h100"]["rows"]
    assert h100["meshloom"]["mean_abs_error"] == summary["meshloom-h100"]["mean_abs_error"]
    assert h100["published"]["runs"] == summary["published-h100"]["rows"]
    assert h100["published"]["mean_abs_error"] == summary["published-h100"]["mean_abs_error"]


def test_summarise_splits_meshloom_runs_from_published_ones_per_gpu():
    rows = [_row("meshloom-h100", "h100", 1, -0.02), _row("meshloom-h100", "h100", 1, 0.01),
            _row("published-h100", "h100", 8, 0.10, "nemo"),
            _row("published-h100", "h100", 64, -0.30, "llm-foundry"),
            _row("published-h100", "h100", 16, 0.05, "nemo"),
            _row("megatron-2021-a100", "a100-80g", 3072, 0.04)]
    out = accuracy.summarise(rows)["gpus"]
    assert set(out) == {"h100", "a100-80g"}
    own = out["h100"]["meshloom"]
    assert own == {"runs": 2, "trainers": ["meshloom"], "gpus": [1, 1], "mean_abs_error": 0.015,
                   "mean_error": -0.005, "min_error": -0.02, "max_error": 0.01}
    pub = out["h100"]["published"]
    assert pub == {"runs": 3, "trainers": ["llm-foundry", "nemo"], "gpus": [8, 64],
                   "mean_abs_error": 0.15, "mean_error": -0.05, "min_error": -0.3,
                   "max_error": 0.1}
    assert out["h100"]["by_trainer"] == {
        "llm-foundry": {"runs": 1, "trainers": ["llm-foundry"], "gpus": [64, 64],
                        "mean_abs_error": 0.3, "mean_error": -0.3, "min_error": -0.3,
                        "max_error": -0.3},
        "nemo": {"runs": 2, "trainers": ["nemo"], "gpus": [8, 16], "mean_abs_error": 0.075,
                 "mean_error": 0.075, "min_error": 0.05, "max_error": 0.1}}
    assert out["a100-80g"] == {"published": {
        "runs": 1, "trainers": [accuracy.MEGATRON_2021], "gpus": [3072, 3072],
        "mean_abs_error": 0.04, "mean_error": 0.04, "min_error": 0.04, "max_error": 0.04}}


def test_describe_states_mean_range_and_lean(monkeypatch):
    rows = [_row("meshloom-h200", "h200", 1, -0.0008),
            _row("published-h200", "h200", 8, 0.12, "torchtitan"),
            _row("published-h200", "h200", 128, 0.20, "torchtitan")]
    monkeypatch.setattr(accuracy, "load", lambda: accuracy.summarise(rows))
    lines = accuracy.describe("h200")
    assert lines[0].startswith("accuracy on h200 (planned against measured throughput")
    assert lines[1] == "  meshloom's own 1 run (1 GPU) \u22120.1% off"
    assert accuracy.describe("h200", gpus=8)[1] == (
        "  meshloom's own 1 run (1 GPU) \u22120.1% off; none on more than 1 GPU yet")
    assert lines[2] == ("  2 published runs of torchtitan (8\u2013128 GPUs) 16.0% off on "
                        "average, +12.0% to +20.0%, planned 16.0% fast on average")
    assert len(lines) == 3
    assert accuracy.describe("h200", adjusted=True)[-1] == (
        "Measured with the preset's figures and committed kernel table, which you changed.")
    assert accuracy.describe("titan-rtx-24g") == [
        "accuracy on titan-rtx-24g: no measured run on this GPU has been compared with a plan "
        "(docs/plan-validation.md)"]


def test_describe_puts_the_chosen_trainers_runs_first(monkeypatch):
    rows = [_row("meshloom-h100", "h100", 1, 0.01),
            _row("published-h100", "h100", 8, 0.10, "nemo"),
            _row("published-h100", "h100", 16, 0.06, "nemo"),
            _row("published-h100", "h100", 64, -0.20, "llm-foundry"),
            _row("published-a100-80g", "a100-80g", 8, 0.03, "torchtitan")]
    monkeypatch.setattr(accuracy, "load", lambda: accuracy.summarise(rows))
    lines = accuracy.describe("h100", trainer="nemo")
    assert lines[1:] == [
        "  2 published runs of nemo (8\u201316 GPUs) 8.0% off on average, +6.0% to +10.0%, "
        "planned 8.0% fast on average",
        "  all 3 published runs of llm-foundry, nemo (8\u201364 GPUs) 12.0% off on average, "
        "\u221220.0% to +10.0%, planned 1.3% slow on average"]
    assert accuracy.describe("h100", trainer="torchtitan")[1] == (
        "  no published run of torchtitan on h100 was planned (its runs were on a100-80g)")
    # One trainer's runs are all the GPU's: not said twice.
    assert accuracy.describe("a100-80g", trainer="torchtitan")[1:] == [
        "  1 published run of torchtitan (8 GPUs) +3.0% off, planned 3.0% fast on average"]
    assert "meshloom's own" not in "".join(accuracy.describe("h100", trainer="nemo"))


@pytest.mark.parametrize("gpu", ["h100", "a100-80g", "titan-rtx-24g"])
def test_plan_prints_the_accuracy_of_its_gpu(gpu, capsys):
    from meshloom.commands import main
    assert main([*PLAN, "--gpu", gpu]) == 0
    out = capsys.readouterr().out
    tail = out[out.index("best: memory per GPU"):].splitlines()[1:]
    assert tail == accuracy.describe(gpu, gpus=8)
    assert main([*PLAN, "--gpu", gpu, "--json"]) == 0
    got = json.loads(capsys.readouterr().out)["accuracy"]
    assert got == {"gpu": gpu, "trainer": "meshloom", "adjusted": False,
                   **accuracy.for_gpu(gpu)}


def test_plan_for_a_trainer_quotes_that_trainers_runs(capsys):
    from meshloom.commands import main
    assert main([*PLAN, "--gpu", "h100", "--trainer", "nemo"]) == 0
    out = capsys.readouterr().out
    tail = out[out.index("best: memory per GPU"):].splitlines()[1:]
    assert tail == accuracy.describe("h100", trainer="nemo")
    nemo = accuracy.for_gpu("h100")["by_trainer"]["nemo"]
    assert tail[1].startswith(f"  {nemo['runs']} published runs of nemo ")


@pytest.mark.parametrize("flag", [["--peak-tflops", "900"], ["--gpu-memory-gb", "40"],
                                  ["--inter-node-gbps", "25"], ["--hbm-gbps", "4000"],
                                  ["--kernels", "datasheet"]])
def test_plan_says_when_the_preset_was_changed(flag, capsys):
    from meshloom.commands import main
    assert main([*PLAN, "--gpu", "h100", *flag]) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith("committed kernel table, which you changed.")
    assert main([*PLAN, "--gpu", "h100", *flag, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"]["adjusted"] is True


def test_a_float8_plan_quotes_the_float8_runs_first(monkeypatch):
    rows = [_row("published-h100-96gb-500w", "h100-96gb", 8, 0.16, "torchtitan"),
            _row("published-h100-96gb-500w-float8", "h100-96gb", 8, 0.12, "torchtitan"),
            _row("published-h100-96gb-500w-float8", "h100-96gb", 128, 0.16, "torchtitan"),
            _row("published-h200-float8", "h200", 32, 0.10, "torchtitan"),
            _row("meshloom-h100", "h100", 1, 0.01)]
    summary = accuracy.summarise(rows)
    assert summary["gpus"]["h100-96gb"]["float8"]["runs"] == 2
    assert "float8" not in summary["gpus"]["h100"]
    monkeypatch.setattr(accuracy, "load", lambda: summary)
    lines = accuracy.describe("h100-96gb", trainer="torchtitan", float8=True)
    assert lines[1:] == [
        "  2 published Float8 runs of torchtitan (8\u2013128 GPUs) 14.0% off on average, "
        "+12.0% to +16.0%, planned 14.0% fast on average",
        "  3 published runs of torchtitan (8\u2013128 GPUs) 14.7% off on average, "
        "+12.0% to +16.0%, planned 14.7% fast on average"]
    # every run on the GPU is a Float8 one: said once
    assert accuracy.describe("h200", trainer="torchtitan", float8=True)[1:] == [
        "  1 published Float8 run of torchtitan (32 GPUs) +10.0% off, planned 10.0% fast on "
        "average"]
    assert accuracy.describe("h100", float8=True)[1] == (
        "  no published Float8 run on h100 was planned")
    assert "Float8" not in "".join(accuracy.describe("h100-96gb", trainer="torchtitan"))
