"""torch's own state-dict helpers asked for full tensors: ``get_model_state_dict`` / ``get_optimizer_state_dict``
with ``StateDictOptions(full_state_dict=True)``, the FSDP2 way of exporting a model for inference.

They gather DTensors and take any other tensor as it is, so a ``ShardedParam`` came back as this rank's rows:
rank 0 saved a part of the model and the job said nothing.  These state-dict post-hooks recognise that call
(torch hands its options to no hook: they are read from the helper's own frame) and give full plain tensors,
gathered on every rank (the helpers must be called on every rank, as their DTensor gathers need), moved to the
CPU one by one where ``cpu_offload=True`` asks for it.  Any other ``state_dict()`` keeps its shards (DCP saves
each rank's rows).
"""

from __future__ import annotations

from typing import Any, Optional

from ._frames import caller_frame, inside
from .tensor import ShardedParam

_HELPERS = {"_get_model_state_dict", "_get_optim_state_dict"}
_HELPERS_MODULE = "torch.distributed.checkpoint.state_dict"


def _full_state_options() -> Optional[Any]:
    """The options of the torch helper this ``state_dict()`` runs under, if it asked for full tensors."""
    frame = caller_frame(lambda f: f.f_code.co_name in _HELPERS and f.f_globals.get("__name__") == _HELPERS_MODULE,
                         limit=24)
    if frame is None:
        return None
    info = frame.f_locals.get("info")
    return info if getattr(info, "full_state_dict", False) else None


def _full(value: Any, cpu: bool) -> Any:
    if isinstance(value, ShardedParam):
        full = value.full_tensor()
        return full.cpu() if cpu else full
    if isinstance(value, dict):
        return {k: _full(v, cpu) for k, v in value.items()}
    return value


def full_model_state_for_torch_helpers(module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A sharded root's state-dict post-hook (see the module docstring).  Also names the fix where transformers'
    ``save_pretrained`` reads the state dict itself: it failed inside safetensors ("data pointer on an invalid
    python storage"), and it is often called on rank 0 alone, where no gather can run."""
    info = _full_state_options()
    if info is not None:
        for key in [k for k, v in state_dict.items() if isinstance(v, ShardedParam)]:
            state_dict[key] = _full(state_dict[key], bool(info.cpu_offload))
    elif any(isinstance(v, ShardedParam) for v in state_dict.values()) and inside("save_pretrained", "transformers"):
        raise RuntimeError(
            f"save_pretrained of a sharded {type(module).__name__}: its state_dict() holds each rank's rows, not "
            "the full tensors, and gathering them needs every rank. No weights were written. Fix: on every rank "
            "state = shardtensor.full_state_dict(model, rank0_only=True), then on rank 0 "
            "model.save_pretrained(path, state_dict=state).")


def full_optimizer_state_for_torch_helpers(optimizer, state_dict: dict) -> dict:
    """The state-dict post-hook of an optimizer over sharded parameters (see the module docstring)."""
    info = _full_state_options()
    if info is not None:
        state_dict["state"] = {k: _full(v, bool(info.cpu_offload)) for k, v in state_dict["state"].items()}
    return state_dict
