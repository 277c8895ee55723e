"""NCCL's choice of algorithm and protocol for one collective call, and what the call costs.

NCCL prices every (algorithm, protocol) pair it may run a call with and takes the cheapest
(src/graph/tuning.cc of NVIDIA/nccl at b6475625: `ncclTopoTuneModel` sets a latency and a
bandwidth per pair, `ncclTopoGetAlgoTime` adds the call's bytes). The planner does the same,
with NCCL's latencies and its bandwidth factors applied to the bus bandwidth the GPU presets
give a ring with the Simple protocol (hardware.Cluster.bus_bandwidth: a measured fraction of
the link), which is the bandwidth NCCL reaches with large messages.

- Protocols: Simple (large chunks, highest bandwidth, longest start), LL128 (128-byte lines
  with a flag in each, 120/128 of the bandwidth, a shorter start; NCCL enables it by default
  only on NVLink nodes of Volta, Ampere or Hopper) and LL (8-byte flag-carrying stores: the
  shortest start, a quarter to a third of the bandwidth, capped).
- Algorithms: the ring, for every collective; the tree (a chain inside a node, a binary tree
  across nodes, log-many network hops), for all-reduce only.
- Not modelled: NVLink SHARP (NVLS) and CollNet, which need switch support that the presets do
  not assume; the tree's `.85` for NCCL's plain-tree pattern (the presets' nodes give NCCL its
  balanced tree); a graph's extra network latency (`latencyInter`, 0 on InfiniBand).

NCCL caps LL128 and the tree per channel. The planner has no channel count (NCCL's topology
search picks it), so a cap is applied as its ratio to one channel's speed: one NVLink
(topo.h's SM80_NVLINK_BW 20.0 GB/s, SM90_NVLINK_BW 20.6) for a call within at most two nodes,
where NCCL bases the bandwidth on the intra-node graph, and the GPU's network port beyond.
Inside a node no cap binds; across more than two nodes the tree and LL128 lose 20-40%.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("ring", "tree")

# baseLat: a call's start in us, per algorithm and protocol (LL, LL128, Simple).
BASE_US = {"tree": (6.8, 14.0, 0.0), "ring": (6.6, 14.0, 8.4)}
# hwLat: each step's latency in us, per link kind, algorithm and protocol.
HOP_US = {"nvlink": {"tree": (0.6, 1.25, 28.0), "ring": (0.6, 1.9, 3.4)},
          "pci": {"tree": (1.0, 1.9, 28.0), "ring": (1.0, 2.5, 5.7)},
          "net": {"tree": (5.0, 8.5, 28.0), "ring": (2.7, 4.0, 14.0)}}
# llMaxBws, GB/s: LL's bandwidth cap; one node: by GPU generation; more: by CPU vendor and
# node count (2, more than 2).
LL_MAX_ONE_NODE = {"volta": 39.0, "ampere": 87.7, "hopper": 87.7}
LL_MAX_NODES = {"intel": (39.0, 20.4), "amd": (22.5, 19.0)}
# Per-channel caps, GB/s, per generation for 1, 2 and more than 2 nodes.
RING_LL128_PER_CH = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3, "hopper": (36.7,) * 3}
TREE_LL128_PER_CH = {"volta": (20.0,) * 3, "ampere": (20.0,) * 3,
                     "hopper": (36.7, 36.7, 29.0)}
TREE_PER_CH = {"volta": (26.5, 18.5, 10.0), "ampere": (24.0, 23.6, 17.8),
               "hopper": (38.7, 41.4, 36.0)}
# topo.h: one NVLink's speed in NCCL's graph, GB/s.
NVLINK_PER_CH = {"volta": 20.0, "ampere": 20.0, "hopper": 20.6}
# getNetOverhead: us a network step costs the CPU that posts it, x3 with Simple.
NET_OVERHEAD_US = {"intel": 1.0, "amd": 2.0}
# treeCorrectionFactor: the tree's bandwidth at 64 B x 2^i, i = 0..22, per protocol.
TREE_CORRECTION = (
    (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0,
     1.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .6, .6, .6, .8, .9, .9, .9, .9,
     1.0, 1.0),
    (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .6, .7, .8, .7, .7, .8, .9,
     .9))
# The ring's "plateau effect": a multi-node Simple all-reduce past 64 bytes per channel and
# rank starts 1.4x slower (Ampere and later).
PLATEAU = 1.4


@dataclass(frozen=True)
class Group:
    """Where a collective's ranks sit: `size` ranks over `nodes` nodes, joined inside a node by
    `intra_link` ("nvlink" or "pci"); `simple_gbps` is the ring's Simple-protocol bus
    bandwidth over the group, `channel_gbps` one channel's speed (the caps' scale)."""
    size: int
    nodes: int
    intra_link: str
    generation: str  # "volta", "ampere", "hopper" or "other" (no LL128)
    cpu: str  # "intel" or "amd"
    simple_gbps: float
    channel_gbps: float

    @property
    def ppn(self) -> float:
        return self.size / self.nodes

    @property
    def node_index(self) -> int:
        return min(self.nodes, 3) - 1


@dataclass(frozen=True)
class Call:
    """One collective call as NCCL would run it: its seconds in all, the part that is its
    start (paid however small the payload), and the pair it runs with."""
    seconds: float
    start: float
    algorithm: str
    protocol: str

    @property
    def name(self) -> str:
        return f"{self.algorithm}/{self.protocol}"


def send_start_us(link: str) -> float:
    """A point-to-point send's start, us: NCCL's tuner has no model for sends, so one step of
    the Simple ring over `link` ("nvlink", "pci" or "net") after its start."""
    simple = PROTOCOLS.index("Simple")
    return BASE_US["ring"][simple] + HOP_US[link]["ring"][simple]


def _steps(op: str, g: Group) -> tuple[int, int]:
    """A ring's steps, and how many of them cross the network (NCCL's nsteps, nInterSteps;
    an all-reduce over one rank a node crosses on every step)."""
    if op == "all_reduce":
        steps = 2 * (g.size - 1)
        return steps, min(steps, 2 * g.nodes) if g.nodes > 1 else 0
    return g.size - 1, g.nodes - 1


def _cap(table: dict, g: Group) -> float:
    """A per-channel cap as a fraction of the Simple ring's bandwidth (no cap: inf)."""
    caps = table.get(g.generation)
    return caps[g.node_index] / g.channel_gbps if caps else math.inf


