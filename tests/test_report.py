"""`meshloom report`: the PNG writer, the measured-vs-predicted numbers, the command's errors."""

import json
import struct
import zlib

import pytest

from meshloom.cli import main
from meshloom.parallel.pipeline_schedule import build_schedule, simulate
from meshloom.png import _FONT, Canvas, text_width
from meshloom.report import ReportError, report, schedule_pictures


def read_png(path):
    """(width, height, rows of raw RGB bytes), checking the signature, CRCs and filter bytes."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.append((kind, body))
        pos += 12 + n
    assert [k for k, _ in chunks][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, color, interlace) == (8, 2, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    assert len(raw) == h * (1 + 3 * w)
    rows = [raw[y * (1 + 3 * w):(y + 1) * (1 + 3 * w)] for y in range(h)]
    assert all(r[0] == 0 for r in rows)
    return w, h, [r[1:] for r in rows]


def test_png_is_decodable(tmp_path):
    c = Canvas(7, 5)
    c.rect(2, 1, 4, 3, (255, 0, 0))
    c.rect(-5, 4, 100, 9, (0, 0, 255))  # clipped
    c.save(tmp_path / "a.png")
    w, h, rows = read_png(tmp_path / "a.png")
    assert (w, h) == (7, 5)
    assert rows[1][6:9] == bytes((255, 0, 0)) and rows[1][12:15] == bytes((255, 255, 255))
    assert rows[4] == bytes((0, 0, 255)) * 7
    assert [p.name for p in tmp_path.iterdir()] == ["a.png"]  # no temporary left behind


def test_text_draws_pixels():
    wanted = ("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
              " .,:;-+=/()%#_[]<>x")
    assert set(wanted) <= set(_FONT)
    for scale in (1, 3):
        c = Canvas(200, 40)
        end = c.text(2, 2, "Bubble 20.0%", (0, 0, 0), scale)
        assert end == 2 + 12 * 6 * scale
        assert text_width("Bubble 20.0%", scale) == 12 * 6 * scale - scale
        inked = sum(c.pixels[i] == 0 for i in range(0, len(c.pixels), 3))
        assert inked > 30 * scale * scale
    blank = Canvas(20, 10)
    blank.text(0, 0, " ")
    assert set(blank.pixels) == {255}


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

    r = report(tmp_path)
    expected = (pp - 1) / (m + pp - 1)  # 0.2
    assert r["ranks"] == [0, 2]
    assert r["measured"]["bubble"] == pytest.approx(expected)
    assert r["predicted"]["bubble"] == pytest.approx(expected)
    assert r["predicted_unit_cost"]["bubble"] == pytest.approx(expected)
    assert r["measured"]["makespan_ms"] == pytest.approx(1e3 * 2 * (m + pp - 1))
    assert r["predicted"]["makespan_ms"] == pytest.approx(r["measured"]["makespan_ms"])
    assert r["measured"]["busy_fraction"] == pytest.approx([1 - expected] * pp)
    w, h, _ = read_png(tmp_path / "pipeline" / "timeline.png")
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
    r = report(tmp_path, draw=False)
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
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not trained with parallel.pp > 1" in err and err.count("\n") == 1
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "timeline_rank0.json").write_text("{not json")
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "timeline_rank0.json is not a pipeline timeline" in err and "Traceback" not in err


def test_schedule_pictures(tmp_path):
    p, m, v = 4, 8, 2
    bubbles = schedule_pictures(tmp_path, p, m, v)
    assert bubbles["gpipe"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["1f1b"] == pytest.approx((p - 1) / (m + p - 1))
    assert bubbles["interleaved_1f1b"] == pytest.approx((p - 1) / (v * m + p - 1))
    assert bubbles["zb_h1"] < bubbles["1f1b"]
    for name in bubbles:
        path = tmp_path / f"pp_{name}.png"
        read_png(path)
        assert path.stat().st_size < 60_000


def test_report_refuses_incomplete_or_malformed_pipelines(tmp_path):
    t = simulate(build_schedule("1f1b", 2, 4))
    write_timelines(tmp_path, t, schedule="1f1b", pp=2, m=4)
    (tmp_path / "pipeline" / "timeline_rank2.json").unlink()
    with pytest.raises(ReportError, match="found pp ranks 0"):
        report(tmp_path)
    write_timelines(tmp_path, t, schedule="1f1b", pp=2, m=4)
    path = tmp_path / "pipeline" / "timeline_rank2.json"
    data = json.loads(path.read_text())
    data["spans"][0] = [0.0, "F"]
    path.write_text(json.dumps(data))
    with pytest.raises(ReportError, match="timeline_rank2.json is not a pipeline timeline"):
        report(tmp_path)


def test_zigzag_picture(tmp_path):
    from meshloom.report import zigzag_picture

    ratios = zigzag_picture(tmp_path / "z.png", cp=4)
    assert ratios["zigzag"] <= 1.1 < 6 < ratios["contiguous"]
    assert (tmp_path / "z.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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
