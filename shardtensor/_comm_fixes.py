"""What a ``DivergenceError`` tells the user to do: the fix for each way ranks come to issue other collectives.

The general fix names the usual causes (code under ``if rank == 0:``, data-dependent modules, a loss that skips
an output on some ranks); a mark in the ranks' labels adds a specific one (a call that marks the collectives it
issues, ``_CALLERS``; a compiled graph's collectives on some ranks only; a replicated gradient averaged by a
hook).
"""

from __future__ import annotations

_FIX = (
    "Every rank must run the same ops on sharded parameters, in the same order. Code under `if rank == 0:` that "
    "reads or loads sharded parameters or gradients (an evaluation, generate(), logging p.grad.norm(), "
    "full_state_dict, load_state_dict) runs collectives the other ranks do not: run it on every rank and print on "
    "one (full_state_dict(model, rank0_only=True) on every rank gives rank 0 the tensors). A submodule whose use "
    "depends on the data (mixture-of-experts experts called only for routed tokens, blocks skipped or repeated per rank) "
    "must gather the same on every rank: make the module that holds the experts a gather unit "
    "(shard_module(..., units=[ExpertsModuleClass]): its parameters are gathered and reduced together, whatever "
    "the data), call every expert on every rank (with zero tokens if none is routed to it), or keep "
    "such parameters whole on every rank (shard_module(..., persist_numel=N) with N above the parameters' full "
    "numel, not the shard sizes named above). A loss that on some rank does not use an output computed from "
    "sharded parameters (a head's result dropped, an auxiliary loss added on some ranks only) runs that backward "
    "on the other ranks only: write the loss the same way on every rank and weight that output by 0 where it must "
    "not count (loss = main + w * aux, w = 0.0 there; units do not help). "
    "set_divergence_check(False) turns this check off."
)


COMPILED_FIX = (" Here some ranks run the collective inside torch.compile'd code and the others eagerly (a "
                 "model compiled under `if rank == 0:`, or a compiled and an eager call of the model in another "
                 "order): a compiled step issues other collectives than an eager one. Fix: compile the model on "
                 "every rank, with the same options, and call the compiled model where the others do.")


# transformers' ``generate`` stops at each rank's own end of sequence, so ranks run different numbers of forwards;
# DeepSpeed ZeRO-3 and FSDP users pass ``synced_gpus=True`` (a finished rank runs dummy forwards until all end).
_GENERATE_FIX = (" In transformers' generate(): each rank stops at its own end of sequence. Fix: "
                 "model.generate(..., synced_gpus=True), as with DeepSpeed ZeRO-3 and FSDP.")
_FULLY_SHARD_FIX = (" In FSDP2's fully_shard(), on a model shard_module already sharded: the two shard the same "
                    "parameters. Fix: use one of them (shardtensor.unshard_module(model) first for FSDP2).")
# (function, file, the mark a rank inside it puts on its label, the fix every rank then adds)
_CALLERS = [("generate", "transformers", "(in generate()) ", _GENERATE_FIX),
            ("fully_shard", "torch/distributed", "(in fully_shard()) ", _FULLY_SHARD_FIX)]


# A replicated gradient averaged when its hook fires (not in the end-of-backward reduction, which takes every
# replicated parameter whatever the data reached): a hook reads it during backward.
_REPLICATED = "average of the replicated gradient of"
_REPLICATED_FIX = (
    "The ranks' data reached different replicated parameters (0-d, or below persist_numel) while their gradients "
    "were averaged at once, in the order their hooks fired, because a hook reads them during backward (a "
    "register_hook or register_post_accumulate_grad_hook on them, or speculative CPUAdam); without such hooks they "
    "are averaged at the end of backward whatever the data reached. Fix: remove the hook (read the gradient after "
    "backward instead), or CPUAdam(..., speculative=False).")
