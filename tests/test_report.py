"""`meshloom report`: a real run's pictures against its metrics, the measured-vs-predicted
pipeline numbers, the docs' pictures, the command's errors and the missing-matplotlib hint."""

import json
import shutil
import struct
import sys

import pytest
from conftest import tiny_config
from dist_harness import run_ranks

from meshloom.commands import main
from meshloom.parallel.pipeline_schedule import build_schedule, simulate
from meshloom.report import PLOT_HINT, ReportError, pipeline_report, report


def png_size(path):
    """(width, height) from a PNG's header, checking the signature; the file must be a picture
    of some substance, not an empty canvas."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    assert len(data) > 5_000, f"{path} is suspiciously small ({len(data)} bytes)"
    return struct.unpack(">II", data[16:24])


def records_of(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _train(run_dir, cache, overrides):
    from meshloom.train import train

    train(tiny_config(run_dir, cache, "train.sample_tokens=0", *overrides))
    return str(run_dir)


@pytest.fixture(scope="module")
def dp_run(tmp_path_factory, token_cache):
    """2 ranks, data parallel, 6 steps with eval every 3."""
    run_dir = tmp_path_factory.mktemp("dp") / "run"
    run_ranks(_train, 2, run_dir, token_cache,
              ["train.steps=6", "train.eval_every=3", "train.eval_sequences=16"], timeout=240)
    return run_dir


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory, token_cache):
    """2 ranks, pipeline (1F1B, 4 micro-batches), 3 steps with eval at the end."""
    run_dir = tmp_path_factory.mktemp("pp") / "run"
    run_ranks(_train, 2, run_dir, token_cache,
              ["train.steps=3", "train.eval_every=0", "train.eval_sequences=16",
               "parallel.pp=2", "parallel.pp_microbatches=4"], timeout=240)
    return run_dir


def drawn(picture, label):
    """(steps, values in the data's own unit) of one line of a picture."""
    x, y = picture["series"][label]
    return x, [v * picture["scale"] for v in y]


def check_run_pictures(run_dir, r):
    """Every picture exists at its size and shows exactly what the run's files hold."""
    records = records_of(run_dir / "metrics.jsonl")
    steps = [rec["step"] for rec in records]
    pics = r["pictures"]
    for name in ("loss", "throughput", "memory", "comm"):
        assert png_size(run_dir / "report" / f"{name}.png") == (800, 450)
        assert pics[name]["png"] == str(run_dir / "report" / f"{name}.png")
    assert drawn(pics["loss"], "loss") == (steps, [rec["loss"] for rec in records])
    evals = [rec for rec in records if "eval_loss" in rec]
    assert evals, "the run evaluated"
    assert drawn(pics["loss"], "eval loss") == ([rec["step"] for rec in evals],
                                                 [rec["eval_loss"] for rec in evals])
    assert drawn(pics["throughput"], "tokens/s") == (steps,
                                                      [rec["tokens_per_s"] for rec in records])
    assert pics["throughput"]["mfu_per_token_per_s"] is None  # CPU, no run.peak_tflops
    axes = sorted({a for rec in records for a in rec["comm_bytes"]})
    assert sorted(pics["comm"]["series"]) == axes
    for a in axes:
        x, y = drawn(pics["comm"], a)
        assert x == steps
        assert y == pytest.approx([rec["comm_bytes"].get(a, 0) for rec in records], rel=1e-12)
    # Memory: each rank's own file, one line per rank; rank 0's is metrics.jsonl's.
    assert sorted(pics["memory"]["series"]) == ["rank 0", "rank 1"]
    for rank in (0, 1):
        mine = records_of(run_dir / "memory" / f"rank{rank}.jsonl")
        x, y = drawn(pics["memory"], f"rank {rank}")
        assert x == steps == [m["step"] for m in mine]
        assert y == pytest.approx([m["peak_mem_bytes"] for m in mine], rel=1e-12)
    assert drawn(pics["memory"], "rank 0")[1] == pytest.approx(
        [rec["peak_mem_bytes"] for rec in records], rel=1e-12)


def test_report_of_a_data_parallel_run(dp_run, capsys):
    r = report(dp_run)
    assert r["pipeline"] is None and r["hint"] is None
    assert r["run"]["steps"] == [1, 2, 3, 4, 5, 6]
    assert r["run"]["eval_loss"][0] == [3, 6]
    assert r["run"]["memory_source"] == "per-rank files"
    assert "dp" in r["run"]["comm_bytes"]
    check_run_pictures(dp_run, r["run"])

    assert main(["report", str(dp_run)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "run: 6 logged steps (1 to 6)" in out and "eval loss" in out
    assert "tokens/s: median" in out and "(rank " in out and "dp " in out
    for name in ("loss", "throughput", "memory", "comm"):
        assert str(dp_run / "report" / f"{name}.png") in out
    assert "pipeline" not in out


def test_report_of_a_pipeline_run(pp_run, capsys):
    r = report(pp_run)
    check_run_pictures(pp_run, r["run"])
    assert "pp" in r["run"]["comm_bytes"]
    pipe = r["pipeline"]
    assert pipe["schedule"] == "1f1b" and pipe["ranks"] == [0, 1]
    assert pipe["png"] == str(pp_run / "pipeline" / "timeline.png")
    w, h = png_size(pp_run / "pipeline" / "timeline.png")
    assert w == 1000 and h > 300
    assert main(["report", str(pp_run)]) == 0
    out = capsys.readouterr().out
    assert "run: 3 logged steps" in out and "bubble" in out and "timeline.png" in out


def test_without_matplotlib_the_text_and_one_hint_line(dp_run, pp_run, tmp_path, monkeypatch,
                                                       capsys):
    for name, run in (("dp", dp_run), ("pp", pp_run)):
        copy = tmp_path / name
        shutil.copytree(run, copy, ignore=shutil.ignore_patterns("report", "timeline.png"))
    # Importing matplotlib now fails as it does where it is not installed.
    for mod in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.delitem(sys.modules, "meshloom.report.plots", raising=False)
    for name in ("dp", "pp"):
        assert main(["report", str(tmp_path / name)]) == 0
        out, err = capsys.readouterr()
        assert err == PLOT_HINT + "\n"
        assert "Traceback" not in out + err and "tokens/s: median" in out
        assert not (tmp_path / name / "report").exists()
        assert not (tmp_path / name / "pipeline" / "timeline.png").exists()
    assert "bubble" in out and "timeline:" not in out  # the pipeline's numbers, no picture
    assert report(tmp_path / "dp")["run"]["pictures"] == {}


def test_a_run_without_per_rank_memory_files_shows_the_summary_peaks(dp_run, tmp_path):
    run = tmp_path / "old"
    shutil.copytree(dp_run, run, ignore=shutil.ignore_patterns("report", "memory"))
    r = report(run)["run"]
    peaks = json.loads((run / "summary.json").read_text())["peak_mem_bytes_per_rank"]
    assert r["memory_source"] == "summary.json" and len(peaks) == 2
    assert drawn(r["pictures"]["memory"], "peak") == ([0, 1], pytest.approx(peaks, rel=1e-12))
    assert png_size(run / "report" / "memory.png") == (800, 450)


def test_metrics_of_a_live_or_resumed_run(tmp_path):
    """A resumed run logs steps again (the later record wins); a live run's last line may be
    half written (left out); a broken line is refused naming it."""
    lines = [{"step": s, "loss": 5.0 - s, "tokens_per_s": 100.0, "comm_bytes": {}}
             for s in (1, 2, 3)]
    lines += [{"step": 3, "loss": 9.0, "tokens_per_s": 100.0, "comm_bytes": {"dp": 8}},
              {"step": 4, "loss": 1.0, "tokens_per_s": 100.0, "comm_bytes": {"dp": 8}}]
    text = "".join(json.dumps(x) + "\n" for x in lines) + '{"step": 5, "lo'
    (tmp_path / "metrics.jsonl").write_text(text)
    r = report(tmp_path, draw=False)["run"]
    assert r["loss"] == ([1, 2, 3, 4], [4.0, 3.0, 9.0, 1.0])
    assert r["comm_bytes"] == {"dp": ([1, 2, 3, 4], [0.0, 0.0, 8.0, 8.0])}
    (tmp_path / "metrics.jsonl").write_text(text + "\n")
    with pytest.raises(ReportError, match="metrics.jsonl line 6 is not JSON"):
        report(tmp_path, draw=False)
    (tmp_path / "metrics.jsonl").write_text(text.replace('"loss": 3.0', '"loss": "x"'))
    with pytest.raises(ReportError, match="step 2: loss is 'x', not a number"):
        report(tmp_path, draw=False)


def write_timelines(folder, timeline, *, schedule, pp, m, v=1, dp=0, shift=0.0):
    """One pipeline's timeline files as training writes them (ranks pp-major, dp inner); times
    in seconds, `shift` added (the report measures from the earliest start)."""
    pipe = folder / "pipeline"
    pipe.mkdir(parents=True, exist_ok=True)
    for r, spans in enumerate(timeline.spans):
        rank = 2 * r + dp
        data = {"rank": rank, "pp_rank": r, "pp": pp, "schedule": schedule,
                "virtual_stages": v, "microbatches": m, "peak_alive": pp - r,
                "coords": {"pp": r, "dp_replicate": 0, "dp_shard": dp, "cp": 0, "tp": 0},
                "spans": [[shift + s, shift + e, a.kind, a.stage, a.mb] for s, e, a in spans]}
        (pipe / f"timeline_rank{rank}.json").write_text(json.dumps(data))


def test_report_on_unit_times_matches_the_simulator(tmp_path, capsys):
    pp, m = 2, 4
    t = simulate(build_schedule("1f1b", pp, m))
    write_timelines(tmp_path, t, schedule="1f1b", pp=pp, m=m, shift=100.0)
    # The other data-parallel replica's files (slower, later): not the pipeline reported.
    slow = simulate(build_schedule("1f1b", pp, m), lambda a: 1.0 + 2 * a.stage)
    write_timelines(tmp_path, slow, schedule="1f1b", pp=pp, m=m, dp=1, shift=7.0)

    r = pipeline_report(tmp_path)
    expected = (pp - 1) / (m + pp - 1)  # 0.2
    assert r["ranks"] == [0, 2]
    assert r["measured"]["bubble"] == pytest.approx(expected)
    assert r["predicted"]["bubble"] == pytest.approx(expected)
    assert r["predicted_unit_cost"]["bubble"] == pytest.approx(expected)
    assert r["measured"]["makespan_ms"] == pytest.approx(1e3 * 2 * (m + pp - 1))
    assert r["predicted"]["makespan_ms"] == pytest.approx(r["measured"]["makespan_ms"])
    assert r["measured"]["busy_fraction"] == pytest.approx([1 - expected] * pp)
    w, h = png_size(tmp_path / "pipeline" / "timeline.png")
    assert w == 1000 and h > 200
    saved = json.loads((tmp_path / "pipeline" / "report.json").read_text())
    assert saved["measured"]["bubble"] == pytest.approx(expected)

    assert main(["report", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bubble" in out and "20.0%" in out and "timeline.png" in out


def test_report_picks_one_pipeline_and_uses_measured_costs(tmp_path):
    pp, m = 2, 4
    t = simulate(build_schedule("1f1b", pp, m), lambda a: 1.0 + a.stage)  # stage 1 twice as slow
    write_timelines(tmp_path, t, schedule="1f1b", pp=pp, m=m, dp=1, shift=3.0)
    with pytest.raises(ReportError, match="first pipeline"):
        report(tmp_path)
    write_timelines(tmp_path, t, schedule="1f1b", pp=pp, m=m, shift=5.0)
    r = pipeline_report(tmp_path, draw=False)
    assert r["ranks"] == [0, 2] and r["png"] is None
    assert r["predicted"]["bubble"] == pytest.approx(r["measured"]["bubble"])
    assert r["measured"]["bubble"] != pytest.approx(r["predicted_unit_cost"]["bubble"])
    assert r["mean_cost_ms"]["F1"] == pytest.approx(2 * r["mean_cost_ms"]["F0"])


def test_report_rejects_a_timeline_of_another_schedule(tmp_path):
    t = simulate(build_schedule("gpipe", 2, 4))
    write_timelines(tmp_path, t, schedule="zb_h1", pp=2, m=4)
    with pytest.raises(ReportError, match="does not hold the actions of zb_h1"):
        report(tmp_path)


def test_cli_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshloom: error:") and "does not exist" in err
    assert err.count("\n") == 1
    (tmp_path / "file").write_text("")
    assert main(["report", str(tmp_path / "file")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "holds no metrics.jsonl and no pipeline timelines" in err and err.count("\n") == 1
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "timeline_rank0.json").write_text("{not json")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "timeline_rank0.json is not a pipeline timeline" in err and "Traceback" not in err


def test_schedule_pictures(tmp_path):
    from meshloom.report.plots import schedule_pictures

    p, m, v = 4, 8, 2
    bubbles = schedule_pictures(tmp_path, p, m, v)
    assert bubbles["gpipe"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["1f1b"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["interleaved_1f1b"] == pytest.approx((p - 1) / (v * m + p - 1))
    assert bubbles["zb_h1"] < bubbles["1f1b"]
    assert bubbles["interleaved_zb"] == pytest.approx((p - 1) / (3 * v * m + p - 1))
    assert set(bubbles) == {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "interleaved_zb"}
    for name in bubbles:
        path = tmp_path / f"pp_{name}.png"
        w, h = png_size(path)
        assert w == 1000 and 200 < h < 400
        assert path.stat().st_size < 80_000  # small enough to commit under docs/img


def test_report_refuses_incomplete_or_malformed_pipelines(tmp_path):
    t = simulate(build_schedule("1f1b", 2, 4))
    write_timelines(tmp_path, t, schedule="1f1b", pp=2, m=4)
    (tmp_path / "pipeline" / "timeline_rank2.json").unlink()
    with pytest.raises(ReportError, match="found pp ranks 0"):
        pipeline_report(tmp_path)
    write_timelines(tmp_path, t, schedule="1f1b", pp=2, m=4)
    path = tmp_path / "pipeline" / "timeline_rank2.json"
    data = json.loads(path.read_text())
    data["spans"][0] = [0.0, "F"]
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match="timeline_rank2.json is not a pipeline timeline"):
        report(tmp_path)


def test_zigzag_picture(tmp_path):
    from meshloom.report.plots import zigzag_picture

    ratios = zigzag_picture(tmp_path / "z.png", cp=4)
    assert ratios["zigzag"] <= 1.1 < 6 < ratios["contiguous"]
    assert png_size(tmp_path / "z.png") == (750, 460)
    assert [p.name for p in tmp_path.iterdir()] == ["z.png"]  # no temporary left behind


def _step_rows(schedule: str, p: int, m: int, v: int, latency: float) -> list[dict]:
    """Per-rank timeline files holding one simulated step (F 1, B 2 per chunk) whose transfers
    took `latency` each, in the layout PipelineRunner.step_stats writes."""
    t = simulate(build_schedule(schedule, p, m, v), lambda a: (1.0 if a.kind == "F" else 2.0) / v,
                 latency)
    files = []
    for spans in t.spans:
        actions = [(a.kind, a.stage, a.mb, e - s) for s, e, a in spans]
        row = [spans[0][0], spans[-1][1], sum(e - s for s, e, _ in spans), 0.0, actions]
        files.append({"schedule": schedule, "pp": p, "microbatches": m, "virtual_stages": v,
                      "steps": [row]})
    return files


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_bubble_without_transfers_replays_the_measured_durations(schedule, v):
    """With slow transfers a timeline's idle time includes the waits; the replay with the same
    durations and no latency gives the schedule's own bubble, what the planner predicts."""
    from meshloom.report import step_bubbles, step_bubbles_without_transfers

    p, m = 2, 4
    ideal = (p - 1) / ((v if schedule == "interleaved_1f1b" else 1) * m + p - 1)
    files = _step_rows(schedule, p, m, v, latency=0.3)
    assert step_bubbles(files)[0] > ideal + 0.02
    assert step_bubbles_without_transfers(files)[0] == pytest.approx(ideal)
    # A timeline from before per-action durations were recorded cannot be replayed.
    for f in files:
        f["steps"][0] = f["steps"][0][:4]
    assert step_bubbles_without_transfers(files) == [None]


def test_mfu_reads_off_the_tokens_per_s_line(tmp_path):
    """A run that knew its peak FLOP/s: MFU is a fixed multiple of tokens/s, and the picture's
    right-hand axis is that multiple (the first record, without MFU, does not count)."""
    lines = [{"step": 1, "loss": 3.0, "tokens_per_s": 500.0, "mfu": None, "comm_bytes": {}}]
    lines += [{"step": s, "loss": 3.0, "tokens_per_s": 1000.0 * s, "mfu": 0.0004 * s,
               "comm_bytes": {}} for s in (2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = report(tmp_path)["run"]
    assert r["pictures"]["throughput"]["mfu_per_token_per_s"] == pytest.approx(4e-7)
    assert png_size(tmp_path / "report" / "throughput.png") == (800, 450)
    assert sorted(r["pictures"]) == ["loss", "throughput"]  # no memory, no comm: no picture
