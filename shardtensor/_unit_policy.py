"""Which modules become gather units: FSDP2's usual wrapping by default, MoE layers always, or the user's policy.

Why MoE layers always: see [Note: why units] in ``_units``; why blocks only outside sequential mode: a block's
parameters gathered together raise the peak that sequential mode exists to keep low.
"""

from __future__ import annotations

from typing import Callable, Sequence, Union

from torch import nn

UnitPolicy = Union[None, bool, Sequence[type], Callable[[nn.Module], bool]]
_CONTAINERS = (nn.ModuleList, nn.Sequential)
_EXPERT_LISTS = (*_CONTAINERS, nn.ModuleDict)  # transformers' SwitchTransformersExperts is a ModuleDict


def _data_dependent(module: nn.Module) -> bool:
    """An MoE layer, whose forward uses the experts its data chooses: an expert list, or experts stacked in the
    module's own parameters and indexed per expert (transformers' ``MixtralExperts``: a class named *Experts*)."""
    own = "experts" in type(module).__name__.lower() and next(module.parameters(recurse=False), None) is not None
    return own or any(isinstance(child, _EXPERT_LISTS) and "expert" in name.lower()
                      for name, child in module.named_children())


def default_units(root: nn.Module, blocks: bool = True) -> list[nn.Module]:
    """FSDP2's usual wrapping: each member of the outermost ``ModuleList``/``Sequential`` (a block; only with
    ``blocks``), and any module with an expert list (an MoE layer) that is not already inside a unit; where blocks
    were found, the root last, for the parameters no block holds (embeddings, final norm, a tied head), as FSDP2's
    ``fully_shard(model)`` after its blocks: one gather and one reduction for them, not one per parameter (where
    they fit in one block's size, ``_leftover_fits``)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if _data_dependent(module):
            found.append(module)
        elif isinstance(module, _CONTAINERS) and blocks:
            found.extend(child for child in module.children() if any(True for _ in child.parameters()))
        else:
            for child in module.children():
                visit(child)

    visit(root)
    if blocks and root not in found and _leftover_fits(root, [m for m in found if not _data_dependent(m)]):
        found.append(root)
    return found


def _leftover_fits(root: nn.Module, block_units: list[nn.Module]) -> bool:
    """Whether the root's parameters outside the blocks are no larger than the largest block: held through the
    forward as one unit, they then cost what one more block does (a model whose blocks are a small part of it,
    a container of two layers beside attention and embeddings, keeps per-parameter gathers)."""
    if not block_units:
        return False
    inside = {id(p) for m in block_units for p in m.parameters()}
    leftover = sum(p.numel() for p in root.parameters() if id(p) not in inside)
    return 0 < leftover <= max(sum(p.numel() for p in m.parameters()) for m in block_units)


def select_units(root: nn.Module, policy: UnitPolicy, blocks: bool = True) -> list[nn.Module]:
    """The outermost modules ``policy`` names: module classes, or a callable ``module -> bool`` (FSDP2 style);
    ``None``/``True``: ``default_units`` (blocks too where ``blocks``); ``False`` or ``()``: none."""
    if policy is None or policy is True:
        return default_units(root, blocks)
    if policy is False:
        return []
    if isinstance(policy, (list, tuple, set, frozenset)):
        classes = tuple(policy)
        if not all(isinstance(c, type) for c in classes):
            raise TypeError(f"shard_module: units={policy!r}; expected module classes or a callable")
        policy = lambda m, _c=classes: isinstance(m, _c)  # noqa: E731
    if not callable(policy):
        raise TypeError(f"shard_module: units={policy!r}; expected module classes, a callable, None or False")
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if policy(module):
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(root)
    return found
