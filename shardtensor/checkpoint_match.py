"""A checkpoint against the module and optimizer it loads into: keys, shapes, dtypes and parameter groups,
checked on every rank before anything is copied (see [Note: all-or-nothing loads] in ``checkpoint_verify.py``)."""

from __future__ import annotations

import os
import warnings

import torch

from .checkpoint_files import CheckpointError

_MODEL, _OPTIM = "model", "optim"


def check_param_groups(metadata, optimizer: torch.optim.Optimizer, optim_state: dict, path) -> None:
    """Each optimizer group must take its parameters from at most one saved group, and each saved group feed at
    most one optimizer group: torch maps saved groups onto the optimizer's by parameter name, and groups split
    another way (weights and biases saved, layers loaded) left a group with no lr or betas (the next step raised
    KeyError) or with another group's settings."""
    import torch.distributed.checkpoint as dcp

    prefix = f"{_OPTIM}.param_groups."
    saved = {key[len(prefix):].split(".", 1)[0] for key in metadata.state_dict_metadata if key.startswith(prefix)}
    if saved and len(saved) != len(optimizer.param_groups):
        raise CheckpointError(f"load_checkpoint: the checkpoint has {len(saved)} optimizer param groups, the "
                              f"optimizer {len(optimizer.param_groups)}")
    if not saved or any(f"{prefix}{i}.params" not in metadata.state_dict_metadata for i in range(len(saved))):
        return
    probe = {_OPTIM: {"param_groups": [{"params": []} for _ in saved]}}  # the names only: a few bytes per group
    with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a single process" (it is)
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(probe, checkpoint_id=os.fspath(path), no_dist=True)
    saved_group_of = {name: i for i, group in enumerate(probe[_OPTIM]["param_groups"]) for name in group["params"]}
    taken_by: dict = {}
    for index, group in enumerate(optim_state["param_groups"]):
        sources = sorted({saved_group_of[name] for name in group["params"] if name in saved_group_of})
        clash = [s for s in sources if taken_by.setdefault(s, index) != index]
        if len(sources) > 1 or clash:  # parameters the checkpoint lacks are fine: they start fresh
            raise CheckpointError(
                f"load_checkpoint: optimizer param group {index} holds parameters of saved groups {sources}"
                + (f", and saved group {clash[0]} also feeds group {taken_by[clash[0]]}" if clash else "")
                + ", so the saved groups' settings and state would land on other parameters (a group could lose its "
                "lr). Fix: build the optimizer's param groups as they were when the checkpoint was saved (each "
                "saved group's parameters in one group, in the same order of groups).")


def hold_back_unsaved_settings(metadata, state: dict) -> list:
    """Optimizer settings the checkpoint lacks (``initial_lr``, which an LR scheduler built before the load adds;
    a setting a newer torch added) keep this optimizer's value: DCP asks for every key it is given, and one it
    cannot find failed the whole load half way.  A checkpoint with no optimizer at all, or whose groups hold
    settings of another kind of optimizer, is refused here, before anything is copied.  Returns the settings
    held back, for ``put_back_settings`` after the load.  Settings the checkpoint holds that this optimizer lacks
    (``initial_lr``, where the scheduler is built after the load with ``last_epoch=k``) are loaded too: they
    were dropped, and the scheduler raised torch's "param 'initial_lr' is not specified"."""
    saved = metadata.state_dict_metadata
    if not any(key.startswith(f"{_OPTIM}.") for key in saved):
        raise CheckpointError("load_checkpoint: the checkpoint holds no optimizer state (it was saved as "
                              "save_checkpoint(path, model)). Fix: load_checkpoint(path, model) for the model alone; "
                              "the optimizer then starts fresh.")
    held = []
    for index, group in enumerate(state[_OPTIM]["param_groups"]):
        prefix = f"{_OPTIM}.param_groups.{index}."
        theirs = {key[len(prefix):] for key in saved if key.startswith(prefix)}
        ours = set(group) - {"params"}
        missing, foreign = sorted(ours - theirs), sorted(theirs - ours - {"params", "param_names"})
        if missing and foreign:
            raise CheckpointError(
                f"load_checkpoint: optimizer param group {index} has settings {missing} that the checkpoint lacks, "
                f"and the checkpoint has {foreign} that this optimizer lacks: it was saved with another kind of "
                "optimizer. Fix: build the optimizer the checkpoint was saved with, or load_checkpoint(path, model) "
                "for the model alone.")
        held += [(group, key, group.pop(key)) for key in missing]
        for key in foreign if not missing else ():  # (initial_lr of a scheduler the fresh optimizer has not met
            group[key] = None  # yet: DCP writes the saved value here, as opt.load_state_dict would bring it)
    return held


