"""The checkpoint package's one format check and one resolver, on hand-made folders (no
process group, nothing trained): each refusal is one line naming the folder and what is wrong,
and the commands that read checkpoints (generate, convert / init_from) say the same."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from meshloom.checkpoint import CheckpointError, checked_meta, checkpoints_in, open_checkpoint
from meshloom.checkpoint import files as ckpt_files
from meshloom.checkpoint.find import step_folder
from meshloom.inference import GenerateError, Request, prepare
from meshloom.weights import WeightsError, open_source


def _checkpoint(folder: Path, fmt: object = 4, manifest: bool = True) -> Path:
    """A committed-looking checkpoint folder: an index, one data file, the manifest, meta.json."""
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(b"index")
    (folder / "__0_0.distcp").write_bytes(b"x" * 100)
    if manifest:
        listed = ckpt_files.describe(folder, ckpt_files.data_files(folder))
        ckpt_files.write_json_atomic(folder / ckpt_files.MANIFEST, {"files": listed})
    (folder / "meta.json").write_text(json.dumps({"format": fmt, "config": {}}))
    return folder


def _run(root: Path, steps: list[int]) -> Path:
    for s in steps:
        _checkpoint(step_folder(root, s))
    return root


def _refused(call, *args, match: str, error: type[Exception] = CheckpointError, **kw) -> str:
    with pytest.raises(error) as e:
        call(*args, **kw)
    text = str(e.value)
    assert "\n" not in text, text
    assert match in text, text
    return text


# ---------------------------------------------------------------- the resolver


def test_checkpoint_folder_is_used_as_named(tmp_path):
    run = _run(tmp_path / "run", [2, 4])
    older = step_folder(run, 2)
    path, meta = open_checkpoint(older)
    assert path == older and meta["format"] == 4
    assert checkpoints_in(older) == [older]


def test_run_folder_and_its_checkpoints_folder_give_the_newest(tmp_path):
    run = _run(tmp_path / "run", [2, 10, 4])  # step 10 is newest, whatever the listing order
    (run / "checkpoints" / ".tmp-step_0000012").mkdir()  # a save that never committed
    _checkpoint(run / "checkpoints" / "step_0000014").joinpath("meta.json").unlink()
    for where in (run, run / "checkpoints"):
        assert open_checkpoint(where, log=pytest.fail)[0] == step_folder(run, 10)
        assert [p.name for p in checkpoints_in(where)] == \
            ["step_0000002", "step_0000004", "step_0000010"]


def test_run_folder_skips_a_damaged_newest_checkpoint_saying_why(tmp_path):
    run = _run(tmp_path / "run", [2, 4])
    os.truncate(step_folder(run, 4) / "__0_0.distcp", 10)
    said: list[str] = []
    assert open_checkpoint(run, log=said.append)[0] == step_folder(run, 2)
    assert said == [f"checkpoint {step_folder(run, 4)} is damaged: __0_0.distcp has 10 bytes, "
                    "the manifest says 100 (truncated or overwritten); falling back to the "
                    "previous one"]
    # Named directly, the damaged one is refused, not swapped for another.
    _refused(open_checkpoint, step_folder(run, 4), match="is damaged: __0_0.distcp has 10 bytes")
    os.truncate(step_folder(run, 2) / "__0_0.distcp", 10)
    _refused(open_checkpoint, run, log=said.append,
             match=f"no intact checkpoint in {run / 'checkpoints'}: all 2 are damaged")


def test_missing_or_empty_folders_are_one_line(tmp_path):
    _refused(open_checkpoint, tmp_path / "nowhere", match=f"{tmp_path / 'nowhere'}: no such folder")
    (tmp_path / "file").write_text("")
    _refused(open_checkpoint, tmp_path / "file", match="not a folder")
    _refused(checkpoints_in, tmp_path, match=f"{tmp_path} holds no complete checkpoint")
    (tmp_path / "checkpoints" / ".tmp-step_0000002").mkdir(parents=True)  # never committed
    _refused(open_checkpoint, tmp_path, match="holds no complete checkpoint")


# ---------------------------------------------------------------- the format check


def test_damaged_manifest(tmp_path):
    ck = _checkpoint(tmp_path / "a")
    (ck / "manifest.json").write_text("{not json")
    _refused(checked_meta, ck, match=f"checkpoint {ck}: manifest.json is unreadable")
    (ck / "manifest.json").unlink()
    _refused(checked_meta, ck, match=f"checkpoint {ck} has no manifest.json")
    # Without verification (a resume verifies collectively first) the manifest is not read.
    assert checked_meta(ck, resume=True, verify=False)["format"] == 4


def test_a_changed_file_is_named(tmp_path):
    ck = _checkpoint(tmp_path / "a")
    (ck / "__0_0.distcp").write_bytes(b"y" * 100)
    _refused(checked_meta, ck, match="is damaged: __0_0.distcp does not match its SHA-256")
    (ck / "__0_0.distcp").unlink()
    _refused(checked_meta, ck, match="is damaged: __0_0.distcp is missing")


@pytest.mark.parametrize("fmt", [2, 5, "4", True, None])
def test_unknown_format_version(tmp_path, fmt):
    ck = _checkpoint(tmp_path / "a", fmt=fmt, manifest=False)
    _refused(checked_meta, ck, match=f"checkpoint {ck} has format {fmt}; this meshloom reads "
                                     "formats 3..4")


def test_format_3_serves_as_weights_but_not_for_a_resume(tmp_path):
    ck = _checkpoint(tmp_path / "a", fmt=3, manifest=False)  # format 3 had no manifest
    assert checked_meta(ck)["format"] == 3
    _refused(checked_meta, ck, resume=True, match=f"checkpoint {ck} has format 3; a run resumes "
                                                  "only from format 4")
    assert checked_meta(_checkpoint(tmp_path / "b"), resume=True, verify=False)["format"] == 4


def test_incomplete_and_unreadable_meta(tmp_path):
    ck = _checkpoint(tmp_path / "a")
    (ck / ".metadata").unlink()
    _refused(checked_meta, ck, match=f"checkpoint {ck} is incomplete: it has no DCP .metadata")
    (ck / "meta.json").write_text("{")
    _refused(checked_meta, ck, match=f"checkpoint {ck}: unreadable meta.json")
    (ck / "meta.json").write_text("[4]")
    _refused(checked_meta, ck, match="meta.json is not a JSON object")
    (ck / "meta.json").unlink()  # the manifest still marks it a checkpoint folder
    _refused(open_checkpoint, ck, match=f"checkpoint {ck} has no meta.json")


def test_generate_and_weights_refuse_with_the_same_line(tmp_path):
    """generate (inference.prepare) and convert / model.init_from (weights.open_source) run the
    package's check: the same one-line message, in their own error type."""
    ck = _checkpoint(tmp_path / "run" / "checkpoints" / "step_0000002", fmt=5)
    want = f"checkpoint {ck} has format 5; this meshloom reads formats 3..4"
    for where in (ck, tmp_path / "run"):
        log: list[str] = []
        _refused(open_checkpoint, where, log=log.append,
                 match=want if where == ck else "no intact checkpoint")
        assert log == ([] if where == ck else [f"{want}; falling back to the previous one"])
    assert _refused(prepare, Request(path=str(ck), prompt="x"), match=want,
                    error=GenerateError) == want
    assert _refused(open_source, ck, match=want, error=WeightsError) == want
    _refused(open_source, tmp_path, error=WeightsError,
             match="neither a meshloom weights folder (meshloom.json), a checkpoint")
