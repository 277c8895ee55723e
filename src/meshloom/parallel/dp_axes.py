"""The mesh axes a data-parallel strategy (DDP, ZeRO-1/2, ZeRO-3) runs over for its parameters.

Dense parameters are the same on every data x context rank: ZeRO shards them over dp_shard and
sums the shards over dp_replicate (HSDP) and cp. Under expert parallel an expert is held only by
the ranks of one ep coordinate: ZeRO shards it over edp_shard and sums over dp_replicate
(mesh.py, EXPERT_AXES). Either way gradients are divided by the data x context degree.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DPAxes:
    shard: str  # ZeRO shards over it
    replicas: tuple[str, ...]  # the reduced shard is then summed over these
    whole: str  # every rank holding the same parameters (start-up broadcast, DDP's all-reduce)
    split: tuple[str, ...] = ()  # axes the parameters themselves are split over (grad norm)


DENSE = DPAxes(shard="dp_shard", replicas=("dp_replicate", "cp"), whole="dp")
EXPERTS = DPAxes(shard="edp_shard", replicas=("dp_replicate",), whole="edp", split=("ep",))
