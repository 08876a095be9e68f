"""jax_moe_comm: expert-parallel MoE dispatch/combine for JAX.

    cfg  = MoECommConfig(num_experts, experts_per_token, hidden, max_tokens, ...)
    comm = MoEComm(cfg, mesh, axis_name="ep")
    d    = comm.dispatch(x, topk_ids)                 # inside shard_map over "ep"
    y    = comm.combine(expert_y, d.handle, topk_weights)
"""

from ._native import build_info
from .comm import MoEComm, combine, dispatch
from .config import MoECommConfig
from .errors import MoECommError
from .quantize import quantize_rows
from .runtime import finalize, initialize
from .types import CombineHandle, Dispatched

__all__ = [
    "CombineHandle",
    "Dispatched",
    "MoEComm",
    "MoECommConfig",
    "MoECommError",
    "build_info",
    "combine",
    "dispatch",
    "finalize",
    "initialize",
    "quantize_rows",
]
__version__ = "0.1.0"
