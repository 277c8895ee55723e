"""Data pipeline: text sources -> token cache on disk -> windows -> per-rank micro-batches.

Every piece is deterministic. The batch for an optimizer step depends only on (seed, step,
dataset size, global batch), so every parallel layout trains on the same sequences and a
resumed run picks up exactly where it stopped. See docs/data.md.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import sysconfig
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from meshloom.config import Config, ModelDims
from meshloom.mesh import ParallelDims

CACHE_VERSION = 1
# Text suffixes taken from a folder source. Name a file directly to use anything else.
TEXT_SUFFIXES = frozenset({".txt", ".md", ".rst", ".py", ".json", ".jsonl"})
_EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>")
_SKIP_STDLIB_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "__pycache__"})


class DataError(ValueError):
    """Bad data configuration or input; the message is one line naming what is wrong."""


# --------------------------------------------------------------------------- tokenizers


class ByteTokenizer:
    """Built-in byte-level tokenizer: token id = UTF-8 byte value (0..255); eos_id = 256;
    vocab_size = 257."""

    name = "byte"
    fingerprint = "byte"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A local Hugging Face ``tokenizer.json`` loaded with the ``tokenizers`` package.

    eos is the first of ``</s>``, ``<|endoftext|>``, ``<|end_of_text|>``, ``<eos>`` found in the
    vocabulary. If none is there, eos becomes a new id just past the vocabulary (vocab_size grows
    by one) so that document boundaries never collide with a real token.
    """

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "data.tokenizer: a tokenizer.json needs the 'tokenizers' package; "
                "run `pip install tokenizers` (or `pip install meshloom[hf]`)"
            ) from None
        path = Path(path).expanduser().resolve()
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise DataError(f"data.tokenizer: cannot load '{path}': {e}") from None
        self.name = f"hf:{path}"
        # The name alone would keep a stale cache after the file is edited in place.
        self.fingerprint = f"{self.name}:{hashlib.sha256(path.read_bytes()).hexdigest()}"
        self._base_vocab = self._tok.get_vocab_size(with_added_tokens=True)
        found = [self._tok.token_to_id(t) for t in _EOS_CANDIDATES]
        found = [i for i in found if i is not None]
        self.eos_id = found[0] if found else self._base_vocab
        self.vocab_size = max(self._base_vocab, self.eos_id + 1)

    def encode(self, text: str) -> list[int]:
        # No special tokens: documents are joined with eos by the cache builder instead.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self._base_vocab],
                                skip_special_tokens=False)


Tokenizer = ByteTokenizer | HFTokenizer


def load_tokenizer(spec: str) -> ByteTokenizer | HFTokenizer:
    """"byte", or a path (optionally prefixed "hf:") to a tokenizer.json or a folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    path = Path(spec.removeprefix("hf:")).expanduser()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return HFTokenizer(path / "tokenizer.json")
    if path.is_file():
        return HFTokenizer(path)
    raise DataError(
        f"data.tokenizer: '{spec}' is neither 'byte' nor a tokenizer.json file or a folder with one"
    )


# --------------------------------------------------------------------------- sources


def _stdlib_files() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        # Prune in place: site-packages and the test suites are large and not "the stdlib".
        dirs[:] = [d for d in dirs if d not in _SKIP_STDLIB_PARTS]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return files


def _folder_files(root: Path) -> list[Path]:
    # Hidden folders (.git, .venv, ...) hold no corpus worth training on.
    return [p for p in root.rglob("*")
            if p.suffix.lower() in TEXT_SUFFIXES and p.is_file()
            and not any(part.startswith(".") for part in p.relative_to(root).parts)]


def resolve_sources(source: str | list[str]) -> list[Path]:
    """Expand "stdlib", files, folders and globs into a sorted, de-duplicated file list."""
    entries = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not entries:
        raise DataError("data.source: empty list of sources")
    found: set[Path] = set()
    for entry in entries:
        entry = str(entry)
        if entry == "stdlib":
            files = _stdlib_files()
        elif glob.has_magic(entry):
            files = [Path(p) for p in glob.glob(os.path.expanduser(entry), recursive=True)
                     if os.path.isfile(p)]
        else:
            path = Path(entry).expanduser()
            if path.is_file():
                files = [path]
            elif path.is_dir():
                files = _folder_files(path)
            else:
                raise DataError(f"data.source: no such file or folder '{entry}'")
        if not files:
            # Per entry, so a typo in one of several sources is not hidden by the others.
            if glob.has_magic(entry):
                raise DataError(f"data.source: no files match '{entry}'")
            suffixes = " ".join(sorted(TEXT_SUFFIXES))
            raise DataError(f"data.source: no text files ({suffixes}) in folder '{entry}'")
        found.update(p.resolve() for p in files)
    return sorted(found)


def iter_documents(paths: list[Path], jsonl_field: str = "text") -> Iterator[str]:
    """Whole plain files are documents; .jsonl files give one document per line."""
    for path in paths:
        path = Path(path)
        if path.suffix.lower() != ".jsonl":
            yield path.read_bytes().decode("utf-8", errors="replace")
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    msg = f"data.source: {path}:{lineno}: invalid JSON ({e.msg})"
                    raise DataError(msg) from None
                if not isinstance(record, dict) or jsonl_field not in record:
                    raise DataError(f"data.source: {path}:{lineno}: no field '{jsonl_field}' "
                                    "(set data.jsonl_field)")
                text = record[jsonl_field]
                if not isinstance(text, str):
                    raise DataError(f"data.source: {path}:{lineno}: field '{jsonl_field}' "
                                    "is not a string")
                yield text


# --------------------------------------------------------------------------- token cache


def _meta_path(token_file: Path) -> Path:
    return Path(token_file).with_suffix(".json")


def _atomic_write(path: Path, write) -> None:
    """Write via a private temp file in the same folder, then rename: readers never see a
    partial file, and concurrent writers of identical content cannot corrupt each other."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _cache_is_complete(token_file: Path, itemsize: int) -> bool:
    try:
        meta = json.loads(_meta_path(token_file).read_text())
        return token_file.stat().st_size == meta["n_tokens"] * itemsize
    except (OSError, ValueError, KeyError, TypeError):
        return False


