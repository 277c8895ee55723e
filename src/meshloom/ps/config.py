"""Config of a parameter-server run: its own sections (the transformer Config does not apply),
the same TOML / `--set` / one-line ConfigError conventions as meshloom.config.

A TOML file with a [ps] section is a parameter-server config; `meshloom train` hands it to
meshloom.ps.launch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, published as tomli
    import tomli as tomllib

# The value checking and TOML writing are the transformer config's, shared rather than copied.
from meshloom.config import ConfigError, closest, dump_toml, fill_config

OPTIMIZERS = ("sgd", "adagrad")
SHARDINGS = ("table", "row")


@dataclass
class PSModelConfig:
    tables: int = 4  # categorical features, one embedding table each
    rows: int = 10000  # ids per table
    dim: int = 16  # embedding width
    dense_features: int = 8  # real-valued features fed to the MLP beside the embeddings
    hidden: list[int] = field(default_factory=lambda: [64, 32])  # MLP hidden widths
    init_std: float = 0.1  # embedding rows start as N(0, init_std^2)


@dataclass
class PSTrainConfig:
    steps: int = 100
    seed: int = 0  # data, hidden labelling model and initial weights
    global_batch: int = 256  # samples per step over all trainers
    optimizer: str = "sgd"  # sgd | adagrad, for the tables (on the servers) and the MLP
    lr: float = 0.5  # the dense MLP's learning rate
    # The tables' learning rate; 0 = train.lr. A row's gradient is divided by the batch size but
    # the row appears in few samples, so SGD on embeddings wants a much larger rate than the MLP.
    table_lr: float = 20.0
    log_every: int = 1  # metrics.jsonl record every N steps


@dataclass
class PSServerConfig:
    servers: int = 1
    trainers: int = 2
    sharding: str = "table"  # table: whole tables round-robin; row: every table split by id range
    rpc_timeout_s: float = 60.0  # an RPC (or trainer collective) waiting longer fails


@dataclass
class PSRunConfig:
    dir: str = ""  # "" = runs/<config name>-<timestamp>
    threads: int = 0  # torch threads per process; 0 = cores / processes


@dataclass
class PSConfig:
    model: PSModelConfig = field(default_factory=PSModelConfig)
    train: PSTrainConfig = field(default_factory=PSTrainConfig)
    ps: PSServerConfig = field(default_factory=PSServerConfig)
    run: PSRunConfig = field(default_factory=PSRunConfig)
    name: str = "run"

    @property
    def table_lr(self) -> float:
        return self.train.table_lr or self.train.lr

    @property
    def local_batch(self) -> int:
        return self.train.global_batch // self.ps.trainers


def is_ps_config(path: str | Path | None) -> bool:
    """True when the file is TOML with a [ps] table. Anything unreadable is left to the ordinary
    config loader, which reports it."""
    if path is None:
        return False
    try:
        return isinstance(tomllib.loads(Path(path).read_text()).get("ps"), dict)
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return False


def load_ps_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> PSConfig:
    """A PSConfig from a TOML file and `section.key=value` overrides; ConfigError if bad."""
    return fill_config(PSConfig(), path, overrides)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def validate_ps(cfg: PSConfig) -> None:
    """Every rule checkable before launch; ConfigError with one line naming the key."""
    m, t, s, r = cfg.model, cfg.train, cfg.ps, cfg.run
    for key in ("tables", "rows", "dim"):
        value = getattr(m, key)
        _require(value >= 1, f"model.{key}={value} must be >= 1")
    _require(m.dense_features >= 0, f"model.dense_features={m.dense_features} must be >= 0")
    _require(all(h >= 1 for h in m.hidden), f"model.hidden={m.hidden}: widths must be >= 1")
    _require(m.init_std > 0, f"model.init_std={m.init_std} must be > 0")
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(t.seed >= 0, f"train.seed={t.seed} must be >= 0")
    _require(t.optimizer in OPTIMIZERS,
             f"train.optimizer: unknown optimizer '{t.optimizer}'"
             f"{closest(t.optimizer, list(OPTIMIZERS))}; one of {', '.join(OPTIMIZERS)} "
             "(both take sparse gradients; see docs/parameter-server.md)")
    _require(t.lr > 0, f"train.lr={t.lr} must be > 0")
    _require(t.table_lr >= 0, f"train.table_lr={t.table_lr} must be >= 0 (0 = train.lr)")
    _require(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _require(s.servers >= 1, f"ps.servers={s.servers} must be >= 1")
    _require(s.trainers >= 1, f"ps.trainers={s.trainers} must be >= 1")
    _require(t.global_batch >= 1 and t.global_batch % s.trainers == 0,
             f"train.global_batch={t.global_batch} must be a positive multiple of "
             f"ps.trainers={s.trainers} (each trainer takes an equal part)")
    _require(s.sharding in SHARDINGS,
             f"ps.sharding: unknown sharding '{s.sharding}'{closest(s.sharding, list(SHARDINGS))}"
             f"; one of {', '.join(SHARDINGS)}")
    _require(s.sharding != "table" or s.servers <= m.tables,
             f"ps.servers={s.servers} exceeds model.tables={m.tables} with ps.sharding=table "
             "(a server would hold no table); use ps.sharding=row or fewer servers")
    _require(s.sharding != "row" or s.servers <= m.rows,
             f"ps.servers={s.servers} exceeds model.rows={m.rows} with ps.sharding=row")
    _require(s.rpc_timeout_s > 0, f"ps.rpc_timeout_s={s.rpc_timeout_s} must be > 0")
    _require(r.threads >= 0, f"run.threads={r.threads} must be >= 0 (0 = cores / processes)")


def dump_ps_toml(cfg: PSConfig) -> str:
    """The resolved config as TOML (written into the run folder)."""
    return dump_toml(cfg)
