import json
import sys
import threading

import numpy as np
import pytest
import torch

from meshloom import data
from meshloom.data import (
    BatchLoader,
    ByteTokenizer,
    DataError,
    TokenDataset,
    build_token_cache,
    eval_batches,
    iter_documents,
    load_tokenizer,
    resolve_sources,
)


def write_corpus(root, n_files=6, size=3000):
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n_files):
        words = [f"w{int(x)}" for x in rng.integers(0, 500, size // 4)]
        (root / f"doc{i}.txt").write_text(" ".join(words)[:size])
    return root


@pytest.fixture
def cache(tmp_path):
    return build_token_cache(str(write_corpus(tmp_path / "corpus")), ByteTokenizer(),
                             tmp_path / "cache")


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_roundtrips_unicode():
    tok = ByteTokenizer()
    text = "héllo wörld ✓ 日本語 🚀\n"
    ids = tok.encode(text)
    assert max(ids) < 256 and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids + [tok.eos_id]) == text
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode([0xFF]) == "\ufffd"  # invalid utf-8 is replaced, not raised


def test_load_tokenizer_rejects_unknown_spec(tmp_path):
    assert isinstance(load_tokenizer("byte"), ByteTokenizer)
    with pytest.raises(DataError, match="data.tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))


def test_hf_tokenizer_without_package_says_how_to_install(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import now raises ImportError
    with pytest.raises(DataError, match="pip install tokenizers"):
        load_tokenizer(str(tmp_path))


def test_hf_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=["<unk>", "</s>"])
    tok.train_from_iterator(["the cat sat", "on the mat", "the end"], trainer)
    folder = tmp_path / "tok"
    folder.mkdir()
    tok.save(str(folder / "tokenizer.json"))

    hf = load_tokenizer(str(folder))
    assert hf.name == f"hf:{(folder / 'tokenizer.json').resolve()}"
    assert hf.eos_id == tok.token_to_id("</s>") and hf.vocab_size == tok.get_vocab_size()
    ids = hf.encode("the cat sat on the mat")
    assert hf.decode(ids) == "the cat sat on the mat"

    (tmp_path / "c.txt").write_text("the cat sat on the mat " * 50)
    f = build_token_cache(str(tmp_path / "c.txt"), hf, tmp_path / "cache")
    tokens = np.fromfile(f, dtype=np.uint16)
    assert tokens[-1] == hf.eos_id and len(tokens) == 6 * 50 + 1
    assert json.loads(f.with_suffix(".json").read_text())["tokenizer"] == hf.name

    # No known eos token: eos gets a fresh id past the vocabulary.
    bare = tokenizers.Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    bare.save(str(tmp_path / "bare.json"))
    hf2 = load_tokenizer(str(tmp_path / "bare.json"))
    assert (hf2.eos_id, hf2.vocab_size) == (3, 4)
    assert hf2.decode([0, 3, 1]) == "a b"


# ---------------------------------------------------------------- sources


def test_sources_file_folder_glob(tmp_path):
    root = write_corpus(tmp_path / "c", n_files=3)
    (root / "sub").mkdir()
    (root / "sub" / "x.md").write_text("# md")
    (root / "skip.bin").write_bytes(b"\0")
    (root / ".hidden").mkdir()
    (root / ".hidden" / "h.txt").write_text("no")

    folder = resolve_sources(str(root))
    assert [p.name for p in folder] == ["doc0.txt", "doc1.txt", "doc2.txt", "x.md"]
    assert resolve_sources(str(root / "doc1.txt")) == [(root / "doc1.txt").resolve()]
    globbed = resolve_sources([str(root / "doc*.txt"), str(root / "doc0.txt")])
    assert [p.name for p in globbed] == ["doc0.txt", "doc1.txt", "doc2.txt"]  # de-duplicated

    with pytest.raises(DataError, match=r"data.source: no files match '.*foo/\*.txt'"):
        resolve_sources(str(tmp_path / "foo/*.txt"))
    with pytest.raises(DataError, match="data.source: no such file"):
        resolve_sources([str(root), str(tmp_path / "missing.txt")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="data.source"):
        resolve_sources(str(tmp_path / "empty"))


def test_stdlib_source(tmp_path):
    paths = resolve_sources("stdlib")
    assert len(paths) > 300 and paths == sorted(paths) == resolve_sources("stdlib")
    assert all(p.suffix == ".py" for p in paths)
    assert not any({"site-packages", "test", "tests"} & set(p.parts) for p in paths)
    f = build_token_cache("stdlib", ByteTokenizer(), tmp_path, max_bytes=50_000)
    meta = json.loads(f.with_suffix(".json").read_text())
    # Stops after the document that crosses max_bytes.
    assert 50_000 <= meta["bytes_read"] and meta["n_documents"] < len(paths)
    assert meta["n_tokens"] == meta["bytes_read"] + meta["n_documents"]


def test_jsonl_documents(tmp_path):
    good = tmp_path / "a.jsonl"
    good.write_text('{"text": "first"}\n\n{"text": "sec\\u00f6nd", "id": 2}\n')
    plain = tmp_path / "b.txt"
    plain.write_text("whole\nfile")
    assert list(iter_documents([good, plain])) == ["first", "secönd", "whole\nfile"]

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no field 'text'"):
        list(iter_documents([bad]))
    other = tmp_path / "other.jsonl"
    other.write_text('{"body": "b1"}\n{"body": "b2", "text": "t"}\n')
    assert list(iter_documents([other], jsonl_field="body")) == ["b1", "b2"]
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(DataError, match=r"broken.jsonl:1: invalid JSON"):
        list(iter_documents([broken]))

    f = build_token_cache(str(good), ByteTokenizer(), tmp_path / "cache")
    tokens = np.fromfile(f, dtype=np.uint16)
    assert ByteTokenizer().decode(tokens) == "firstsecönd"
    assert list(np.flatnonzero(tokens == 256)) == [5, 5 + 1 + len("secönd".encode())]


# ---------------------------------------------------------------- cache


def test_cache_built_once_and_keyed_on_inputs(tmp_path, monkeypatch):
    root = write_corpus(tmp_path / "c", n_files=2)
    calls = []
    real = data.iter_documents
    monkeypatch.setattr(data, "iter_documents", lambda *a, **k: calls.append(1) or real(*a, **k))

    f1 = build_token_cache(str(root), ByteTokenizer(), tmp_path / "cache")
    mtime = f1.stat().st_mtime_ns
    f2 = build_token_cache(str(root), ByteTokenizer(), tmp_path / "cache")
    assert f1 == f2 and len(calls) == 1 and f1.stat().st_mtime_ns == mtime

    meta = json.loads(f1.with_suffix(".json").read_text())
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 257 and len(meta["sources"]) == 2
    assert f1.stat().st_size == 2 * meta["n_tokens"]
    expected = b"".join((root / f"doc{i}.txt").read_bytes() for i in range(2))
    tokens = np.fromfile(f1, dtype=np.uint16)
    assert bytes(tokens[tokens < 256].astype(np.uint8)) == expected

    # Any change of input gives a new cache: max_bytes, or a touched source file.
    assert build_token_cache(str(root), ByteTokenizer(), tmp_path / "cache", max_bytes=10) != f1
    (root / "doc0.txt").write_text("changed")
    f3 = build_token_cache(str(root), ByteTokenizer(), tmp_path / "cache")
    assert f3 != f1 and len(calls) == 3


class ExplodingTokenizer:
    name, vocab_size, eos_id = "boom", 70000, 0

    def __init__(self):
        self.seen = 0

    def encode(self, text):
        self.seen += 1
        if self.seen == 2:
            raise RuntimeError("tokeniser crashed")
        return [1, 2, 69999]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    root = write_corpus(tmp_path / "c", n_files=3)
    cache_dir = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="crashed"):
        build_token_cache(str(root), ExplodingTokenizer(), cache_dir)
    assert list(cache_dir.iterdir()) == []  # no token file, no meta, no temp file

    tok = ExplodingTokenizer()
    tok.seen = 5  # past the failure: builds, and needs uint32 for a 70000-token vocabulary
    f = build_token_cache(str(root), tok, cache_dir)
    assert json.loads(f.with_suffix(".json").read_text())["dtype"] == "uint32"
    assert np.fromfile(f, dtype=np.uint32).tolist() == [1, 2, 69999, 0] * 3


def test_concurrent_builds_agree(tmp_path):
    root = write_corpus(tmp_path / "c")
    results, errors = [], []

    def build():
        try:
            results.append(build_token_cache(str(root), ByteTokenizer(), tmp_path / "cache"))
        except Exception as e:  # pragma: no cover - surfaced by the assert below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert sorted(p.suffix for p in (tmp_path / "cache").iterdir()) == [".bin", ".json"]
    ds = TokenDataset(results[0], seq_len=16, split="train")
    assert len(ds) > 0


# ---------------------------------------------------------------- dataset


def test_dataset_windows_and_split(cache):
    n = json.loads(cache.with_suffix(".json").read_text())["n_tokens"]
    all_tokens = np.fromfile(cache, dtype=np.uint16).astype(np.int64)
    train = TokenDataset(cache, seq_len=32, split="train", val_fraction=0.1)
    val = TokenDataset(cache, seq_len=32, split="val", val_fraction=0.1)
    n_val = int(n * 0.1)
    assert len(train) == (n - n_val - 1) // 32 and len(val) == (n_val - 1) // 32
    for i in (0, 1, len(train) - 1):
        w = train.window(i)
        assert w.dtype == np.int64 and w.shape == (33,)
        assert np.array_equal(w, all_tokens[i * 32:i * 32 + 33])
    assert train.window(0)[-1] == train.window(1)[0]  # consecutive windows share a boundary
    assert np.array_equal(val.window(0), all_tokens[n - n_val:n - n_val + 33])
    assert np.array_equal(train.windows([2, 0]), np.stack([train.window(2), train.window(0)]))
    with pytest.raises(IndexError):
        train.window(len(train))


def test_dataset_too_small_says_what_is_needed(tmp_path):
    (tmp_path / "t.txt").write_text("x" * 99)  # 100 tokens with eos
    f = build_token_cache(str(tmp_path / "t.txt"), ByteTokenizer(), tmp_path / "cache")
    with pytest.raises(DataError, match=r"has 100 tokens .*data.seq_len=128 needs at least 129"):
        TokenDataset(f, seq_len=128, split="train", val_fraction=0.0)
    with pytest.raises(DataError, match=r"val split has 5 tokens.*data.val_fraction"):
        TokenDataset(f, seq_len=8, split="val", val_fraction=0.05)
    assert len(TokenDataset(f, seq_len=9, split="train", val_fraction=0.0)) == 11


# ---------------------------------------------------------------- batches


def concat_ranks(ds, step, dp_size, micro_batch, global_batch=24, seed=3):
    xs, ys = [], []
    for rank in range(dp_size):
        loader = BatchLoader(ds, global_batch=global_batch, micro_batch=micro_batch,
                             dp_rank=rank, dp_size=dp_size, seed=seed)
        mbs = loader.micro_batches(step)
        assert len(mbs) == loader.accum_steps == global_batch // dp_size // micro_batch
        for x, y in mbs:
            assert x.dtype == y.dtype == torch.int64 and x.shape == (micro_batch, ds.seq_len)
            assert torch.equal(x[:, 1:], y[:, :-1])
            xs.append(x)
            ys.append(y)
    return torch.cat(xs), torch.cat(ys)


def test_every_layout_sees_the_same_global_batch(cache):
    ds = TokenDataset(cache, seq_len=16, split="train")
    for step in (0, 7, 40):  # step 40 is past the first epoch
        ref_x, ref_y = concat_ranks(ds, step, dp_size=1, micro_batch=24)
        idx = BatchLoader(ds, global_batch=24, micro_batch=24, dp_rank=0, dp_size=1,
                          seed=3).global_indices(step)
        assert torch.equal(ref_x, torch.from_numpy(ds.windows(idx)[:, :-1]))
        for dp_size in (1, 2, 3, 4, 6, 12, 24):
            for micro in (m for m in (1, 2, 4) if (24 // dp_size) % m == 0):
                x, y = concat_ranks(ds, step, dp_size, micro)
                assert torch.equal(x, ref_x) and torch.equal(y, ref_y), (step, dp_size, micro)


def test_deterministic_and_resumable(cache):
    ds = TokenDataset(cache, seq_len=16, split="train")
    kw = dict(global_batch=8, micro_batch=2, dp_rank=1, dp_size=2, seed=11)
    a, b = BatchLoader(ds, **kw), BatchLoader(ds, **kw)
    run = [a.micro_batches(s) for s in range(30)]
    for s in (29, 0, 17):  # fresh loader, arbitrary order: resuming is exact
        assert all(torch.equal(p, q) for mb1, mb2 in zip(run[s], b.micro_batches(s), strict=True)
                   for p, q in zip(mb1, mb2, strict=True))
    other = BatchLoader(ds, **{**kw, "seed": 12})
    assert not np.array_equal(a.global_indices(0), other.global_indices(0))


def test_epochs_cover_every_window_once(cache):
    ds = TokenDataset(cache, seq_len=16, split="train")
    n, gb = len(ds), 7
    loader = BatchLoader(ds, global_batch=gb, micro_batch=7, dp_rank=0, dp_size=1, seed=0)
    stream = np.concatenate([loader.global_indices(s) for s in range(3 * n // gb + 1)])
    for e in range(3):
        epoch = stream[e * n:(e + 1) * n]
        assert sorted(epoch.tolist()) == list(range(n))
        assert np.array_equal(epoch, np.random.default_rng([0, e]).permutation(n))
    assert not np.array_equal(stream[:n], stream[n:2 * n])


def test_batch_layout_validation(cache):
    ds = TokenDataset(cache, seq_len=16, split="train")
    for gb, mb, dp in ((10, 1, 3), (12, 4, 2), (8, 0, 1)):
        with pytest.raises(ValueError):
            BatchLoader(ds, global_batch=gb, micro_batch=mb, dp_rank=0, dp_size=dp, seed=0)


def test_eval_batches_fixed_and_layout_independent(cache):
    val = TokenDataset(cache, seq_len=16, split="val", val_fraction=0.2)
    assert len(val) >= 12

    def gathered(n_seq, micro, dp):
        mbs = [mb for r in range(dp) for mb in eval_batches(
            val, n_sequences=n_seq, micro_batch=micro, dp_rank=r, dp_size=dp)]
        return torch.cat([x for x, _ in mbs]), torch.cat([y for _, y in mbs])

    ref_x, ref_y = gathered(12, 12, 1)
    assert torch.equal(ref_x, torch.from_numpy(val.windows(range(12))[:, :-1]))
    for micro, dp in ((1, 1), (2, 2), (3, 4), (1, 12), (2, 3)):
        x, y = gathered(12, micro, dp)
        assert torch.equal(x, ref_x) and torch.equal(y, ref_y)
    assert len(gathered(11, 2, 2)[0]) == 8  # rounded down to a multiple of dp*micro
    assert len(gathered(1, 2, 2)[0]) == 4  # but at least one micro-batch per rank
    assert eval_batches(val, n_sequences=0, micro_batch=1, dp_rank=0, dp_size=1) == []
    with pytest.raises(DataError, match="windows"):
        eval_batches(val, n_sequences=8, micro_batch=len(val) + 1, dp_rank=0, dp_size=1)