def build_token_cache(source: str | list[str], tokenizer: Tokenizer, cache_dir: str | Path, *,
                      max_bytes: int | None = None, jsonl_field: str = "text") -> Path:
    """Tokenise all documents once into ``cache_dir``; return the flat token file's path."""
    paths = resolve_sources(source)
    stats = [(str(p), st.st_size, st.st_mtime_ns) for p in paths for st in [p.stat()]]
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 65535 else np.uint32)
    fingerprint = getattr(tokenizer, "fingerprint", tokenizer.name)
    key_src = json.dumps([CACHE_VERSION, stats, fingerprint, max_bytes, jsonl_field])
    key = hashlib.sha256(key_src.encode()).hexdigest()[:20]
    cache_dir = Path(cache_dir).expanduser()
    cache_dir.mkdir(parents=True, exist_ok=True)
    token_file = cache_dir / f"tokens-{key}.bin"
    if _cache_is_complete(token_file, dtype.itemsize):
        return token_file

    eos = np.array([tokenizer.eos_id], dtype=dtype).tobytes()
    counts = {"n_tokens": 0, "n_documents": 0, "bytes_read": 0}

    def write_tokens(f) -> None:
        for doc in iter_documents(paths, jsonl_field):
            raw = doc.encode("utf-8")
            if isinstance(tokenizer, ByteTokenizer):  # the hot path for demos: no Python loop
                ids = np.frombuffer(raw, dtype=np.uint8)
            else:
                ids = np.asarray(tokenizer.encode(doc), dtype=np.int64)
            f.write(ids.astype(dtype).tobytes())
            f.write(eos)
            counts["n_tokens"] += len(ids) + 1
            counts["n_documents"] += 1
            counts["bytes_read"] += len(raw)
            if max_bytes is not None and counts["bytes_read"] >= max_bytes:
                break
        if counts["n_documents"] == 0:
            raise DataError(f"data.source: no documents in {source!r}")

    _atomic_write(token_file, write_tokens)
    meta = {
        "version": CACHE_VERSION, "dtype": dtype.name, **counts,
        "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id, "max_bytes": max_bytes, "jsonl_field": jsonl_field,
        "sources": [{"path": p, "size": s, "mtime_ns": m} for p, s, m in stats],
    }
    # The meta file is written last: its presence is what marks the cache complete.
    _atomic_write(_meta_path(token_file), lambda f: f.write(json.dumps(meta, indent=1).encode()))
    return token_file


# --------------------------------------------------------------------------- dataset + loader


