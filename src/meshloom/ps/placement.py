"""Which server holds which rows of which table, and a text drawing of the whole layout.

Two placements (ps.sharding):
- `table`: whole tables, round-robin (table t on server t mod S). A lookup of one feature goes to
  one server; a table must fit one server.
- `row`: every table is split by id range into S contiguous, near-equal slices (server s holds ids
  [s*rows/S, (s+1)*rows/S)). Every server sees every feature; a table may be larger than one
  server. Ids are hashed before use (the data's hot ids are spread over the range), so the
  slices get similar traffic.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshloom.ps.config import PSConfig


@dataclass(frozen=True)
class Piece:
    """Rows [lo, hi) of table `table`, held by server `server`."""

    table: int
    server: int
    lo: int
    hi: int

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def place(cfg: PSConfig) -> list[Piece]:
    m, servers = cfg.model, cfg.ps.servers
    if cfg.ps.sharding == "table":
        return [Piece(t, t % servers, 0, m.rows) for t in range(m.tables)]
    return [Piece(t, s, s * m.rows // servers, (s + 1) * m.rows // servers)
            for t in range(m.tables) for s in range(servers)]


def pieces_of_server(pieces: list[Piece], server: int) -> list[Piece]:
    return [p for p in pieces if p.server == server]


def pieces_of_table(pieces: list[Piece], table: int) -> list[Piece]:
    """A table's pieces in id order (lookups rely on it: sorted ids split into contiguous runs)."""
    return sorted((p for p in pieces if p.table == table), key=lambda p: p.lo)


def server_name(i: int) -> str:
    return f"ps{i}"


def trainer_name(i: int) -> str:
    return f"trainer{i}"


def dense_widths(cfg: PSConfig) -> list[int]:
    """The MLP's layer widths, input to the single click logit."""
    m = cfg.model
    return [m.tables * m.dim + m.dense_features, *m.hidden, 1]


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k" if n >= 1e3 else str(n)


def _ranges(values: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v > start else str(v))
            start = None
    return ", ".join(out)


def draw(cfg: PSConfig, pieces: list[Piece]) -> str:
    """Who holds what, one line per process."""
    m, s, t = cfg.model, cfg.ps, cfg.train
    how = ("whole tables, round-robin" if s.sharding == "table"
           else "every table split by id range")
    widths = dense_widths(cfg)
    dense_params = sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    lines = [f"parameter server: {s.servers} server{'s' * (s.servers > 1)} x {s.trainers} "
             f"trainer{'s' * (s.trainers > 1)} (RPC on loopback; ps.sharding={s.sharding}: {how})"]
    for i in range(s.servers):
        mine = pieces_of_server(pieces, i)
        params = sum(p.rows for p in mine) * m.dim
        if s.sharding == "table":
            what = f"tables {_ranges([p.table for p in mine])} ({m.rows} x {m.dim} each)"
        else:
            what = f"rows {mine[0].lo}-{mine[0].hi - 1} of all {m.tables} tables (dim {m.dim})"
        lines.append(f"  {server_name(i):<9} {what}: {_count(params)} parameters + "
                     f"{t.optimizer} state")
    lb = cfg.local_batch
    for i in range(s.trainers):
        lines.append(f"  {trainer_name(i):<9} MLP {'-'.join(map(str, widths))} "
                     f"({_count(dense_params)} parameters, DDP replica {i}/{s.trainers}), "
                     f"samples {i * lb}-{(i + 1) * lb - 1} of every {t.global_batch}")
    return "\n".join(lines)
