"""meshloom: train transformers with any mix of data, tensor, pipeline and context parallelism.

The library, for a training loop of your own (docs/library.md):

    import meshloom as ml
    layout = ml.ParallelConfig(dp_shard=2, tp=2, zero_stage=3)
    mesh = ml.init_mesh(layout)                    # under torchrun: one process per rank
    par = ml.parallelize(model, mesh, layout)      # any model honouring ml.ModelContract
    ...                                            # your loop: par.model, par.loss, par.grads

The names are imported on first use: importing torch up front would slow down the command line
(`meshloom --help`), which imports this package too.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    # configuration (plain data; no torch)
    "Config": "meshloom.config",
    "ParallelConfig": "meshloom.config",
    "load_config": "meshloom.config",
    # the mesh and the layout
    "ParallelDims": "meshloom.mesh",
    "Mesh": "meshloom.mesh",
    "init_mesh": "meshloom.mesh",
    "parallelize": "meshloom.parallel",
    "Parallelized": "meshloom.parallel",
    "PipelineSpec": "meshloom.parallel",
    # models: the contract, and meshloom's own families
    "ModelContract": "meshloom.models.contract",
    "Pieces": "meshloom.models.contract",
    "Family": "meshloom.models.contract",
    "build_model": "meshloom.models.families",
    "config_from_preset": "meshloom.models.families",
    "generate": "meshloom.models.generate",
    # what a loop needs besides its optimizer
    "grad_norm": "meshloom.optim",
    "clip_grads": "meshloom.optim",
    "save_checkpoint": "meshloom.checkpoint",
    "load_checkpoint": "meshloom.checkpoint",
    "latest_checkpoint": "meshloom.checkpoint",
}
# Not `train`: `import meshloom.train` (the per-rank module) would replace such an attribute by
# the module itself. The whole config-driven loop is `meshloom.train.train(cfg)`.

__all__ = [
    "Config", "Family", "Mesh", "ModelContract", "ParallelConfig", "ParallelDims", "Parallelized",
    "Pieces", "PipelineSpec", "__version__", "build_model", "clip_grads", "config_from_preset",
    "generate", "grad_norm", "init_mesh", "latest_checkpoint", "load_checkpoint", "load_config",
    "parallelize", "save_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'meshloom' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from meshloom.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from meshloom.config import Config, ParallelConfig, load_config
    from meshloom.mesh import Mesh, ParallelDims, init_mesh
    from meshloom.models.contract import Family, ModelContract, Pieces
    from meshloom.models.families import build_model, config_from_preset
    from meshloom.models.generate import generate
    from meshloom.optim import clip_grads, grad_norm
    from meshloom.parallel import Parallelized, PipelineSpec, parallelize