def put_back_settings(held: list) -> None:
    for group, key, value in held:
        group[key] = value


def leave_out_what_was_never_saved(metadata, state: dict, strict: bool) -> None:
    """A parameter with no optimizer state in the checkpoint (an unused head, a save before the first step)
    starts fresh, as ``optimizer.load_state_dict`` leaves it; with ``strict=False`` a model tensor the checkpoint
    lacks (a new head) keeps its value.  State the checkpoint holds only part of is still refused."""
    saved = metadata.state_dict_metadata
    if not strict:
        lacking = [k for k in state[_MODEL] if f"{_MODEL}.{k}" not in saved]
        if lacking and len(lacking) == len(state[_MODEL]):  # nothing would load: another model, or a prefix
            raise CheckpointError(f"load_checkpoint: none of the model's tensors is in the checkpoint (the model "
                                  f"has e.g. {lacking[:2]}, the checkpoint {sorted(saved)[:2]}): strict=False would "
                                  "load nothing. Fix: load into the module that was saved, or its checkpoint.")
        for key in lacking:
            del state[_MODEL][key]
    optim_state = state.get(_OPTIM, {}).get("state", {})
    with_state = {key.rsplit(".", n)[0] for key in saved if key.startswith(f"{_OPTIM}.state.")
                  for n in range(1, key.count(".") - 1)}  # every prefix: a name holds dots
    for fqn in list(optim_state):
        if f"{_OPTIM}.state.{fqn}" not in with_state:  # (state of another optimizer's kind is still named below)
            del optim_state[fqn]


def check_against_metadata(metadata, state: dict, strict: bool) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor):
            continue
        if key not in saved:
            kind = ("with another kind of optimizer" if key.startswith(f"{_OPTIM}.state.") and
                    any(k.startswith(f"{_OPTIM}.state.") for k in saved) else "from another model")
            raise CheckpointError(f"load_checkpoint: {key!r} is not in the checkpoint (it has {len(saved)} entries, e.g. "
                                  f"{sorted(saved)[:3]}); was it saved {kind}?")
        meta = saved[key]
        if not isinstance(meta, TensorStorageMetadata) or tuple(meta.size) != tuple(value.shape):
            shape = tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else type(meta).__name__
            raise CheckpointError(f"load_checkpoint: {key!r} has shape {shape} in the checkpoint but "
                                  f"{tuple(value.shape)} in the model. Fix: build the model with "
                                  "the configuration the checkpoint was saved from (its sizes), then change it")
        if meta.properties.dtype != value.dtype:
            raise CheckpointError(f"load_checkpoint: {key!r} is {meta.properties.dtype} in the checkpoint but "
                                  f"{value.dtype} in the model. Fix: build (or convert) the model "
                                  f"in {meta.properties.dtype} before shard_module, load, then convert a fresh copy")
    if strict:
        extra = sorted(k for k, m in saved.items() if k.startswith(_MODEL + ".") and k not in flat
                       and isinstance(m, TensorStorageMetadata))
        if extra:
            raise CheckpointError(f"load_checkpoint: the checkpoint has tensors the model lacks: {extra[:5]} "
                             "(pass strict=False to ignore them)")