class TokenDataset:
    """Windows of seq_len+1 tokens over the train or val part of a token cache."""

    def __init__(self, token_file: Path, seq_len: int, split: str, val_fraction: float = 0.05):
        if split not in ("train", "val"):
            raise DataError(f"data: split must be 'train' or 'val', not {split!r}")
        if not 0.0 <= val_fraction < 1.0:
            raise DataError(f"data.val_fraction: must be in [0, 1), got {val_fraction}")
        if seq_len < 1:
            raise DataError(f"data.seq_len: must be >= 1, got {seq_len}")
        token_file = Path(token_file)
        try:
            self.meta = json.loads(_meta_path(token_file).read_text())
        except (OSError, ValueError):
            raise DataError(f"data: token cache '{token_file}' is missing or incomplete") from None
        n = self.meta["n_tokens"]
        tokens = np.memmap(token_file, dtype=np.dtype(self.meta["dtype"]), mode="r", shape=(n,))
        n_val = int(n * val_fraction)
        self.tokens = tokens[n - n_val:] if split == "val" else tokens[: n - n_val]
        self.seq_len, self.split = seq_len, split
        # Stride seq_len: window i's last token (a target only) is window i+1's first input.
        self._len = max(0, (len(self.tokens) - 1) // seq_len)
        if self._len == 0:
            hint = "a larger data.val_fraction" if split == "val" else "a smaller data.val_fraction"
            raise DataError(
                f"data: the {split} split has {len(self.tokens)} tokens but data.seq_len={seq_len} "
                f"needs at least {seq_len + 1}; use more data, a shorter data.seq_len or {hint}"
            )

    def __len__(self) -> int:
        return self._len

    def window(self, i: int) -> np.ndarray:
        if not 0 <= i < self._len:
            raise IndexError(f"window {i} out of range for {self._len} windows")
        start = i * self.seq_len
        return np.asarray(self.tokens[start:start + self.seq_len + 1], dtype=np.int64)

    def windows(self, indices: Sequence[int]) -> np.ndarray:
        """int64 array [len(indices), seq_len+1]."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self._len):
            raise IndexError(f"window index out of range for {self._len} windows")
        # One fancy-indexed read from the memmap instead of a Python loop over windows.
        offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)
        return np.asarray(self.tokens[offsets], dtype=np.int64)


def _split_micro(data: np.ndarray, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.from_numpy(data)
    return [(t[k:k + micro_batch, :-1].contiguous(), t[k:k + micro_batch, 1:].contiguous())
            for k in range(0, len(t), micro_batch)]


def check_batch_config(cfg: Config, dims: ParallelDims,
                       model: ModelDims | None = None) -> str | None:
    """Why the global batch cannot be split as BatchLoader splits it (one line), or None: the
    same number of whole micro-batches on every data-parallel rank."""
    t = cfg.train
    if t.global_batch % dims.dp:
        return (f"train.global_batch={t.global_batch} must be divisible by the data-parallel "
                f"degree {dims.dp} (parallel.dp_replicate x parallel.dp_shard)")
    local = t.global_batch // dims.dp
    if t.micro_batch and local % t.micro_batch:
        return (f"train.micro_batch={t.micro_batch} must divide the per-rank batch {local} "
                f"(train.global_batch {t.global_batch} / data-parallel degree {dims.dp})")
    return None


class BatchLoader:
    """Hands each data-parallel rank its part of the same global batch, whatever the layout."""

    def __init__(self, dataset: TokenDataset, *, global_batch: int, micro_batch: int,
                 dp_rank: int, dp_size: int, seed: int):
        if min(global_batch, micro_batch, dp_size) < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(f"bad batch layout: global_batch={global_batch}, micro_batch="
                             f"{micro_batch}, dp_rank={dp_rank}, dp_size={dp_size}")
        if global_batch % dp_size or (global_batch // dp_size) % micro_batch:
            raise ValueError(f"global_batch={global_batch} must split into dp_size={dp_size} "
                             f"equal parts, each a multiple of micro_batch={micro_batch}")
        self.dataset, self.global_batch, self.micro_batch = dataset, global_batch, micro_batch
        self.dp_rank, self.dp_size, self.seed = dp_rank, dp_size, seed
        self.local_batch = global_batch // dp_size
        self._perms: dict[int, np.ndarray] = {}

    @property
    def accum_steps(self) -> int:
        return self.local_batch // self.micro_batch

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a step straddles at most two epochs unless tiny data
                self._perms.pop(next(iter(self._perms)))
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(len(self.dataset))
        return self._perms[epoch]

    def global_indices(self, step: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n = len(self.dataset)
        g = step * self.global_batch + np.arange(self.global_batch, dtype=np.int64)
        epochs, pos = g // n, g % n
        out = np.empty(self.global_batch, dtype=np.int64)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(int(e))[pos[mask]]
        return out

    def micro_batches(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        lo = self.dp_rank * self.local_batch
        mine = self.global_indices(step)[lo:lo + self.local_batch]
        return _split_micro(self.dataset.windows(mine), self.micro_batch)


def eval_batches(dataset: TokenDataset, *, n_sequences: int, micro_batch: int, dp_rank: int,
                 dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first windows of ``dataset`` as a fixed evaluation set, split across dp ranks.

    The count is min(n_sequences, len(dataset)) rounded down to a multiple of dp_size*micro_batch
    (but at least one micro-batch per rank). n_sequences <= 0 disables evaluation (empty list).
    """
    if n_sequences <= 0:
        return []
    unit = dp_size * micro_batch
    if len(dataset) < unit:
        raise DataError(
            f"data: the {dataset.split} split has {len(dataset)} windows, fewer than "
            f"dp_size*micro_batch={unit}; use more data or a larger data.val_fraction"
        )
    total = max(unit, min(n_sequences, len(dataset)) // unit * unit)
    per_rank = total // dp_size
    lo = dp_rank * per_rank
    return _split_micro(dataset.windows(range(lo, lo + per_rank)), micro_batch)
