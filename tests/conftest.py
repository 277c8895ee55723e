import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from meshloom.config import Config, load_config  # noqa: E402

# The test process forks ranks (dist_harness) after some tests compute in-process. GNU OpenMP
# does not survive a fork once it has started its worker threads: a forked rank then hangs in
# its first parallel op. One thread in the parent means no worker threads to inherit; each
# forked rank sets its own count.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory) -> str:
    """One shared token cache for the whole session (the stdlib corpus, capped)."""
    return str(tmp_path_factory.mktemp("token-cache"))


def tiny_config(run_dir, cache_dir: str, *overrides: str) -> Config:
    """configs/tiny.toml with a test's run folder and overrides."""
    return load_config(ROOT / "configs" / "tiny.toml",
                       [f"run.dir={run_dir}", f"data.cache_dir={cache_dir}", *overrides])


def load_benchmark(name: str):
    """A script from benchmarks/ (a folder of scripts, not a package), loaded as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
