"""Model-state memory and data-parallel communication per rank, by ZeRO stage.

One place for the formulas that the sharded-DP code is tested against and that the planner
uses. Ψ is the number of parameters; N the dp_shard degree. With mixed-precision Adam
(Rajbhandari et al., arXiv 1910.02054): DDP (2+2+12)Ψ = 16Ψ; ZeRO-1 4Ψ + 12Ψ/N; ZeRO-2
2Ψ + 14Ψ/N; ZeRO-3 16Ψ/N. In fp32 with no separate master copy (4-byte parameters and
gradients, 8 bytes of Adam state, no master): DDP 16Ψ; ZeRO-1 8Ψ + 8Ψ/N; ZeRO-2 4Ψ + 12Ψ/N;
ZeRO-3 16Ψ/N. `psi` may be the padded element count, which is what the code allocates.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Precision:
    param_bytes: int = 4  # the working copy the model computes with
    grad_bytes: int = 4
    master_bytes: int = 0  # a separate fp32 master copy (0 when the params are fp32 already)
    optim_bytes: int = 8  # Adam: momentum + variance in fp32


FP32 = Precision()
MIXED = Precision(param_bytes=2, grad_bytes=2, master_bytes=4, optim_bytes=8)


def model_state_bytes(psi: int, n_shard: int, stage: int, prec: Precision = FP32
                      ) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and optimizer state (master copy included)."""
    sharded_params = stage >= 3
    sharded_grads = stage >= 2
    return {
        "params": prec.param_bytes * psi / (n_shard if sharded_params else 1),
        "grads": prec.grad_bytes * psi / (n_shard if sharded_grads else 1),
        "optimizer": (prec.optim_bytes + prec.master_bytes) * psi / (n_shard if stage else 1),
    }


def dp_comm_bytes(psi: int, stage: int, *, micro_batches: int = 1, n_shard: int = 1,
                  n_replicate: int = 1, elem_bytes: int = 4, root_psi: int = 0,
                  forward_only_psi: int = 0, reshard_after_forward: bool = True,
                  carried_psi: int = 0, reduce_once: bool = False) -> dict[tuple[str, str], int]:
    """Payload bytes per optimizer step, per (axis, op), as `meshloom.comm` counts them (the
    whole tensor a collective acts on). Stages 2 and 3 keep no whole gradients, so they
    reduce-scatter after every micro-batch (stage 3 once a step under `reduce_once`). Stage 3
    gathers each unit for forward and again for backward, every micro-batch (once a step if it
    is not resharded after forward: then every
    unit stays gathered to the step's last backward); the root unit's
    `root_psi` parameters (final norm and head) are gathered once per micro-batch and kept, and
    `forward_only_psi` ones (an embedding, whose backward reads only the token ids) are gathered
    for forward only. `carried_psi` parameters stay gathered from one micro-batch's backward to
    the next one's forward (meshloom's ZeRO-3 under plain accumulation: the first block and a
    tied root): every micro-batch but the first skips their gather. `reduce_once` (stage 3):
    whole gradients summed over the micro-batches, reduce-scattered once a step."""
    full = psi * elem_bytes
    if stage == 0:
        axis = "dp"
        return {(axis, "all_reduce"): full} if n_shard * n_replicate > 1 else {}
    once_a_step = stage == 1 or stage == 3 and reduce_once
    out = {("dp_shard", "reduce_scatter"): full * (1 if once_a_step else micro_batches)}
    if stage in (1, 2):
        out[("dp_shard", "all_gather")] = full
    elif not reshard_after_forward:
        out[("dp_shard", "all_gather")] = full
    else:
        once = root_psi + forward_only_psi
        gathered = 2 * (psi - once) + once
        gathered = gathered * micro_batches - carried_psi * (micro_batches - 1)
        out[("dp_shard", "all_gather")] = gathered * elem_bytes
    if n_replicate > 1:
        out[("dp_replicate", "all_reduce")] = full // n_shard
    return out
