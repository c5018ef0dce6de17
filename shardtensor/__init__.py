"""shardtensor: parameters sharded along dim 0 as a tensor subclass (ZeRO-3 / FSDP2 style), in pure PyTorch.

One line turns a model's parameters into ``ShardedParam``s; ordinary training code (stock ``torch.optim``
optimizers, ``clip_grad_norm_``, gradient accumulation) runs unchanged.
"""

from ._comm import CollectiveError, collective_timeout, set_collective_timeout
from ._comm_divergence import DivergenceError, identity_check_stats, set_divergence_check
from .api import gather_stats, shard_module
from .full_state import full_state_dict, load_full_state_dict
from .checkpoint import load_checkpoint, save_checkpoint, sharded_optimizer_state_dict, sharded_state_dict
from .composable import gradient_sync, unshard_module
from ._dispatch import ShardedOpError
from .gather import Gatherer, GatherMode
from .layerwise import OwnerLayout, placement_plan
from .materialize import materialize
from ._misuse_optim import check_optimizer_step, note_optimizer_step
from .policy import GatherPolicy, MixedPrecisionPolicy
from .reduce import ExactReducer
from ._layout import ShardLayout
from .tensor import ShardedParam

__all__ = [
    "ShardedParam",
    "ShardLayout",
    "OwnerLayout",
    "placement_plan",
    "ShardedOpError",
    "shard_module",
    "full_state_dict",
    "load_full_state_dict",
    "gather_stats",
    "sharded_state_dict",
    "sharded_optimizer_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "materialize",
    "note_optimizer_step",
    "check_optimizer_step",
    "gradient_sync",
    "unshard_module",
    "Gatherer",
    "GatherMode",
    "ExactReducer",
    "GatherPolicy",
    "MixedPrecisionPolicy",
    "set_collective_timeout",
    "collective_timeout",
    "CollectiveError",
    "DivergenceError",
    "set_divergence_check",
    "identity_check_stats",
]
