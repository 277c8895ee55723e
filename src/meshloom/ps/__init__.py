"""Parameter-server hybrid for recommendation models (docs/parameter-server.md).

Embedding tables live on parameter-server processes and are reached through torch.distributed.rpc;
the small dense MLP is replicated on trainer processes with meshloom's DDP. Distributed autograd
carries the tables' gradients back to the servers, where a DistributedOptimizer applies them.

Importing this package does not import torch: `meshloom train` asks `is_ps_config()` first.
"""

from meshloom.ps.config import PSConfig, is_ps_config, load_ps_config, validate_ps

__all__ = ["PSConfig", "is_ps_config", "load_ps_config", "validate_ps"]