def _ll_max(g: Group) -> float:
    if g.nodes == 1:
        return LL_MAX_ONE_NODE.get(g.generation, LL_MAX_ONE_NODE["volta"])
    return LL_MAX_NODES[g.cpu][0 if g.nodes == 2 else 1]


def _bus_gbps(op: str, algorithm: str, protocol: str, g: Group) -> float:
    """NCCL's bus bandwidth for the pair, GB/s."""
    b = g.simple_gbps
    if algorithm == "ring":
        if protocol == "LL":
            return min(_ll_max(g), b * (0.25 if g.nodes > 1 or op == "all_reduce" else 1 / 3))
        if protocol == "LL128":
            return b * min(0.7 if g.ppn < 2 else 0.92, _cap(RING_LL128_PER_CH, g))
        return b
    tree = b * min(0.92, _cap(TREE_PER_CH, g))
    if protocol == "LL":
        return min(tree / 3.8, _ll_max(g))
    if protocol == "LL128":
        return min(tree * (7 / 9 if g.nodes == 1 else 120 / 128),
                   b * _cap(TREE_LL128_PER_CH, g))
    return tree


def _latency_us(op: str, algorithm: str, protocol: str, g: Group, nbytes: float) -> float:
    p = PROTOCOLS.index(protocol)
    base = BASE_US[algorithm][p]
    intra, net = HOP_US[g.intra_link][algorithm][p], HOP_US["net"][algorithm][p]
    if algorithm == "tree":
        return base + 2 * ((g.ppn - 1) * intra + math.floor(math.log2(g.nodes)) * net)
    steps, inter = _steps(op, g)
    if g.nodes > 1:  # the CPU posts every step's network transfer
        intra = max(intra, NET_OVERHEAD_US[g.cpu] * (3 if protocol == "Simple" else 1))
    lat = base + (steps - inter) * intra + inter * net
    channels = max(1, round(g.simple_gbps / g.channel_gbps))
    if (protocol == "Simple" and g.nodes > 1 and op == "all_reduce"
            and nbytes / (channels * g.size) >= 64):
        lat *= PLATEAU
    return lat


def _enabled(algorithm: str, protocol: str, op: str, g: Group, protocols: str) -> bool:
    if protocols == "simple":  # NCCL_ALGO=Ring NCCL_PROTO=Simple
        return algorithm == "ring" and protocol == "Simple"
    if algorithm == "tree" and op != "all_reduce":
        return False
    if protocol == "LL128":  # NCCL enables it by default on NVLink nodes of these GPUs
        return g.intra_link == "nvlink" and g.generation in RING_LL128_PER_CH
    return True


# A search asks for a few hundred distinct calls hundreds of thousands of times; the answer
# depends on the arguments alone (the tables above are constants), so it is kept.
@functools.lru_cache(maxsize=65536)
def call(op: str, nbytes: float, g: Group, protocols: str = "auto") -> Call:
    """The cheapest enabled pair for one call moving `nbytes` (the whole tensor: an
    all-gather's output, a reduce-scatter's input), as ncclTopoGetAlgoTime prices it."""
    if g.size <= 1 or nbytes <= 0:
        return Call(0.0, 0.0, "ring", "Simple")
    best = None
    for algorithm in ALGORITHMS:
        for protocol in PROTOCOLS:
            if not _enabled(algorithm, protocol, op, g, protocols):
                continue
            bus = _bus_gbps(op, algorithm, protocol, g)
            if algorithm == "ring":
                steps, _ = _steps(op, g)
                alg = bus * g.size / steps
            else:
                alg = bus * 0.5
                log_size = max(0, int(math.log2(max(1.0, nbytes / 64))))
                if log_size < len(TREE_CORRECTION[0]):
                    alg *= TREE_CORRECTION[PROTOCOLS.index(protocol)][log_size]
            start = 1e-6 * _latency_us(op, algorithm, protocol, g, nbytes)
            c = Call(start + nbytes / (alg * 1e9), start, algorithm, protocol)
            if best is None or c.seconds < best.seconds:
                best = c
    return best
