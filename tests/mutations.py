"""Break the code on purpose, one mutation at a time, and check that the test meant to notice does fail.

    TRITON_INTERPRET=1 python tests/mutations.py            # every mutation in tests/mutations.md
    TRITON_INTERPRET=1 python tests/mutations.py same_placement int4_sign

Each mutation names a file, a function in it, a snippet of that function and its replacement (found by text
inside the function, not by line number, so it survives files being reorganised).  The file is changed in
place, the catching tests run, and the file is restored (also on Ctrl-C).  Exit code 1 if a mutation is
survived (its tests pass) or no longer applies (the snippet moved: update the table).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Mutation(NamedTuple):
    path: str
    function: str  # the snippet is searched for from ``def <function>`` on
    old: str
    new: str
    tests: tuple  # pytest node ids that must fail


MUTATIONS = {
    "compiled_unit_gather_reused_in_backward": Mutation(
        "shardtensor/_traced.py", "_unit_gather",
        "    phase = int(torch._C._current_autograd_node() is not None)", "    phase = 0",
        ("tests/test_compile.py::test_compiled_step_gathers_each_unit_once_per_phase_and_reduces_each_gradient_in_the_graph",)),
    "compiled_gather_not_tied_to_its_activation": Mutation(
        "shardtensor/_dispatch/traced.py", "run_traced",
        "    after = _first_activation(args, kwargs)", "    after = None",
        ("tests/test_compile.py::test_compiled_sequential_mode_gathers_per_read_and_again_in_the_backward",)),
    "compiled_step_leaves_versions_unmoved": Mutation(
        "shardtensor/_dispatch/traced.py", "optimizer_step_ends",
        "    _mark_written(params)", "    pass",
        ("tests/test_compile_step.py::test_a_compiled_optimizer_step_updates_the_shards_as_the_eager_step",)),
    "compiled_step_refused": Mutation(
        "shardtensor/_dispatch/traced.py", "_update_on_shards",
        "    if not _STEP_IN_PROGRESS[0] or", "    if True or",
        ("tests/test_compile_step.py::test_a_compiled_optimizer_step_updates_the_shards_as_the_eager_step",)),
    "compiled_step_states_made_whole": Mutation(
        "shardtensor/_dispatch/traced.py", "_shard_wise_rules",
        "local._copy, local._like)", "local._copy)",
        ("tests/test_compile_step.py::test_a_compiled_optimizer_step_updates_the_shards_as_the_eager_step",)),
    "unflatten_traced_after_a_backward_break": Mutation(
        "shardtensor/tensor.py", "_keep_out_of_dynamo",
        "    _compile.skip_in_dynamo(ShardedParam.__tensor_unflatten__)", "    pass",
        ("tests/test_compile_step.py::test_a_compiled_function_holding_backward_and_the_step_trains_as_eager",)),
    "compiled_overlapped_gathers_per_read": Mutation(
        "shardtensor/_units.py", "attach_units",
        "        _traced.record_units(units.units)", "        pass",
        ("tests/test_compile.py::test_compiled_step_gathers_each_unit_once_per_phase_and_reduces_each_gradient_in_the_graph",)),
    "compiled_gradients_leave_whole": Mutation(
        "shardtensor/_traced_grads.py", "read_through_boundaries",
        "    module.__class__ = cls", "    pass",
        ("tests/test_compile.py::test_compiled_step_gathers_each_unit_once_per_phase_and_reduces_each_gradient_in_the_graph",)),
    "compiled_boundary_on_a_replaced_parameter": Mutation(
        "shardtensor/_traced_grads.py", "_reader",
        "if torch.compiler.is_compiling() and isinstance(param, ShardedParam) and param.requires_grad",
        "if torch.compiler.is_compiling() and param.requires_grad",
        ("tests/test_compile.py::test_a_compiled_model_with_a_parameter_replaced_after_sharding_is_named_at_the_step_before_any_update",)),
    "second_part_of_a_deferred_gradient_taken_for_an_edit": Mutation(
        "shardtensor/_deferred_grads.py", "_defer",
        "        if kept is not None and not (task != -1 and self._deferred_task.get(key) == task):",
        "        if kept is not None:",
        ("tests/test_compile.py::test_compiled_gradient_accumulation_without_sync_equals_eager",)),
    "graph_keys_numbered_by_live_models": Mutation(
        "shardtensor/_traced_grads.py", "record",
        "        number = _GRAD_SYNCS[grad_sync] = next(_grad_sync_numbers)",
        "        number = _GRAD_SYNCS[grad_sync] = len(_GRAD_SYNCS)",
        ("tests/test_compile.py::test_graph_keys_of_gradients_are_never_given_twice",)),
    "graph_cache_blind_to_reduction_keys": Mutation(
        "shardtensor/_traced.py", "cache_fields",
        "_UNIT_OF.get(id(layout)), _GRAD_KEY_OF.get(id(layout)),", "_UNIT_OF.get(id(layout)), None,",
        ("tests/test_compile.py::test_cache_key_is_stable_and_tells_graphs_apart",)),
    "channel_sums_in_another_order": Mutation(
        "shardtensor/_comm_shm.py", "__init__",
        "        self.peers = [(channel.rank - k) % channel.world", "        self.peers = [(channel.rank + k) % channel.world",
        ("tests/test_comm_shm.py::test_gathers_and_reductions_give_every_rank_gloos_bits",)),
    "channel_vote_ignored": Mutation(
        "shardtensor/_comm_rows.py", "_check",
        "_comm._check(kind, total, group, label, channel.next_slot_free())",
        "_comm._check(kind, total, group, label, True)",
        ("tests/test_comm_shm.py::test_a_collective_goes_over_gloo_on_every_rank_where_any_slot_is_still_unread",)),
    "channel_read_not_marked": Mutation(
        "shardtensor/_comm_shm.py", "_took",
        "        _WORD.pack_into(self.mapping, self._read_at(self.rank, peer, work.slot), work.number)\n", "",
        ("tests/test_comm_shm.py::test_a_slot_is_never_written_before_its_readers_are_done",)),
    "shared_file_left_sparse": Mutation(
        "shardtensor/_comm_mailbox.py", "_create",
        "            os.posix_fallocate(fd, 0, size)", "            os.ftruncate(fd, size)",
        ("tests/test_comm_mailbox.py::test_a_shared_file_has_every_page_before_use_or_is_not_made",)),
    "mailbox_takes_a_torn_slot": Mutation(
        "shardtensor/_comm_mailbox.py", "read",
        "        return payload if _crc(found, payload) == crc else None", "        return payload",
        ("tests/test_comm_mailbox.py::test_a_half_written_or_stale_slot_is_not_taken",)),
    "mailbox_takes_a_stale_slot": Mutation(
        "shardtensor/_comm_mailbox.py", "read",
        "        if found != number or length != nbytes:", "        if length != nbytes:",
        ("tests/test_comm_mailbox.py::test_a_half_written_or_stale_slot_is_not_taken",)),
    "root_regathered_for_backward": Mutation(
        "shardtensor/_units.py", "_keep_for_backward",
        "        if unit is not self.root_unit or", "        if True or unit is not self.root_unit or",
        ("tests/test_unit_schedule.py::test_the_root_unit_is_gathered_once_per_step",)),
    "kept_root_hold_outlives_its_forward": Mutation(
        "shardtensor/_units.py", "step_begin",
        "        self._release_kept()\n", "",
        ("tests/test_unit_schedule.py::test_the_root_unit_is_gathered_once_per_step",)),
    "pool_not_carried_into_the_next_forward": Mutation(
        "shardtensor/_units.py", "_end_of_backward",
        "        if self._carries() and not self._tasks:", "        if False:",
        ("tests/test_unit_schedule.py::test_buffers_freed_at_the_end_of_a_backward_serve_the_next_forward",)),
    "to_dlpack_unguarded": Mutation(
        "shardtensor/_exports.py", "guard_to_dlpack",
        '    if getattr(original, "_shardtensor_guard", False):', "    if True:",
        ("tests/test_errors_and_repr.py::test_to_dlpack_of_a_shard_is_refused_not_a_crash",)),
    "rows_pickled_silently": Mutation(
        "shardtensor/_exports.py", "warn_rows_pickled",
        "    if _warned[0] or world == 1:", "    if True:",
        ("tests/test_errors_and_repr.py::test_torch_save_of_a_sharded_state_dict_warns_that_it_holds_this_ranks_rows",)),
    "zeros_like_plain_in_every_backward_callback": Mutation(
        "shardtensor/_dispatch/local.py", "_in_a_backward_formula",
        "    return node is not None and", "    return torch._C._current_graph_task_id() != -1 or",
        ("tests/test_grad_landing.py::test_optimizer_in_backward_equals_the_usual_loop",)),
    "generate_left_out_of_the_identity_record": Mutation(
        "shardtensor/_comm_divergence.py", "check_identity",
        "_crc(_caller_mark() + kind)", "_crc(kind)",
        ("tests/test_generate.py::test_generate_with_different_lengths_per_rank_names_synced_gpus",)),
    "sequential_layer_norm_takes_affine_for_sharded": Mutation(
        "shardtensor/_dispatch/sequential.py", "_layer_norm",
        "        if isinstance(param, ShardedParam):", "        if True:",
        ("tests/test_gather.py::test_layer_norm_of_a_sharded_tensor_with_whole_or_no_affine_parameters",)),
    "storage_of_a_shard_unnamed": Mutation(
        "shardtensor/tensor.py", "storage",
        "        raise RuntimeError(self._storage_refusal())", "        return super().storage()",
        ("tests/test_save_pretrained.py::test_save_pretrained_without_the_full_state_dict_names_the_recipe",)),
    "param_dtype_note_on_every_error": Mutation(
        "shardtensor/_dispatch/compute.py", "_about_dtypes",
        '    return "dtype" in text', '    return True or "dtype" in text',
        ("tests/test_mixed_precision.py::test_param_dtype_under_code_that_casts_to_weight_dtype_names_the_fix",)),
    "foreign_shard_reduced": Mutation(
        "shardtensor/_dispatch/reductions.py", "_valid",
        '    p._layout.check_live(p._local, "reduce")', "    pass",
        ("tests/test_misuse.py::test_reductions_of_a_shard_saved_by_another_rank_are_refused_like_its_gather",)),
    "layerwise_full_state_not_taken": Mutation(
        "shardtensor/_full_optim_state.py", "is_full_state",
        "    if not isinstance(param, ShardedParam) or not isinstance(param._layout, ShardLayout):",
        "    if not isinstance(param, ShardedParam) or type(param._layout) is not ShardLayout:",
        ("tests/test_full_optim_state.py::test_a_full_optimizer_state_resumes_a_layerwise_model_like_the_unsharded_run",)),
    "layerwise_owner_keeps_loaded_full_state_as_rows": Mutation(
        "shardtensor/_full_optim_state.py", "is_full_state",
        "    whole_on_one_rank = loading and", "    whole_on_one_rank = False and",
        ("tests/test_full_optim_state.py::test_a_full_optimizer_state_resumes_a_layerwise_model_like_the_unsharded_run",)),
    "backward_zeros_like_sharded": Mutation(
        "shardtensor/_dispatch/local.py", "_like",
        "    if type(args[0]) is ShardedParam and _in_a_backward_formula():", "    if False:",
        ("tests/test_backward_rank_scalars.py::test_per_rank_upstream_gradient_is_averaged",)),
    "recipe_source_gathered_unnamed": Mutation(
        "shardtensor/_dispatch/compute.py", "_acquire",
        "        base = p._gatherer.acquire(p) if p._gatherer is not None else gather_now(p._local, p._layout)",
        "        base = gather_now(p._local, p._layout)",
        ("tests/test_units.py::test_a_tensor_derived_from_an_expert_weight_kept_past_the_moe_layer",)),
    "pending_grad_read_allowed": Mutation(
        "shardtensor/_grad_edits.py", "refusal_of_use_of_pending",
        "    if pending is None or func.is_view", "    if True or func.is_view",
        ("tests/test_sync_habits.py::test_a_use_of_grad_between_no_sync_micro_batches_that_ddp_computes_on_its_sum_is_refused",)),
    "pending_grad_row_write_allowed": Mutation(
        "shardtensor/_grad_edits.py", "_writes_whole_shards",
        "        return False  # a write through a row view", "        pass  # a write through a row view",
        ("tests/test_sync_habits.py::test_a_use_of_grad_between_no_sync_micro_batches_that_ddp_computes_on_its_sum_is_refused",)),
    "expert_reads_run_on_the_full_tensor": Mutation(
        "shardtensor/_dispatch/recipes.py", "remember",
        "    if type(out) is not ShardedParam:", "    if True:",
        ("tests/test_mixed_precision.py::test_autocast_keeps_no_gathered_weight_from_forward_to_backward",)),
    "derived_expert_tensor_gathered_on_demand": Mutation(
        "shardtensor/_dispatch/compute.py", "__enter__",
        "                    base = full_base(p, self._acquire)", "                    base = None",
        ("tests/test_units.py::test_expert_loop_trains_like_the_unsharded_model",
         "tests/test_mixed_precision.py::test_autocast_keeps_no_gathered_weight_from_forward_to_backward")),
    "load_into_meta_shards_unnamed": Mutation(
        "shardtensor/_agreement.py", "agree_on_load",
        "        elif any(p._local.is_meta for p in params.values()):", "        elif False:",
        ("tests/test_composability.py::test_a_load_into_a_meta_model_names_materialize",)),
    "whole_tensors_saved_from_any_rank": Mutation(
        "shardtensor/checkpoint.py", "save_checkpoint",
        "    if _comm.rank(group) != 0:  # whole tensors", "    if False:  # whole tensors",
        ("tests/test_checkpoint.py::test_buffers_saved_are_rank_0s_on_every_rank",)),
    "generate_fix_only_where_generate_still_runs": Mutation(
        "shardtensor/_comm_divergence.py", "_raise_divergence",
        "            text = marker + text", "            pass",
        ("tests/test_generate.py::test_generate_with_different_lengths_per_rank_names_synced_gpus",)),
    "scale_log_reset_for_parameters_the_backward_skipped": Mutation(
        "shardtensor/_deferred_grads.py", "_remember_holders",
        "        for key in now:", "        for key in self._deferred:",
        ("tests/test_sync_habits.py::test_a_scale_survives_a_micro_batch_that_does_not_reach_the_parameter",)),
    "cpu_adam_moment_of_another_shape_loaded": Mutation(
        "optim/_state_shards.py", "local_rows",
        "            if refusal is None and not is_sharded(value) and shaped_for_another_parameter(param, value):",
        "            if False:",
        ("tests/test_full_optim_state.py::test_a_moment_of_another_shape_is_refused_before_anything_is_updated",)),
    "detached_copies_named_as_a_tie": Mutation(
        "shardtensor/_misuse.py", "check_not_moved",
        "                and not any(current is other for _, _, other in owners):  # p.detach().requires_grad_()",
        "                and False:",
        ("tests/test_reliability.py::test_functional_call_with_detached_copies_under_grad_names_functional_call",)),
    "row_write_back_onto_itself_refused": Mutation(
        "shardtensor/_dispatch/local.py", "_copy",
        "        return dst  # a copy onto itself: Python's write-back of ``w[i] += c``, whose add_ already landed",
        "        pass",
        ("tests/test_composability.py::test_writes_through_row_views_land_on_the_rows_owner",)),
    "frozen_set_left_out_of_the_unit_identity": Mutation(
        "shardtensor/reduce.py", "frozen_in_label",
        "    if not frozen:", "    if True:",
        ("tests/test_units.py::test_a_parameter_frozen_on_one_rank_only_is_named_on_every_rank",)),
    "held_parameter_read_shard_wise": Mutation(
        "shardtensor/_dispatch/recipes.py", "reads_held_expert_parameter",
        "    for x in operands:", "    for x in ():",
        ("tests/test_units.py::test_expert_loop_trains_like_the_unsharded_model",)),
    "dlpack_export_allowed": Mutation(
        "shardtensor/tensor.py", "__dlpack__",
        "        raise TypeError(self._host_copy_refusal(\"__dlpack__\"))",
        "        return super().__dlpack__(*args, **kwargs)",
        ("tests/test_errors_and_repr.py::test_dlpack_exports_are_refused_like_host_copies",)),
    "moment_of_another_shape_stepped_on": Mutation(
        "shardtensor/_full_optim_state.py", "shaped_for_another_parameter",
        "    return len(shape) == param.dim() and shape not in (param.shape, rows)",
        "    return False",
        ("tests/test_full_optim_state.py::test_a_moment_of_another_shape_is_refused_before_anything_is_updated",)),
    "full_optimizer_state_at_world_1_taken_for_rows": Mutation(
        "shardtensor/_full_optim_state.py", "is_full_state",
        "    if not isinstance(param, ShardedParam) or type(param._layout) is not ShardLayout:",
        "    if not isinstance(param, ShardedParam) or type(param._layout) is not ShardLayout or param._layout.world == 1:",
        ("tests/test_full_optim_state.py::test_an_unsharded_runs_optimizer_state_resumes_like_the_unsharded_run",)),
    "checkpoint_chunks_split_by_dim_0_whatever_the_layout": Mutation(
        "shardtensor/_dtensor_bridge.py", "_rows_held",
        "    offsets = torch.Size((layout.row_start,) + (0,) * (len(layout.shape) - 1))",
        "    offsets = torch.Size((min(layout.rank * -(-layout.shape[0] // layout.world), layout.shape[0]),) + (0,) * (len(layout.shape) - 1))",
        ("tests/test_layerwise.py::test_a_layerwise_checkpoint_loads_back_exactly",)),
    "grad_scale_not_applied_to_the_deferral": Mutation(
        "shardtensor/_grad_edits.py", "as_edited",
        "            kept.div_(factor) if divide else kept.mul_(factor)", "            pass",
        ("tests/test_sync_habits.py::test_edits_of_grad_between_no_sync_micro_batches_act_on_the_accumulated_gradient",)),
    "division_of_a_grad_taken_for_a_product": Mutation(
        "shardtensor/_dispatch/local.py", "_scale",
        "args[1], func in _DIVIDES)", "args[1], False)",
        ("tests/test_sync_habits.py::test_edits_of_grad_between_no_sync_micro_batches_act_on_the_accumulated_gradient",)),
    "frozen_kept_whole_sum_not_averaged": Mutation(
        "shardtensor/reduce.py", "_finish_replicated",
        "            buckets.setdefault((id(group), param.dtype, param.device), (group, []))[1].append((param, name))",
        "            buckets.setdefault((id(group), param.dtype, param.device), (group, []))[1].append((param, name)) if param.requires_grad else None",
        ("tests/test_sync_habits.py::test_a_kept_whole_parameter_frozen_after_no_sync_micro_batches_gets_the_mean_of_its_sum",)),
    "hooked_kept_whole_mean_without_its_local_sum": Mutation(
        "shardtensor/reduce.py", "replicated_grad_hook",
        "            local = param.grad if id(param) in self._local_sums else None",
        "            local = None",
        ("tests/test_sync_habits.py::test_speculative_cpu_adam_over_no_sync_micro_batches_keeps_kept_whole_replicas_identical",)),
    "kept_whole_no_sync_gradients_dropped": Mutation(
        "shardtensor/reduce.py", "replicated_grad_hook",
        "                    self._local_sums.add(id(param))\n                return grad",
        "                    self._local_sums.add(id(param))\n                return torch.zeros_like(grad)",
        ("tests/test_sync_habits.py::test_kept_whole_gradients_zeroed_by_hand_between_micro_batches_are_dropped_as_under_ddp",
         "tests/test_sync_habits.py::test_ddp_and_fsdp2_accumulation_names_work_on_a_sharded_model")),
    "kept_whole_grad_averaged_only_where_reached": Mutation(
        "shardtensor/reduce.py", "_average_replicated",
        "            if param.grad is not None and not failed:",
        "            if param.grad is not None and not failed and False:",
        ("tests/test_sync_habits.py::test_kept_whole_gradients_zeroed_by_hand_between_micro_batches_are_dropped_as_under_ddp",)),
    "compiled_gathers_by_the_functional_all_gather": Mutation(
        "shardtensor/_comm_traced.py", "traced_all_gather_rows",
        "    if local.device.type == \"cpu\" and \"gloo\" in str(dist.get_backend(group)):",
        "    if False:",
        ("tests/test_compile.py::test_ranks_diverging_inside_compiled_code_are_named",)),
    "averaged_model_refusal_without_its_recipe": Mutation(
        "shardtensor/_misuse.py", "__deepcopy__",
        "        if _frames.inside(\"__init__\", \"swa_utils\"):  # AveragedModel deep-copies the module it is given",
        "        if False:",
        ("tests/test_reliability.py::test_averaged_model_of_a_sharded_model_names_the_recipe_that_works",)),
    "zeros_stamped_on_the_wrapper_not_its_shard": Mutation(
        "shardtensor/_dispatch/local.py", "_whole_shard",
        "    return t._local if not t._views or t.shape.numel() == t._layout.shape.numel() else None",
        "    return t",
        ("tests/test_sync_habits.py::test_zeros_written_by_hand_through_grad_data_throw_the_deferred_gradients_away",)),
    "layer_norm_of_a_low_precision_input_decomposed": Mutation(
        "shardtensor/_dispatch/sequential.py", "_mixed_dtype",
        "    return any(p is not None and p.dtype != x.dtype for p in params)",
        "    return False",
        ("tests/test_mixed_precision.py::test_autocast_layer_norm_with_a_low_precision_input_equals_the_unsharded_model",)),
    "exit_does_not_wait_for_works_in_flight": Mutation(
        "shardtensor/_comm_work.py", "settle_before_exit",
        "        time.sleep(0.005)",
        "        break",
        ("tests/test_reliability.py::test_the_exit_waits_for_works_in_flight_and_keeps_past_it_those_that_never_complete",)),
    "issued_works_not_tracked_for_the_exit": Mutation(
        "shardtensor/_comm.py", "_issued",
        "    track_in_flight(timed)  # see [Note: gloo's worker threads at interpreter exit]",
        "    pass",
        ("tests/test_reliability.py::test_the_exit_waits_for_works_in_flight_and_keeps_past_it_those_that_never_complete",)),
    "root_unit_whatever_its_size": Mutation(
        "shardtensor/_unit_policy.py", "_leftover_fits",
        "    return 0 < leftover <= max(sum(p.numel() for p in m.parameters()) for m in block_units)",
        "    return True",
        ("tests/test_units.py::test_the_root_is_a_unit_only_where_what_the_blocks_leave_fits_in_one_block",)),
    "zeros_written_into_a_gradient_not_noted": Mutation(
        "shardtensor/_dispatch/local.py", "_zero",
        "        _grad_edits.note_overwritten([_whole_shard(t) for t in _written_list(args[0])])",
        "        pass",
        ("tests/test_sync_habits.py::test_zero_grad_throws_away_what_no_sync_micro_batches_accumulated",)),
    "moe_keyword_inputs_not_tied": Mutation(
        "shardtensor/_units.py", "_post_forward",
        "tie_if_another_rank_needs(unit, (*args, *kwargs.values()), output,",
        "tie_if_another_rank_needs(unit, args, output,",
        ("tests/test_units.py::test_a_rank_whose_tokens_reach_no_expert",)),
    "deferral_adds_onto_a_discarded_buffer": Mutation(
        "shardtensor/_deferred_grads.py", "_defer",
        "            kept = _grad_edits.as_edited(owner[0], kept, self.deferred_at(key))",
        "            pass",
        ("tests/test_sync_habits.py::test_zero_grad_between_no_sync_micro_batches_drops_only_the_earlier_ones",)),
    "finished_sends_kept_past_the_wait": Mutation(
        "shardtensor/_comm_rows.py", "wait",
        "        _IN_FLIGHT[:] = [w for w in _IN_FLIGHT if not w.is_completed()]  # (they held the buffers past the step)",
        "        pass",
        ("tests/test_units.py::test_no_send_of_a_finished_reduction_is_kept_past_the_backward",)),
    "wrapper_load_keys_unchecked": Mutation(
        "shardtensor/_agreement.py", "agree_on_load",
        "        if caller is not None and (caller is module or prefix):  # a wrapper's load: its keys too",
        "        if caller is module:",
        ("tests/test_load_keys.py::test_a_strict_load_through_a_wrapper_changes_nothing_on_any_rank",)),
    "load_post_hooks_ignored_by_the_key_check": Mutation(
        "shardtensor/_agreement.py", "torch_key_errors",
        "                any(h is not loaded for h in sub._load_state_dict_post_hooks.values()) or \\",
        "                False or \\",
        ("tests/test_load_keys.py::test_strict_loads_torch_takes_are_taken",)),
    "dropped_sends_not_kept_until_done": Mutation(
        "shardtensor/_comm_rows.py", "reduce_scatter_in_place",
        "    _IN_FLIGHT[:] = [w for w in _IN_FLIGHT if not w.is_completed()] + works  # see the note below",
        "    pass",
        ("tests/test_gather.py::test_a_failed_backward_leaves_no_half_reduced_gradients",)),
    "zero_grad_keeps_deferred_gradients": Mutation(
        "shardtensor/_grad_edits.py", "as_edited",
        "    if holder is None or getattr(holder, _OVERWRITTEN_AT, 0) > since:", "    if False:",
        ("tests/test_sync_habits.py::test_zero_grad_throws_away_what_no_sync_micro_batches_accumulated",)),
    "unit_output_without_gradient_never_tied": Mutation(
        "shardtensor/_units.py", "_post_forward",
        "            if unit.routes_by_data and torch.is_grad_enabled():", "            if False:",
        ("tests/test_units.py::test_a_rank_whose_tokens_reach_no_expert",)),
    "unit_output_tied_without_asking": Mutation(
        "shardtensor/_unit_autograd.py", "tie_if_another_rank_needs",
        "    if not any_rank(mine, group, f\"whether any rank needs the backward of unit {unit.name!r}\") or mine:",
        "    if mine:",
        ("tests/test_units.py::test_no_rank_reaching_any_expert_trains_like_the_unsharded_model",)),
    "dtype_view_computed": Mutation(
        "shardtensor/_dispatch/views.py", "_dtype_view",
        "    return self._derived(self._local.view(dtype), gatherer=self._gatherer)",
        "    return compute(func, args, kwargs)",
        ("tests/test_inference_mode.py::test_a_write_through_a_dtype_view_lands_in_the_shards",)),
    "complex_view_computed": Mutation(
        "shardtensor/_dispatch/views.py", "_complex_view",
        "    return _reshaped_base(self, func, func, args, kwargs)",
        "    return compute(func, args, kwargs)",
        ("tests/test_reinterpreting_views.py::test_writes_through_reinterpreting_and_row_keeping_views_equal_torchs",)),
    "column_write_refused": Mutation(
        "shardtensor/_dispatch/local.py", "_write_dim0_rows",
        "    if columns is not None:", "    if False:",
        ("tests/test_reinterpreting_views.py::test_writes_through_reinterpreting_and_row_keeping_views_equal_torchs",)),
    "ddp_and_fsdp2_sync_names_missing": Mutation(
        "shardtensor/_sync_switch.py", "attach_habits",
        "            module.__dict__[name] = fn", "            pass",
        ("tests/test_sync_habits.py::test_ddp_and_fsdp2_accumulation_names_work_on_a_sharded_model",)),
    "shards_made_inside_inference_mode": Mutation(
        "shardtensor/api.py", "_outside_inference_mode",
        "        with torch.inference_mode(False) if torch.is_inference_mode_enabled() else contextlib.nullcontext():",
        "        with contextlib.nullcontext():",
        ("tests/test_inference_mode.py::test_shard_module_inside_inference_mode_evaluates_like_the_unsharded_model",)),
    "unit_reduces_zeros_while_sync_is_off": Mutation(
        "shardtensor/_unit.py", "reduce",
        "        if not self.grad_sync.enabled and not self.grads and self.flat is None:", "        if False:",
        ("tests/test_units.py::test_micro_batches_under_gradient_sync_off_reduce_nothing",)),
    "composite_views_computed_whole": Mutation(
        "shardtensor/_dispatch/__init__.py", "dispatch_op",
        "        if func.is_view and rule is compute:", "        if False:",
        ("tests/test_inference_mode.py::test_writes_through_views_under_inference_mode_land_in_the_shards",)),
    "precision_output_dtype_ignored": Mutation(
        "shardtensor/api.py", "_step_begin_hook",
        '    output_dtype = getattr(precision, "output_dtype", None)', "    output_dtype = None",
        ("tests/test_mixed_precision.py::test_output_dtype_and_cast_forward_inputs_of_a_precision_policy_are_applied",)),
    "precision_cast_forward_inputs_ignored": Mutation(
        "shardtensor/api.py", "_step_begin_hook",
        'precision.param_dtype if getattr(precision, "cast_forward_inputs", True) else None',
        "precision.param_dtype",
        ("tests/test_mixed_precision.py::test_output_dtype_and_cast_forward_inputs_of_a_precision_policy_are_applied",)),
    "deferred_gradients_not_flushed_at_the_synced_end": Mutation(
        "shardtensor/reduce.py", "finish_pending",
        "        if self._deferred and self.enabled and torch._C._current_graph_task_id() != -1:",
        "        if False:",
        ("tests/test_units.py::test_a_layer_only_unsynced_micro_batches_use_beside_per_rank_gains_trains_like_the_unsharded_model",)),
    "save_pretrained_reads_shards": Mutation(
        "shardtensor/_torch_state_dict.py", "full_model_state_for_torch_helpers",
        "    elif any(isinstance(v, ShardedParam) for v in state_dict.values()) and inside(\"save_pretrained\", \"transformers\"):",
        "    elif False:",
        ("tests/test_save_pretrained.py::test_save_pretrained_without_the_full_state_dict_names_the_recipe",)),
    "strict_load_keys_left_to_torch": Mutation(
        "shardtensor/_agreement.py", "agree_on_load",
        "        if caller is not None and (caller is module or prefix):  # a wrapper's load: its keys too",
        "        if False:",
        ("tests/test_load_keys.py::test_a_strict_load_torch_would_refuse_changes_nothing_on_any_rank",)),
    "load_refusal_raised_on_its_rank_alone": Mutation(
        "shardtensor/_agreement.py", "_refuse_on_every_rank",
        "    if world > 1:", "    if False:",
        ("tests/test_load_keys.py::test_a_strict_load_torch_would_refuse_changes_nothing_on_any_rank",)),
    "non_strict_load_taken_for_strict": Mutation(
        "shardtensor/_agreement.py", "_strict_load_caller",
        '    if frame.f_locals.get("strict", True) and isinstance(caller, nn.Module) and isinstance(given, dict):',
        '    if isinstance(caller, nn.Module) and isinstance(given, dict):',
        ("tests/test_load_keys.py::test_a_non_strict_load_with_missing_keys_loads_the_rest_as_torch_does",)),
    "reduce_by_sends_drops_what_it_receives": Mutation(
        "shardtensor/_comm_rows.py", "wait",
        "            own.add_(received)", "            pass",
        ("tests/test_units.py::test_expert_loop_trains_like_the_unsharded_model",)),
    "reduce_by_sends_adds_before_the_wait": Mutation(
        "shardtensor/_comm_rows.py", "wait",
        "        self.work.wait(timeout=timeout)\n        for own, received in self.sums:\n            own.add_(received)",
        "        for own, received in self.sums:\n            own.add_(received)\n        self.work.wait(timeout=timeout)",
        ("tests/test_units.py::test_expert_loop_trains_like_the_unsharded_model",)),
    "generate_divergence_without_synced_gpus_fix": Mutation(
        "shardtensor/_comm_divergence.py", "_raise_divergence",
        '        + "".join(fix for _, _, marker, fix in _CALLERS if any(marker in t for t in texts))', '        + ""',
        ("tests/test_generate.py::test_generate_with_different_lengths_per_rank_names_synced_gpus",)),
    "parametrization_after_sharding_unnamed": Mutation(
        "shardtensor/_dispatch/refusals.py", "_refuse",
        "    if inside(\"register_parametrization\", \"parametrize.py\"):", "    if False:",
        ("tests/test_parametrizations.py::test_parametrizations_applied_after_shard_module_are_named_with_the_fix",)),
    "view_rules_inside_inference_mode": Mutation(
        "shardtensor/_dispatch/__init__.py", "dispatch_op",
        "_outside_inference_mode(rule) if func.is_view else rule", "rule",
        ("tests/test_inference_mode.py::test_views_of_sharded_parameters_under_inference_mode_equal_the_full_tensors_views",
         "tests/test_inference_mode.py::test_an_encoder_decoder_transformer_evaluates_under_inference_mode_like_the_unsharded_one")),
    "full_optimizer_state_kept_whole": Mutation(
        "shardtensor/_misuse_optim.py", "_keep_own_rows_of_full_state",
        "    for item in full:", "    for item in full[:0]:",
        ("tests/test_full_optim_state.py::test_an_unsharded_runs_optimizer_state_resumes_like_the_unsharded_run",)),
    "full_optimizer_state_digests_not_compared": Mutation(
        "shardtensor/_full_optim_state.py", "agree_on_full_state",
        "    names = differing(", "    names = [] and differing(",
        ("tests/test_full_optim_state.py::test_full_state_that_differs_between_ranks_or_beside_rows_is_refused_on_every_rank",)),
    "full_optimizer_state_beside_rows_taken": Mutation(
        "shardtensor/_full_optim_state.py", "agree_on_full_state",
        "    if some_rows:", "    if False:",
        ("tests/test_full_optim_state.py::test_full_state_that_differs_between_ranks_or_beside_rows_is_refused_on_every_rank",)),
    "cpu_adam_full_state_not_cut": Mutation(
        "optim/_state_shards.py", "local_rows",
        "    rows = {(id(s.param), s.key): own_rows(s.param, s.value) for s in full}", "    rows = {}",
        ("tests/test_full_optim_state.py::test_an_unsharded_runs_optimizer_state_resumes_like_the_unsharded_run",)),
    "nvme_unit_in_use_raises": Mutation(
        "offload/nvme.py", "make_room",
        "                        return True\n                    return False",
        "                        raise RuntimeError(\"no room\")\n                    return False",
        ("tests/test_offload.py::test_a_unit_that_does_not_fit_beside_units_in_use_goes_over_the_budget_with_a_"
         "warning",)),
    "torch_full_state_dict_gives_rows": Mutation(
        "shardtensor/_torch_state_dict.py", "_full_state_options",
        "    return info if getattr(info, \"full_state_dict\", False) else None", "    return None",
        ("tests/test_dcp_state_dict.py::test_torchs_full_state_dict_export_gives_full_tensors",)),
    "speculation_on_rewritten_gradients": Mutation(
        "optim/cpu_adam.py", "_paused",
        "        return self._rewritten_after_hooks or (", "        return False or (",
        ("tests/test_cpu_adam.py::test_speculative_steps_under_a_grad_scaler_equal_torchs_adamw",)),
    "indexed_write_rows_not_shifted": Mutation(
        "shardtensor/_dispatch/row_writes.py", "_own_entries",
        "    return mine, rows[mine] - layout.row_start", "    return mine, rows[mine]",
        ("tests/test_row_writes.py::test_indexed_writes_equal_the_same_writes_on_plain_tensors",)),
    "indexed_write_indices_unchecked": Mutation(
        "shardtensor/_dispatch/row_writes.py", "_agree",
        "    _agreement.refuse_differing(items, f\"{what} into {target._name!r}\")", "    pass",
        ("tests/test_row_writes.py::test_indexed_writes_with_indices_that_differ_between_ranks_are_refused_on_every_"
         "rank",)),
    "order_kept_after_caught_divergence": Mutation(
        "shardtensor/gather.py", "_begin_step",
        "        if self._divergences_seen != divergences_named():",
        "        if False:",
        ("tests/test_divergence.py::test_a_loss_that_drops_a_heads_output_on_one_rank_is_named_with_the_fix_that_"
         "works",)),
    "other_ranks_refusal_type_lost": Mutation(
        "shardtensor/_agreement.py", "differing",
        "    flag = 2 if isinstance(refusal, RuntimeError) else int(bool(refusal))",
        "    flag = int(bool(refusal))",
        ("tests/test_misuse.py::test_a_load_torch_refuses_raises_on_every_rank_before_anything_is_copied",)),
    "later_replicated_grads_averaged_at_once": Mutation(
        "shardtensor/reduce.py", "replicated_grad_hook",
        "            if param is not None and not _read_by_user_hooks(param):\n"
        "                if param.grad is None and id(param) not in self._replicated_later:",
        "            if param is not None and param.grad is None and not _read_by_user_hooks(param):\n"
        "                if True:",
        ("tests/test_units.py::test_replicated_parameters_picked_per_rank_in_later_micro_batches_train_like_the_"
         "unsharded_model",)),
    "strict_false_loads_nothing": Mutation(
        "shardtensor/checkpoint_match.py", "leave_out_what_was_never_saved",
        "        if lacking and len(lacking) == len(state[_MODEL]):  # nothing would load: another model, or a prefix",
        "        if False:",
        ("tests/test_checkpoint.py::test_checkpoints_of_another_model_or_optimizer_kind_are_still_named",)),
    "unnamed_step_divergence_realigned": Mutation(
        "shardtensor/_comm_divergence.py", "take_step_record",
        "    if not all(named for *_, named in records):", "    if False:",
        ("tests/test_divergence.py::test_a_step_on_some_ranks_only_before_another_shard_module_is_named_there",)),
    "failed_backward_gradients_reduced": Mutation(
        "shardtensor/reduce.py", "_finish_replicated",
        "        if torch._C._current_graph_task_id() == -1:  # a failed backward's, finished at the next forward: its",
        "        if False:",
        ("tests/test_units.py::test_a_failed_backward_leaves_no_replicated_gradient_behind",)),
    "unpickled_state_keeps_lost_group": Mutation(
        "shardtensor/_misuse_optim.py", "_refuse_state_of_another_rank",
        "        _keep_own_rows_of_full_state(optimizer, full)\n        _rebind_to_parameter_groups(optimizer)",
        "        _keep_own_rows_of_full_state(optimizer, full)",
        ("tests/test_misuse.py::test_a_per_rank_optimizer_file_of_a_model_on_a_subgroup_resumes_exactly",)),
    "muon_foreign_state_loaded": Mutation(
        "optim/muon.py", "load_state_dict",
        "        if owner is not None and (owner.get(\"rank\"), owner.get(\"world\"), owner.get(\"params\")) != (",
        "        if False and (owner.get(\"rank\"), owner.get(\"world\"), owner.get(\"params\")) != (",
        ("tests/test_layerwise.py::test_muon_state_of_another_rank_is_refused_on_every_rank",)),
    "no_grad_functional_call_refused": Mutation(
        "shardtensor/_misuse.py", "check_not_moved",
        "            continue  # no gradient to average; a swap that stays is named at the next forward with gradients",
        "            pass",
        ("tests/test_reliability.py::test_functional_call_with_other_weights_under_no_grad_evaluates_them",)),
    "outside_parameters_unwarned": Mutation(
        "shardtensor/_misuse_optim.py", "_warn_of_parameters_outside",
        "    if outside:", "    if False:",
        ("tests/test_misuse.py::test_trainable_parameters_outside_the_sharded_module_are_warned_of_at_the_first_step",)),
    "assign_load_accepted": Mutation(
        "shardtensor/_agreement.py", "agree_on_load",
        '        if args and args[0].get("assign_to_params_buffers") and params:', "        if False:",
        ("tests/test_reliability.py::test_module_converted_after_sharding_fails_at_the_next_forward",)),
    "step_records_not_realigned": Mutation(
        "shardtensor/_misuse.py", "check_same_model_on_every_rank",
        "        _comm._div.take_step_record(group, [other[4] for other in everyone])", "        pass",
        ("tests/test_divergence.py::test_a_scheduler_stepped_on_rank_0_only_is_named_at_the_next_gather",)),
    "full_state_dict_verdicts_not_agreed": Mutation(
        "shardtensor/full_state.py", "load_full_state_dict",
        "    if _agreement.any_rank(bool(error), group, \"load_full_state_dict: the ranks' verdicts\") and not error:",
        "    if False:",
        ("tests/test_reliability.py::test_a_full_state_dict_bad_on_one_rank_is_refused_on_every_rank",)),
    "expert_dict_not_a_unit": Mutation(
        "shardtensor/_unit_policy.py", "_data_dependent",
        '    return own or any(isinstance(child, _EXPERT_LISTS) and "expert" in name.lower()',
        '    return own or any(isinstance(child, _CONTAINERS) and "expert" in name.lower()',
        ("tests/test_units.py::test_expert_loop_trains_like_the_unsharded_model",)),
    "swap_inside_forward_not_rehooked": Mutation(
        "shardtensor/api.py", "_step_begin_hook",
        "            _misuse.rehook_swapped(owners, impls)", "            pass",
        ("tests/test_reliability.py::test_a_conversion_that_changes_nothing_keeps_training_right",)),
    "buffers_kept_per_rank": Mutation(
        "shardtensor/_misuse.py", "check_same_model_on_every_rank",
        '    named = list(module.named_parameters()) + [(f"buffer {n}", b) for n, b in module.named_buffers()]',
        "    named = list(module.named_parameters())",
        ("tests/test_reliability.py::test_ranks_with_different_weights_all_take_rank_0s_at_shard_module",)),
    "unsaved_optimizer_state_required": Mutation(
        "shardtensor/checkpoint_match.py", "leave_out_what_was_never_saved",
        "        if f\"{_OPTIM}.state.{fqn}\" not in with_state:  # (state of another optimizer's kind is still named "
        "below)", "        if False:",
        ("tests/test_checkpoint.py::"
         "test_a_parameter_without_saved_optimizer_state_starts_fresh_and_strict_false_keeps_new_tensors",)),
    "cpu_adam_state_given_as_plain_rows": Mutation(
        "optim/_state_shards.py", "as_shards",
        "    if not is_sharded(param):", "    if True:",
        ("tests/test_checkpoint_cpu_adam.py::"
         "test_cpu_adam_state_through_torchs_own_dcp_helpers_and_per_rank_files_keeps_each_ranks_rows",)),
    "replicated_grads_in_hook_order": Mutation(
        "shardtensor/reduce.py", "_finish_replicated",
        "        for param, group, name in self._replicated_params.values():",
        "        for param, group, name in [(p, g, '') for p, g in pending]:",
        ("tests/test_units.py::test_replicated_parameters_reached_differently_per_rank_train_like_the_unsharded_model",)),
    "compiled_meta_model_unchecked": Mutation(
        "shardtensor/api.py", "_step_begin_hook",
        "            _misuse.refuse_meta_tensors(root)", "            pass",
        ("tests/test_compile.py::test_a_compiled_meta_model_without_materialize_names_the_fix",)),
    "reshape_view_write_refused": Mutation(
        "shardtensor/_dispatch/local.py", "_whole_base_reshape",
        "    return (offset == 0 and shape.numel() == view._layout.shape.numel()",
        "    return (offset == 0 and shape == view._layout.shape",
        ("tests/test_composability.py::test_inits_after_sharding_equal_the_unsharded_init",)),
    "row_write_ignores_later_views": Mutation(
        "shardtensor/_dispatch/local.py", "_write_dim0_rows",
        "            target = later.apply(target)", "            pass",
        ("tests/test_composability.py::test_inits_after_sharding_equal_the_unsharded_init",)),
    "loaded_state_verdict_not_agreed": Mutation(
        "shardtensor/_misuse_optim.py", "_refuse_state_of_another_rank",
        "            agree_on_full_state(f\"{type(optimizer).__name__}.step()\", full, group, others_refuse=refusal is "
        "not None)", "            pass",
        ("tests/test_misuse.py::test_optimizer_state_of_another_rank_or_an_unsharded_run_is_refused_at_the_step",)),
    "torch_refused_load_copies_the_rest": Mutation(
        "shardtensor/_agreement.py", "torch_load_errors",
        "            elif tuple(value.shape) != tuple(tensor.shape) and not (tensor.dim() == 0 and tuple(value.shape) == (1,)):",
        "            elif False:",
        ("tests/test_misuse.py::test_a_load_torch_refuses_raises_on_every_rank_before_anything_is_copied",)),
    "one_row_plain_state_of_stock_optimizer_taken": Mutation(
        "shardtensor/_full_optim_state.py", "is_full_state",
        "param._layout.local_shape() or not kept_local_alike)", "param._layout.local_shape() or False)",
        ("tests/test_misuse.py::test_optimizer_state_of_another_rank_or_an_unsharded_run_is_refused_at_the_step",)),
    "plain_grad_met_mid_step": Mutation(
        "shardtensor/_misuse_optim.py", "_check_models_before_step",
        "    unaveraged = next((p for p in sharded if type(p.grad) is torch.Tensor), None)", "    unaveraged = None",
        ("tests/test_compile.py::test_a_compiled_model_with_a_parameter_replaced_after_sharding_is_named_at_the_step_before_any_update",
         "tests/test_misuse.py::test_a_step_on_a_gradient_that_was_never_averaged_says_why")),
    "compiled_steps_unchecked": Mutation(
        "shardtensor/_misuse_optim.py", "_step_pre_hook",
        "    _check_models_before_step(optimizer)", "    pass",
        ("tests/test_compile.py::test_a_compiled_model_with_a_parameter_replaced_after_sharding_is_named_at_the_step_before_any_update",)),
    "offload_write_error_on_one_rank": Mutation(
        "offload/nvme.py", "end_step",
        '        if not any_rank(mine is not None, group, "NVMeOffload: did any rank\'s writes fail"):',
        "        if mine is not None:\n            raise mine\n        if True:",
        ("tests/test_offload.py::test_nvme_full_disk_on_one_rank_is_named_on_every_rank_and_training_goes_on",)),
    "shared_reducer_accepted": Mutation(
        "shardtensor/_misuse.py", "refuse_shared_reducer",
        "    if owner is not None and owner() is not module:", "    if False:",
        ("tests/test_compressed_reducer.py::test_one_reducer_with_error_feedback_for_two_models_is_refused_on_every_rank",)),
    "held_full_never_stale": Mutation(
        "shardtensor/gather.py", "acquire",
        "            return held.full if held.version == param._local._version else held.unit.regather(param)",
        "            return held.full",
        ("tests/test_units.py::test_a_write_into_a_gathered_parameter_during_forward_is_seen_by_the_ops_after_it",)),
    "nonfinite_group_folds_into_error": Mutation(
        "ops/_int4_ref.py", "quantize_rows_ref",
        "        error[:, :padded] = torch.where(kept, e, beta32 * e + omb32 * (h - d))",
        "        error[:, :padded] = beta32 * e + omb32 * (h - d)",
        ("tests/test_int4_ops.py::test_a_non_finite_group_is_sent_as_nan_and_keeps_its_error_feedback",)),
    "foreach_reduction_not_all_reduced": Mutation(
        "shardtensor/_dispatch/reductions.py", "_foreach_reduction",
        "    _reduce_partials(partials, [t._layout.group for _, t in sharded], op_of(args, kwargs))", "    pass",
        ("tests/test_op_parity_world2.py::test_foreach_reductions_give_the_whole_tensors_value_on_every_rank",)),
    "foreach_plain_write_unversioned": Mutation(
        "shardtensor/_dispatch/local.py", "_foreach_local",
        "    _mark_written(written, plain)", "    _mark_written(written)",
        ("tests/test_cpu_adam.py::test_a_write_through_a_sharded_tensor_bumps_its_local_version",
         "tests/test_cpu_adam.py::test_speculative_steps_see_a_clip_grad_norm_done_by_hand")),
    "one_row_shard_taken_for_full_state": Mutation(
        "shardtensor/_full_optim_state.py", "is_full_state",
        "(value.shape != param._layout.local_shape() or", "(True or",
        ("tests/test_cpu_adam.py::test_speculative_steps_see_a_clip_grad_norm_done_by_hand",)),
    "unreduced_grad_not_explained": Mutation(
        "shardtensor/_dispatch/refusals.py", "_refuse",
        "    unreduced = [p for p in written if p.is_leaf and type(p.grad) is torch.Tensor]", "    unreduced = []",
        ("tests/test_misuse.py::test_a_step_on_a_gradient_that_was_never_averaged_says_why",)),
    "foreign_gather_refused_alone": Mutation(
        "shardtensor/_layout.py", "gather",
        '''                _comm._check("refused gather", local, self.group, f"gather refused: rank {self.rank}'s saved shard")''',
        "                pass",
        ("tests/test_misuse.py::test_state_dict_saved_on_rank0_into_a_plain_model_is_named_on_every_rank_at_once",)),
    "reloaded_state_known_by_id": Mutation(
        "shardtensor/_misuse_optim.py", "_refuse_state_of_another_rank",
        "        optimizer.register_load_state_dict_post_hook(_forget_checked_state)", "        pass",
        ("tests/test_misuse.py::test_every_load_state_dict_is_checked_at_the_next_step_even_where_the_new_state_reuses_an_id",)),
    "unverified_files_not_listed": Mutation(
        "shardtensor/checkpoint.py", "load_checkpoint",
        "            else read_metadata_unverified(directory, files_present=True)",
        "            else read_metadata_unverified(directory, files_present=False)",
        ("tests/test_dcp_state_dict.py::test_an_unverified_load_of_a_checkpoint_missing_a_file_changes_nothing",)),
    "save_ids_not_compared": Mutation(
        "shardtensor/checkpoint_files.py", "load_shards",
        "    if not errors and len({i for _, i in verdicts}) > 1:", "    if False:",
        ("tests/test_reliability.py::test_shard_files_of_two_saves_are_refused_on_every_rank",)),
    "file_verdicts_not_agreed_first": Mutation(
        "shardtensor/checkpoint.py", "load_checkpoint",
        '''    _raise_if_any_failed(error, group, "load_checkpoint (exchanging the files' verdicts)")''', "    pass",
        ("tests/test_checkpoint.py::test_damaged_dcp_checkpoint_is_named_on_every_rank_and_changes_nothing",)),
    "param_group_members_unchecked": Mutation(
        "shardtensor/checkpoint_match.py", "check_param_groups",
        "        if len(sources) > 1 or clash:", "        if False:",
        ("tests/test_checkpoint.py::test_param_groups_that_hold_other_parameters_than_when_saved_are_refused",)),
    "unreadable_save_not_shared": Mutation(
        "shardtensor/checkpoint.py", "save_checkpoint",
        "    errors = [part for part in parts if isinstance(part, str)]", "    errors = []",
        ("tests/test_checkpoint.py::test_a_checkpoint_directory_some_rank_cannot_read_back_is_named_on_every_rank",)),
    "foreign_shard_refusal_not_shared": Mutation(
        "shardtensor/_agreement.py", "differing",
        "    if bool(everyone[:, 0].any()):", "    if False:",
        ("tests/test_misuse.py::test_state_dict_saved_on_rank0_is_refused_on_every_rank_before_anything_is_copied",)),
    "step_checks_only_at_the_root_forward": Mutation(
        "shardtensor/gather.py", "_note_gather",
        "        if self._unchecked and self.step_checks is not None:", "        if False:",
        ("tests/test_reliability.py::test_parameters_added_or_parametrized_after_sharding_fail_at_the_next_forward",
         "tests/test_misuse.py::test_a_layer_unfrozen_after_shard_module_trains_like_the_unsharded_one")),
    "adafactor_not_refused": Mutation(
        "shardtensor/_misuse_optim.py", "_refuse_optimizer_built_first",
        '''    if isinstance(optimizer, torch.optim.Adafactor) or type(optimizer).__name__ == "Adafactor":  # (transformers')''',
        "    if False:",
        ("tests/test_misuse.py::test_adafactor_on_sharded_matrices_is_refused_before_any_update",)),
    "given_up_work_released": Mutation(
        "shardtensor/_comm_work.py", "keep_past_exit",
        "    ctypes.pythonapi.Py_IncRef(ctypes.py_object(work))", "    pass",
        ("tests/test_reliability.py::test_a_collective_given_up_on_is_kept_alive_until_the_process_exits",)),
    "settings_digest_reads_addresses": Mutation(
        "shardtensor/_step_record.py", "_is_setting",
        "return all(isinstance(v, _NUMBERS) for v in value)", "return True",
        ("tests/test_divergence.py::test_a_scheduler_stepped_on_rank_0_only_is_named_at_the_next_gather[every rank]",)),
    "submodule_loads_unchecked": Mutation(
        "shardtensor/api.py", "_hook_loads",
        "        if module_name in below:", '        if module_name == "":',
        ("tests/test_misuse.py::test_full_tensors_that_differ_between_ranks_are_refused_or_taken_from_rank_0",
         "tests/test_divergence.py::test_code_under_if_rank_0_that_reads_sharded_tensors_is_named_on_every_rank"
         "[load a block's state dict]")),
    "save_checkpoint_unchecked": Mutation(
        "shardtensor/checkpoint.py", "save_checkpoint",
        '    _same_call_on_every_rank(path, group, "save_checkpoint", optimizer)', '    pass',
        ("tests/test_checkpoint.py::test_save_checkpoint_on_rank_0_only_is_named_at_the_collective_timeout",)),
    "step_settings_not_compared": Mutation(
        "shardtensor/_misuse_optim.py", "_step_post_hook",
        "note_optimizer_step(sharded, settings_digest(optimizer, groups))", "note_optimizer_step(sharded)",
        ("tests/test_divergence.py::test_a_scheduler_stepped_on_rank_0_only_is_named_at_the_next_gather[rank 0 only]",)),
    "differing_copy_accepted": Mutation(
        "shardtensor/_agreement.py", "refuse_differing",
        "        if names:\n", "        if False:\n",
        ("tests/test_misuse.py::test_full_tensors_that_differ_between_ranks_are_refused_or_taken_from_rank_0",)),
    "own_random_draw_kept": Mutation(
        "shardtensor/_agreement.py", "take_rank0_draw",
        "take_rank0_values([(param._name, full)]", "(lambda *a, **k: None)([(param._name, full)]",
        ("tests/test_misuse.py::test_full_tensors_that_differ_between_ranks_are_refused_or_taken_from_rank_0",)),
    "user_collective_on_a_copy": Mutation(
        "shardtensor/_dispatch/refusals.py", "_user_collective",
        'names = ", ".join(', 'return __import__("shardtensor._dispatch.compute", fromlist=["c"]).compute(func, '
        'args, kwargs); names = ", ".join(',
        ("tests/test_misuse.py::test_collectives_of_a_ddp_script_on_sharded_tensors_are_refused_on_every_rank",)),
    "zero_redundancy_accepted": Mutation(
        "shardtensor/_misuse_optim.py", "_refuse_zero_redundancy",
        "if not isinstance(optimizer, ZeroRedundancyOptimizer):", "if True:",
        ("tests/test_misuse.py::test_collectives_of_a_ddp_script_on_sharded_tensors_are_refused_on_every_rank",)),
    "muon_steps_not_counted": Mutation(
        "optim/muon.py", "step",
        "shardtensor.note_optimizer_step(self._params)", "pass",
        ("tests/test_divergence.py::test_a_muon_step_on_some_ranks_only_is_named_at_the_next_gather",)),
    "first_exchange_on_the_group": Mutation(
        "shardtensor/_comm_divergence.py", "open",
        'if store is None or dist.get_backend(pg) == "fake":', "if True:",
        ("tests/test_divergence.py::test_a_users_collective_on_one_rank_meets_no_library_collective",)),
    "ddp_wrapping_accepted": Mutation(
        "shardtensor/_misuse.py", "__iter__",
        "raise TypeError(_DDP_REFUSAL)", "return iter(())",
        ("tests/test_reliability.py::test_ddp_over_a_sharded_model_is_refused_on_every_rank[direct]",)),
    "ddp_parent_accepted": Mutation(
        "shardtensor/_misuse.py", "refuse_inside_ddp",
        "if DistributedDataParallel._get_active_ddp_module() is not None:", "if False:",
        ("tests/test_reliability.py::test_ddp_over_a_sharded_model_is_refused_on_every_rank[parent]",)),
    "per_rank_weights_kept": Mutation(
        "shardtensor/_misuse.py", "check_same_model_on_every_rank",
        "take_rank0_values([named[k] for k in differ], group)", "pass",
        ("tests/test_reliability.py::test_ranks_with_different_weights_all_take_rank_0s_at_shard_module",)),
    "per_rank_generators_kept": Mutation(
        "shardtensor/materialize.py", "_draw_from_rank0_generator",
        "if all(state == everyone[0] for state in everyone):", "if True:",
        ("tests/test_misuse.py::test_materialize_with_generators_seeded_per_rank_draws_rank_0s_init",)),
    "swapped_parameter_not_rehooked": Mutation(
        "shardtensor/_misuse.py", "check_not_moved",
        "_rehook_after_swap(param, impls)", "pass",
        ("tests/test_reliability.py::test_a_conversion_that_changes_nothing_keeps_training_right",)),
    "user_hooks_read_pending_gradient": Mutation(
        "shardtensor/reduce.py", "_read_by_user_hooks",
        "or len(param._backward_hooks or ()) > 1", "or False",
        ("tests/test_grad_landing.py::test_a_clamping_hook_alone_sees_the_reduced_gradient",)),
    "optimizer_steps_not_counted": Mutation(
        "shardtensor/_misuse_optim.py", "_step_post_hook",
        "note_optimizer_step(sharded, settings_digest(optimizer, groups))", "pass",
        ("tests/test_divergence.py::test_an_optimizer_step_on_some_ranks_only_is_named_at_the_next_gather",)),
    "data_assignment_ignored": Mutation(
        "shardtensor/tensor.py", "data",
        "self._layout.copy_own_rows(self._local, value.detach())", "pass",
        ("tests/test_misuse.py::test_data_assignment_writes_this_ranks_rows_or_is_refused",)),
    "autograd_grad_reduced": Mutation(
        "shardtensor/_grad_landing.py", "captured_by_autograd_grad",
        "return _captured[1]", "return False",
        ("tests/test_grad_landing.py::test_autograd_grad_returns_this_ranks_gradient_and_leaves_grad_alone",)),
    "unfrozen_parameters_never_hooked": Mutation(
        "shardtensor/reduce.py", "attach_unfrozen",
        "for param, key, group, handles in", "for param, key, group, handles in [] and",
        ("tests/test_misuse.py::test_a_layer_unfrozen_after_shard_module_trains_like_the_unsharded_one",)),
    "amp_found_inf_not_reduced": Mutation(
        "shardtensor/_dispatch/reductions.py", "_amp_unscale",
        "if groups:", "if False:",
        ("tests/test_composability.py::test_grad_scaler_skips_a_step_on_every_rank_together",)),
    "failed_backward_state_kept": Mutation(
        "shardtensor/_units.py", "_drop_failed_backward",
        "if not self._tasks or torch._C._current_graph_task_id() != -1:", "if True:",
        ("tests/test_gather.py::test_a_failed_backward_leaves_no_half_reduced_gradients",)),
    "lazy_placeholder_left_after_a_failed_backward": Mutation(
        "shardtensor/_grad_landing.py", "forget_placeholders",
        "grad.rehome_(torch.zeros_like(zeros, memory_format=torch.contiguous_format))", "pass",
        ("tests/test_gather.py::test_a_failed_backward_leaves_no_half_reduced_gradients",)),
    "landed_rows_of_a_full_gradient_not_copied": Mutation(
        "shardtensor/_unit_buffers.py", "_mean_shards",
        "out.append(torch.div(sums[i], world).view(lay.local_shape()))",
        "out.append(sums[i].div_(world).view(lay.local_shape()))",
        ("tests/test_unit_direct.py::test_in_place_unit_collectives_train_like_the_flat_buffer_and_the_unsharded_model",)),
    "same_placement": Mutation(
        "shardtensor/_dispatch/_common.py", "_same_placement",
        "return a._layout == b._layout and a._views == b._views", "return True",
        ("tests/test_view_combinations.py",)),
    "reduction_not_all_reduced": Mutation(
        "shardtensor/_dispatch/reductions.py", "_simple_reduction",
        "result = _reduce_partials(partial, [self._layout.group], op)[0]", "result = partial[0]",
        ("tests/test_errors_and_repr.py::test_every_op_on_two_ranks_with_padding",)),
    "int4_sign": Mutation(
        "ops/_int4_ref.py", "dequantize_reduce_rows_ref",
        "acc += qg[w] * s[w]", "acc += qg[w].abs() * s[w]",
        ("tests/test_int4_ops.py::test_dequantize_reduce_equals_sum_of_dequantizations",)),
    "repr_base_shape": Mutation(
        "shardtensor/tensor.py", "__repr__",
        "f\"ShardedParam(shape={tuple(self.shape)}", "f\"ShardedParam(shape={tuple(self._layout.shape)}",
        ("tests/test_errors_and_repr.py::test_repr_and_str_need_no_process_group",)),
    "fuzz_family_dropped": Mutation(
        "tests/test_fuzz_ops.py", "(strategy)",
        "", "",  # special: see apply(); the strategy stops drawing the "combine" family
        ("tests/test_fuzz_ops.py::test_every_family_is_drawn",)),
    "swap_unbounded_inflight": Mutation(
        "offload/swap.py", "_throttle",
        "if not over or not self.wait_oldest():", "if True:",
        ("tests/test_offload.py::test_swap_stress_no_deadlock_no_stale_data_and_named_faults",)),
    "gather_bookkeeping_empty": Mutation(
        "shardtensor/gather.py", "_start_gather",
        "self._alive_refs.append(weakref.ref(full))", "pass",
        ("tests/test_gather.py::test_gather_bookkeeping_does_not_grow_with_steps",)),
    "pool_ignores_dead_ranks": Mutation(
        "tests/rank_pool.py", "run",
        "self.context.join(timeout=0)  # raises at once if a rank has died", "pass",
        ("tests/test_launch.py::test_rank_pool_reports_a_killed_rank",)),
    "launcher_ignores_failures": Mutation(
        "shardtensor/launch.py", "spawn_ranks",
        "while not context.join(timeout=0.5):", "while not all(not p.is_alive() for p in context.processes):",
        ("tests/test_launch.py::test_a_rank_that_raises_ends_the_launch_with_its_traceback",
         "tests/test_launch.py::test_a_killed_rank_ends_the_launch_naming_the_rank_and_signal")),
    "adamw_kernel_steps_nonfinite": Mutation(
        "ops/_adamw_cpu.py", "step_piece",
        "_mm256_storeu_ps(m + i, _mm256_blendv_ps(m0, m1, ok));", "_mm256_storeu_ps(m + i, m1);",
        ("tests/test_adamw_kernel.py::test_checked_step_equals_torch_fused_where_finite_and_leaves_inf_nan_elements",)),
    "adamw_kernel_tail_contracts_like_the_body": Mutation(
        "ops/_adamw_cpu.py", "step_piece",
        "float v1 = fmaf(v0, h->b2, (h->c * gi) * gi);", "float v1 = fmaf(h->c * gi, gi, v0 * h->b2);",
        ("tests/test_adamw_kernel.py::test_checked_step_equals_torch_fused_where_finite_and_leaves_inf_nan_elements",)),
    "checked_rollback_touches_nonfinite": Mutation(
        "optim/_adam_math.py", "adamw_rollback_",
        "            tensor[where] = kept", "            pass",
        ("tests/test_adamw_kernel.py::test_skipped_step_through_the_kernel_equals_the_skip_without_it",)),
    "speculative_checked_keeps_inf_step": Mutation(
        "optim/_speculation.py", "_speculate_checked",
        "                adamw_rollback_(*args, hp, nonfinite_untouched=True)\n", "                pass\n",
        ("tests/test_adamw_kernel.py::test_speculative_checked_steps_skip_an_inf_step_like_torch_skipping_it",)),
    "rollback_keeps_m_beside_zero_v": Mutation(
        "optim/_adam_math.py", "adamw_rollback_",
        "                    mi.masked_fill_((vi == 0.0) & (mi.abs() <= ni), 0.0)", "                    pass",
        ("tests/test_cpu_adam.py::test_rollback_gives_back_exact_zero_moments_where_no_earlier_gradient_reached",)),
    "shard_writes_unversioned": Mutation(
        "shardtensor/_dispatch/_common.py", "_mark_written",
        "    if locals_:\n", "    if False:\n",
        ("tests/test_cpu_adam.py::test_speculative_steps_see_a_clip_grad_norm_done_by_hand",
         "tests/test_cpu_adam.py::test_a_write_through_a_sharded_tensor_bumps_its_local_version")),
    "hooks_run_on_placeholder": Mutation(
        "shardtensor/_grad_landing.py", "zero_placeholder",
        "        _swallow[id(param)] = guarded\n", "        pass\n",
        ("tests/test_grad_landing.py", "tests/test_cpu_adam.py::test_speculative_steps_of_unit_parameters_stand")),
    "views_move_to_the_shards_device": Mutation(
        "shardtensor/tensor.py", "_derived",
        "device = self.device if local.device == self._local.device else local.device", "device = local.device",
        ("tests/test_offload.py::test_tensors_derived_from_an_offloaded_parameter_stay_on_the_parameters_device",)),
    "control_group_on_fake_pg": Mutation(
        "shardtensor/_comm_divergence.py", "build_control_group",
        'if dist.get_backend(pg) == "fake":', "if False:",
        ("tests/test_fake_world.py",)),
    "row_write_ignores_row_start": Mutation(
        "shardtensor/_dispatch/local.py", "_write_dim0_rows",
        "rows = view._local[lo - start: hi - start]", "rows = view._local[lo: hi]",
        ("tests/test_composability.py::test_writes_through_row_views_land_on_the_rows_owner",)),
    "tensor_hooks_run_on_placeholder": Mutation(
        "shardtensor/_grad_landing.py", "__call__",
        "        if ref is not None and ref() is grad:\n            return None\n", "",
        ("tests/test_grad_landing.py::test_gradient_hooks_see_the_reduced_gradient",)),
    "end_of_backward_that_raised_counts_as_ended": Mutation(
        "shardtensor/_units.py", "_end_of_backward",
        "            self._tasks.add(task)\n", "",
        ("tests/test_gather.py::test_a_gradient_hook_that_raised_leaves_no_gradient_for_the_next_step",)),
    "gatherer_waits_for_a_failed_backwards_end": Mutation(
        "shardtensor/gather.py", "_note_gather",
        "            self._backward_ended()\n", "            pass\n",
        ("tests/test_gather.py::test_a_container_root_replays_its_order_with_bounded_bookkeeping",)),
    "hook_wrapper_compiled_per_hook": Mutation(
        "shardtensor/_units.py", "_finish_backward",
        "_compile.compile_callees_only(_misuse.PickleRefusingHook.__call__)", "",
        ("tests/test_compile_modes.py::test_compiled_training_with_no_grad_and_inference_mode_evaluations_equals_eager",)),
    "parameter_read_compiled_alone": Mutation(
        "shardtensor/_traced_grads.py", "_reader",
        '_compile.compile_callees_only(_reader("").fget)', "",
        ("tests/test_compile_modes.py::test_a_graph_break_inside_a_block_trains_as_the_unsharded_model",)),
    "channel_writes_inference_tensors_outside_inference_mode": Mutation(
        "shardtensor/_comm_shm.py", "_copy_out",
        "            with torch.inference_mode():", "            if True:",
        ("tests/test_gather.py::test_training_goes_on_after_an_inference_mode_forward_that_stopped_early",)),
    "deferred_unit_gradients_reduced_apart": Mutation(
        "shardtensor/_unit.py", "reduce",
        "            self._take_deferred()\n", "            pass\n",
        ("tests/test_units.py::test_experts_reached_in_a_deferred_micro_batch_only_are_reduced_with_their_unit",)),
    "reduction_unlabelled": Mutation(
        "shardtensor/_dispatch/reductions.py", "_reduce_partials",
        "            _all_reduce_keep_nan(partials, group, op, label)", "            _all_reduce_keep_nan(partials, group, op, '')",
        ("tests/test_divergence.py::test_a_read_on_rank_0_only_is_not_paired_with_another_read_of_one_size",)),
    "derived_gather_labelled_as_its_parameter": Mutation(
        "shardtensor/_full.py", "gather_label",
        "    if param._gatherer is not None:", "    if True:",
        ("tests/test_divergence.py::test_a_read_on_rank_0_only_is_not_paired_with_another_read_of_one_size",)),
    "hooks_inside_user_dispatch_modes": Mutation(
        "shardtensor/_hooks.py", "__call__",
        "        with outside_user_dispatch_modes():", "        with contextlib.nullcontext():",
        ("tests/test_composability.py::test_selective_activation_checkpointing_equals_unsharded",)),
    "copy_source_not_broadcast": Mutation(
        "shardtensor/_dispatch/_common.py", "_broadcast_source",
        "        if torch.broadcast_shapes(src.shape, dst.shape) == dst.shape:", "        if src.dim() == 0:",
        ("tests/test_row_writes.py::test_indexed_writes_equal_the_same_writes_on_plain_tensors",)),
    "materialize_resets_real_modules": Mutation(
        "shardtensor/materialize.py", "materialize",
        "                if reset is not None and id(submodule) in had_meta:", "                if reset is not None:",
        ("tests/test_misuse.py::test_materialize_keeps_weights_that_were_not_on_the_meta_device",)),
    "materialize_trusts_a_reset_above_a_buffer": Mutation(
        "shardtensor/materialize.py", "_check_after_init",
        "    left = untouched.untouched(module)", "    left = []",
        ("tests/test_misuse.py::test_materialize_names_a_buffer_its_modules_reset_does_not_set",)),
    "lbfgs_refused_midway": Mutation(
        "shardtensor/_misuse_optim.py", "_refuse_optimizer_built_first",
        "    _refuse_flat_vector(optimizer)\n", "",
        ("tests/test_misuse.py::test_lbfgs_on_a_sharded_model_is_refused_before_any_update",)),
    "unit_reduces_frozen_parameters": Mutation(
        "shardtensor/_unit.py", "reduce",
        "                if flag == 0:  # no rank has a gradient", "                if False:  # no rank has a gradient",
        ("tests/test_compressed_reducer.py::test_frozen_parameters_are_not_reduced_in_any_gather_mode",)),
    "reducer_state_refused_at_another_world": Mutation(
        "optim/compressed.py", "_refit",
        "    if flat.numel() == numel:", "    if True:",
        ("tests/test_compressed_reducer.py::test_error_buffers_saved_at_another_world_size_resume_where_they_fit",)),
    "cpu_adam_hooks_hold_it": Mutation(
        "optim/_speculation.py", "_hook_speculation",
        "p.register_post_accumulate_grad_hook(hook)", "p.register_post_accumulate_grad_hook(self._on_grad_ready)",
        ("tests/test_cpu_adam.py::test_a_speculative_cpu_adam_dropped_for_a_new_one_is_collected_and_steps_no_more",)),
    "unit_gathers_inside_functorch": Mutation(
        "shardtensor/_units.py", "_pre_forward",
        "            with _hooks.outside_functorch_transforms():  # (its autograd node below stays inside them)",
        "            if True:",
        ("tests/test_composability.py::test_torch_func_transforms_of_the_input_equal_unsharded",)),
    "muon_step_unchecked": Mutation(
        "optim/muon.py", "step",
        "        shardtensor.check_optimizer_step(self, self._params)  # before any update, as every torch.optim step",
        "        pass",
        ("tests/test_layerwise.py::test_muon_steps_get_the_checks_of_torch_optimizers",)),
    "muon_keeps_meta_locals": Mutation(
        "optim/muon.py", "step", "        self._follow_new_locals()", "        pass",
        ("tests/test_layerwise.py::test_muon_steps_get_the_checks_of_torch_optimizers",)),
    "graph_on_grad_dropped": Mutation(
        "shardtensor/_grad_landing.py", "refuse_a_graph_on_grad", "    if torch.is_grad_enabled():", "    if False:",
        ("tests/test_grad_landing.py::test_backward_with_create_graph_is_named_with_the_autograd_grad_recipe",)),
    "offloaded_state_read_unswapped": Mutation(
        "offload/nvme.py", "track", "        return ResidentOnRead(state, self, key)", "        return state",
        ("tests/test_offload.py::test_reading_offloaded_state_through_opt_state_gives_its_values",)),
    "swap_read_failure_kept_to_one_rank": Mutation(
        "offload/nvme.py", "acquire", '                        _comm.announce_failure(f"{type(exc).__name__}: {exc}")',
        "                        pass",
        ("tests/test_offload.py::test_a_swap_read_failing_on_one_rank_is_named_on_every_rank",)),
    "nvme_offload_shared_by_two_optimizers": Mutation(
        "offload/nvme_adam.py", "__init__", "        _adopt(offload, self)", "        pass",
        ("tests/test_offload.py::test_one_nvme_offload_for_two_optimizers_is_refused_and_a_dropped_ones_is_taken_over",)),
    "replicated_mean_written_again": Mutation(
        "shardtensor/reduce.py", "_average_replicated",
        "            if counts[k] == 0 or failed or id(param) in averaged:", "            if counts[k] == 0 or failed:",
        ("tests/test_cpu_adam.py::test_replicated_parameters_leave_speculation_running",)),
    "gone_peer_waited_for": Mutation(
        "shardtensor/_comm_stall.py", "_compare", "        if pid is not None:", "        if False:",
        ("tests/test_reliability.py::test_a_rank_whose_process_is_gone_is_named_not_waited_for",)),
    "failure_before_late_completion_ignored": Mutation(
        "shardtensor/_comm_stall.py", "_compare",
        "        if failed_at is not None and (failed_at > _last_progress or stale_twice):",
        "        if failed_at is not None and failed_at > _last_progress:",
        ("tests/test_reliability.py::test_a_failure_announced_before_a_late_completion_is_still_named",)),
    "reducer_refusal_kept_to_one_rank": Mutation(
        "optim/compressed.py", "reduce",
        '            _comm.announce_failure(f"{type(exc).__name__}: {exc}")', "            pass",
        ("tests/test_compressed_reducer.py::test_an_error_buffer_refused_on_one_rank_is_named_on_every_rank",)),
    "checkpoint_calls_not_compared": Mutation(
        "shardtensor/checkpoint.py", "_same_call_on_every_rank",
        "    if len({repr(c) for _, _, c in paths}) > 1:", "    if False:",
        ("tests/test_checkpoint.py::test_an_optimizer_passed_on_some_ranks_only_is_named_before_anything_is_written",)),
    "dtensor_state_dict_left_to_torch": Mutation(
        "shardtensor/_agreement.py", "agree_on_load",
        "    shard_refusal = take_dtensors(params, state_dict, prefix) or None", "    shard_refusal = None",
        ("tests/test_checkpoint.py::test_set_model_state_dict_takes_dtensor_state_dicts_or_names_them_on_every_rank",)),
    "state_making_step_refused_mid_accumulation": Mutation(
        "shardtensor/_misuse_optim.py", "making_state", "    _MAKING_STATE.add(optimizer)", "    pass",
        ("tests/test_checkpoint.py::test_a_save_between_micro_batches_before_the_first_step_saves_and_changes_nothing",)),
    "state_made_to_load_into_kept": Mutation(
        "shardtensor/_state_to_load_into.py", "drop_if_never_loaded", "        optimizer.state.clear()", "        pass",
        ("tests/test_checkpoint.py::test_resume_through_dtensor_state_dicts_equals_the_uninterrupted_run",)),
    "dtensor_optimizer_state_left_to_torch": Mutation(
        "shardtensor/_misuse_optim.py", "_refuse_state_of_another_rank",
        "    refusal = take_dtensor_state(optimizer) or None", "    refusal = None",
        ("tests/test_checkpoint.py::test_resume_through_dtensor_state_dicts_equals_the_uninterrupted_run",)),
    "module_placed_twice_sharded_twice": Mutation(
        "shardtensor/api.py", "shard_module",
        "            if param is None or (id(submodule), name) in visited:", "            if param is None:",
        ("tests/test_parity.py::test_one_block_placed_twice_trains_like_the_unsharded_model",)),
    "orig_mod_kept_in_full_keys": Mutation(
        "shardtensor/full_state.py", "full_state_dict", "        key = _without_compile_wrappers(key)", "        pass",
        ("tests/test_checkpoint.py::test_full_state_dict_of_regionally_compiled_blocks_has_the_plain_models_keys",)),
    "saved_initial_lr_dropped": Mutation(
        "shardtensor/checkpoint_match.py", "hold_back_unsaved_settings",
        "            group[key] = None", "            pass",
        ("tests/test_checkpoint.py::test_initial_lr_saved_in_a_checkpoint_is_restored_into_a_fresh_optimizer",)),
    "pending_grad_read_by_to_local": Mutation(
        "shardtensor/_grad_edits.py", "refuse_read_of_pending",
        "    if local is not None and hasattr(local, _SCALES) and torch._C._current_graph_task_id() == -1:",
        "    if False:",
        ("tests/test_sync_habits.py::test_a_use_of_grad_between_no_sync_micro_batches_that_ddp_computes_on_its_sum_is_refused",)),
}


def apply(name: str, m: Mutation, text: str) -> str:
    if name == "fuzz_family_dropped":
        old = "sequences = st.lists(st.sampled_from(sorted(OPS)),"
        new = "sequences = st.lists(st.sampled_from(sorted(n for n in OPS if OPS[n][0] != 'combine')),"
        if old not in text:
            raise LookupError(old)
        return text.replace(old, new, 1)
    start = text.find(f"def {m.function}(")
    if start < 0:  # a C function inside a Python module's source string (ops/_adamw_cpu.py)
        start = text.find(f" {m.function}(")
    at = text.find(m.old, start) if start >= 0 else -1
    if at < 0:
        raise LookupError(f"{m.old!r} after 'def {m.function}('")
    return text[:at] + m.new + text[at + len(m.old):]


def run(name: str) -> bool:
    m = MUTATIONS[name]
    path = os.path.join(ROOT, m.path)
    with open(path) as f:
        original = f.read()
    try:
        mutated = apply(name, m, original)
    except LookupError as e:
        print(f"[{name}] does not apply any more ({m.path}: {e}): update tests/mutations.py", flush=True)
        return False
    try:
        with open(path, "w") as f:
            f.write(mutated)
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rf", *m.tests],
                              cwd=ROOT, capture_output=True, text=True, timeout=900)
    finally:
        with open(path, "w") as f:
            f.write(original)
    failed = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    summary = proc.stdout.strip().splitlines()[-1:] if proc.stdout.strip() else []
    # Caught means a test ran and failed (pytest exit 1).  Exit 4/5 (a test id not found, nothing collected) is a
    # stale table, not a catch: a deleted test once passed here as "caught ()".
    caught = proc.returncode == 1 and bool(failed)
    verdict = "caught" if caught else ("SURVIVED" if proc.returncode == 0 else
                                       f"NOT RUN (pytest exit {proc.returncode}: are its tests still there?)")
    print(f"[{name}] {verdict} ({' '.join(summary)})", *failed, sep="\n  ", flush=True)
    return caught


def main(names: list) -> int:
    names = names or list(MUTATIONS)
    unknown = [n for n in names if n not in MUTATIONS]
    if unknown:
        print(f"unknown mutations {unknown}; known: {sorted(MUTATIONS)}")
        return 2
    return 0 if all([run(n) for n in names]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
