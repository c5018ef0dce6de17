"""``Muon``: a layer-wise optimizer that steps only the parameters this rank owns, on whole matrices.

Muon orthogonalises each 2-d update with a Newton-Schulz iteration (``X <- aX + b(XX^T)X + c(XX^T)^2 X``), which
needs the whole matrix: a dim-0 shard's rows cannot be orthogonalised on their own.  With
``shard_module(model, placement="layerwise")`` every parameter is owned whole by one rank, and its owner holds
the whole mean gradient after backward (``shardtensor.layerwise``).  So Muon runs unchanged on the owner:
this class composes the stock ``torch.optim.Muon`` (owned 2-d hidden weights) and ``torch.optim.AdamW``
(everything else this rank owns) over the owners' plain ``to_local()`` tensors.  Non-owners hold 0-row shards
and are skipped; nothing communicates in ``step()``.  After the step, the next forward broadcasts the updated
parameters from their owners, prefetched in the recorded order by the Gatherer (``gather="overlapped"``).

Which parameters get Muon (``use_muon``; the default follows the Muon recipes, Keller Jordan's and Moonshot's):
2-d parameters that are not embedding tables.  Embeddings (and heads tied to them) go to AdamW: a lookup table's
rows are updated independently, and an orthogonalised update would spread a few tokens' gradient over the whole
table.  An untied output head is 2-d and goes to Muon by default; the recipes put it in AdamW, which
``use_muon=lambda name, p: p.dim() == 2 and "head" not in name`` does.  1-d parameters (biases, norm weights)
and 0-d ones (replicated on every rank, stepped alike everywhere) go to AdamW.

Peers: veScale-FSDP and Dion keep dim-0 shards and, at each step, send each matrix whole to one rank,
orthogonalise it there and scatter it back (two extra collectives per matrix per step, and the placement of
that work is chosen per step).  Here the matrix never leaves its owner between steps: the gradient is reduced to
the owner (one reduce, the same bytes as a reduce-scatter's input) and the parameter is broadcast from it for the
next forward, which the forward needs anyway.  The cost moves to the forward: a broadcast moves the whole
tensor from one rank, where an all-gather spreads the sending over all of them.

Optimizer state lives only on the owner: a rank holds the momentum / Adam moments of what it owns (about
``1/world`` of the model with a balanced plan).  ``state_dict()`` is this rank's part.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

import shardtensor
from shardtensor._agreement import any_rank
from shardtensor.layerwise import OwnerLayout
from shardtensor.tensor import ShardedParam


def _embedding_weights(module: nn.Module) -> set[int]:
    return {id(m.weight) for m in module.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}


class Muon:
    """Muon (``torch.optim.Muon``) for this rank's owned 2-d weights, AdamW for the rest it owns.

    Args:
        module: the model, sharded with ``shard_module(model, placement="layerwise")`` or unsharded (then every
            parameter is owned).  Embedding tables are found by module type, which is why this takes the module.
        lr, momentum, nesterov, weight_decay, ns_steps, adjust_lr_fn: ``torch.optim.Muon``'s (Default: 0.02,
            0.95, True, 0.1, 5, None = Keller Jordan's ``sqrt(max(1, rows / cols))`` scaling).
        adamw_lr, adamw_betas, adamw_eps, adamw_weight_decay: ``torch.optim.AdamW``'s for the other parameters
            (Default: 3e-4, (0.9, 0.95), 1e-8, 0.0).
        use_muon: ``(name, param) -> bool`` choosing the Muon parameters; must return ``False`` for non-2-d ones
            (Default: 2-d and not an embedding table; see the module docstring).

    The two stock optimizers are ``.muon`` and ``.adamw`` (``None`` when this rank owns no parameter for them):
    attach an LR scheduler to each.  ``param_groups`` lists both optimizers' groups.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        ns_steps: int = 5,
        adjust_lr_fn: Optional[str] = None,
        adamw_lr: float = 3e-4,
        adamw_betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        adamw_weight_decay: float = 0.0,
        use_muon: Optional[Callable[[str, torch.Tensor], bool]] = None,
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"Muon(module=...): expected the model (an nn.Module), got {type(module).__name__}; "
                            "it finds embedding tables by module type")
        embeddings = _embedding_weights(module)
        if use_muon is None:
            use_muon = lambda name, p: p.dim() == 2 and id(p) not in embeddings  # noqa: E731
        # Every parameter, frozen ones too: as torch's optimizers, a layer unfrozen later (staged fine-tuning) is
        # stepped once it has a gradient (a parameter without one is skipped by the stock optimizers).
        self._params: list[torch.Tensor] = []  # (zero_grad clears them all)
        self._proxies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (owned parameter, the tensor stepped)
        self._owned_names: list[str] = []  # saved with the state: a file records whose it is
        self._placement: tuple = (0, 1, None)  # (rank, world, group) of the layer-wise placement
        muon_locals: list[torch.Tensor] = []
        adamw_locals: list[torch.Tensor] = []
        for name, p in module.named_parameters():
            self._params.append(p)
            to_muon = use_muon(name, p)
            if to_muon and p.dim() != 2:
                raise ValueError(f"Muon: use_muon chose {name!r} of shape {tuple(p.shape)}; Muon steps 2-d "
                                 "matrices only. Return False for it so AdamW steps it.")
            local = self._owned_local(name, p)
            if isinstance(p, ShardedParam):
                self._placement = (p.shard_layout.rank, p.shard_layout.world, p.shard_layout.group)
            if local is None:
                continue  # another rank owns it
            self._owned_names.append(name)
            self._proxies.append((p, local))
            (muon_locals if to_muon else adamw_locals).append(local)
        self.muon: Optional[torch.optim.Muon] = None
        self.adamw: Optional[torch.optim.AdamW] = None
        if muon_locals:
            self.muon = torch.optim.Muon(muon_locals, lr=lr, momentum=momentum, nesterov=nesterov,
                                         weight_decay=weight_decay, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        if adamw_locals:
            self.adamw = torch.optim.AdamW(adamw_locals, lr=adamw_lr, betas=adamw_betas, eps=adamw_eps,
                                           weight_decay=adamw_weight_decay)

    @staticmethod
    def _owned_local(name: str, p: torch.Tensor) -> Optional[torch.Tensor]:
        """The whole tensor this rank steps for ``p``, or ``None`` when another rank owns it."""
        if not isinstance(p, ShardedParam):
            return p  # unsharded or replicated (0-d): every rank steps it alike
        layout = p.shard_layout
        if not isinstance(layout, OwnerLayout):
            raise ValueError(
                f"Muon: parameter {name!r} is a dim-0 shard ({type(layout).__name__}); Newton-Schulz needs whole "
                "matrices. Shard with shardtensor.shard_module(model, placement='layerwise')."
            )
        return p.to_local() if layout.owns else None

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], torch.Tensor]] = None) -> Optional[torch.Tensor]:
        """Step the owned parameters on whole tensors.  Never communicates (gradients already sit on the owner)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        shardtensor.check_optimizer_step(self, self._params)  # before any update, as every torch.optim step
        self._follow_new_locals()
        for p, local in self._proxies:
            if local is not p:
                grad = p.grad
                local.grad = grad.to_local() if isinstance(grad, ShardedParam) else grad
        try:
            for opt in self.optimizers:
                opt.step()
            shardtensor.note_optimizer_step(self._params)  # every rank, owner or not: see its docstring
        finally:
            for p, local in self._proxies:
                if local is not p:
                    local.grad = None  # the ShardedParam's .grad keeps it; no second reference past the step
        return loss

    def _follow_new_locals(self) -> None:
        """``materialize()`` gives a meta-built model new local tensors: the stepped ones follow them (a Muon built
        between ``shard_module`` and ``materialize`` stepped the meta ones: torch's device error)."""
        for i, (p, local) in enumerate(self._proxies):
            current = p.to_local() if local is not p else p
            if current is local:
                continue
            for opt in self.optimizers:
                for group in opt.param_groups:
                    group["params"] = [current if q is local else q for q in group["params"]]
                if local in opt.state:
                    opt.state[current] = opt.state.pop(local)
            self._proxies[i] = (p, current)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self._params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (its owned parameters), per inner optimizer, with whose it is."""
        rank, world, _ = self._placement
        return {"muon": self.muon.state_dict() if self.muon else None,
                "adamw": self.adamw.state_dict() if self.adamw else None,
                "owner": {"rank": rank, "world": world, "params": list(self._owned_names)}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load this rank's own file.  Another rank's is refused on every rank before anything is loaded (with
        layers of one shape on two ranks, rank 0's file loaded on rank 1 without a word, momentum and all)."""
        rank, world, group = self._placement
        owner, refusal = state.get("owner"), ""
        if owner is not None and (owner.get("rank"), owner.get("world"), owner.get("params")) != (
                rank, world, self._owned_names):
            refusal = (f"Muon.load_state_dict: the state is rank {owner.get('rank')}'s of a {owner.get('world')}-"
                       f"rank run (it steps {owner.get('params')[:3]}...), but this is rank {rank} of {world} "
                       f"(stepping {self._owned_names[:3]}...). Nothing was loaded on any rank. Fix: load the state "
                       "saved by the same rank under the same placement.")
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if not refusal and (opt is None) != (state.get(key) is None):
                refusal = (f"Muon.load_state_dict: {key!r} state is {'missing' if opt is not None else 'present'} "
                           f"but this rank {'owns' if opt is not None else 'owns no'} parameters for it. Nothing "
                           "was loaded on any rank. Fix: load the state saved by the same rank under the same "
                           "placement.")
        if any_rank(bool(refusal), group, "Muon.load_state_dict: the verdicts"):
            raise ValueError(refusal or "Muon.load_state_dict: another rank's state is not its own (its error "
                             "names it); nothing was loaded on any rank.")
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if opt is not None:
                opt.load_state_dict(state[key])
