"""The tests behind ``extended``: out of the README's test command, run by CI after it.

The README's test command must stay under 10 minutes of CPU on a 2-core machine (issue 55:
it took 15-16). A quarter of that time was dynamo capturing real models, spread over a few
hundred tests of 2-20 s each. The tests listed here are marked ``extended`` at collection
(tests/conftest.py): ``python -m pytest -q -n 2 --dist loadfile -m "extended and not slow"``
runs them (``-m extended`` alone would add the ``slow`` ones among them), and
``.ci/run`` runs that command after the README's, so CI still checks every one of them.

Two kinds:

- ``EXTENDED``: node-id prefixes (a file, a test, or a test with the start of its parameters)
  of tests that repeat, on another real model, in another dtype or through another entry
  point, a behaviour a cheaper test checks in the default run; and a few that start processes
  or run a property search (a fuzzer, a second planner to agree with). The comment above each
  group names what stays in the default run.
- ``SAMPLED``: parametrized matrices, by their main parameter. The default run keeps one item
  of each value of that parameter, the other parameters (dtype, capture method, mode) taken in
  turn, so that each value and each dtype/method still runs; ``extended`` runs the rest of the
  product.

An entry that matches no test of a file the run collected as a whole fails the collection
(a renamed test would otherwise silently move back to the default run or out of ``extended``).
docs/testing.md, "The default run and extended", has the figures.
"""

from __future__ import annotations

EXTENDED: tuple[str, ...] = (
    # Default run: a default-config LLaMA returns a working cache; a .pt2 loads in a
    # torch-only process (test_deploy.py); the cache advice and the CLI's dump.
    "tests/benchmarks/test_hf_defaults.py::test_default_config_transforms_and_the_graph_returns_a_working_cache[gpt2]",
    "tests/benchmarks/test_hf_defaults.py::test_cache_registrations_are_transformers_and_the_plain_cache_rebuilds",
    "tests/benchmarks/test_hf_defaults.py::test_a_program_transformers_exported_still_runs_after_amprewrites_graph_is_gone",
    "tests/benchmarks/test_hf_defaults.py::test_onnx_outputs_of_a_default_config_model_are_named_as_docs_cli_says",
    "tests/benchmarks/test_hf_defaults.py::test_transformers_dynamo_exporter_program_transforms_with_its_dynamic_shapes",
    "tests/benchmarks/test_hf_defaults.py::test_a_decode_step_program_taking_a_cache_transforms_with_static_sizes",
    "tests/benchmarks/test_hf_defaults.py::test_pt2_of_a_default_config_model_loads_in_a_process_that_imports_only_torch",
    "tests/benchmarks/test_hf_defaults.py::test_pt2_check_fails_a_program_that_needs_transformers_to_load",
    # Default run: the overflow benchmark's spread and the GPU-budget command on the CPU.
    "tests/benchmarks/test_fp8_benchmark.py",
    "tests/benchmarks/test_overflow_benchmark.py::test_measure_reports_the_goals_of_the_default_plan",
    # Default run: inductor on transformed and symbolic upsample graphs (bf16); the exact
    # gradients eagerly; fp16 through the same rewrite.
    "tests/passes/test_replace_upsample.py::test_gradients_under_torch_compile",
    "tests/passes/test_replace_upsample.py::test_transform_always_is_exact_and_follows[dtype1]",
    # Default run: .pt2 at another batch size, fp16 ONNX in onnxruntime, ONNX names.
    "tests/deploy/test_deploy.py::test_an_moe_model_exports_to_fp16_onnx_with_transformers_translations",
    "tests/deploy/test_deploy.py::test_onnx_export_of_a_plain_model_does_not_import_transformers",
    "tests/deploy/test_onnx_lean.py::test_a_zoo_gpt2_file_gets_lean_with_the_same_outputs",
    # Default run: float8's error model, GPT-2's Conv1D, a checkpointed block, one plan.
    "tests/precision/test_float8.py::test_small_llama_trains_in_fp8_as_in_bf16_for_its_first_steps",
    "tests/precision/test_float8.py::test_deploy_pt2_and_aoti_take_fp8_graphs_onnx_says_why_not",
    "tests/precision/test_float8.py::test_the_chosen_set_on_zoo_models_is_reported_and_stable",
    "tests/compile/test_one_plan.py::test_a_later_blocks_float8_error_turns_that_linear_to_bf16_in_every_plan",
    # Default run: fullgraph compiles of writes through views, BLOOM's gelu function and
    # diffusers' UNet1D, the API's quickstart, the backend's inner inductor; the upsample
    # graphs under inductor.
    "tests/compile/test_fullgraph.py::test_zoo_model_compiles_with_fullgraph",
    "tests/compile/test_fullgraph.py::test_a_graph_returning_a_transformers_cache_compiles_with_fullgraph",
    "tests/compile/test_fullgraph.py::test_custom_autograd_function_keeps_its_backward_and_compiles",
    # Default run: GPT-2's module paths; the HTML report in Chromium; explore's errors.
    "tests/show/test_views.py::test_module_paths_are_the_models_own_module_names[unet2d_condition]",
    "tests/show/test_views.py::test_explore_serves_model_explorer_with_both_graphs_and_overlays",
    # Default run: the zoo BERT's program; a dynamic batch on the small transformer and CNN.
    "tests/capture/test_exported_program.py::test_program_in_program_out_with_its_dynamic_batch[gpt2]",
    "tests/capture/test_exported_program.py::test_zoo_program_runs_the_same_ops_low_as_the_module[vit]",
    "tests/capture/test_exported_program.py::test_zoo_program_runs_the_same_ops_low_as_the_module[resnet]",
    "tests/capture/test_capture_modes.py::test_transformers_llama_export_capture_matches_dynamo",
    "tests/graph/test_dynamic_shapes.py::test_dynamic_batch_exports_saves_loads_and_runs_at_other_batches[gpt2]",
    "tests/graph/test_shapes.py::test_llama_captured_at_batch_1_runs_at_other_batches_and_lengths",
    # Default run: LLaMA's run-time classes, the VAE decoder's upsamples, Mixtral's experts,
    # GPT-2 and ResNet conformance, LLaMA's ranges.
    "tests/models/test_real_models.py::test_real_model_classes_respected_at_run_time[unet2d",
    "tests/models/test_real_models.py::test_real_model_classes_respected_at_run_time[bert",
    "tests/models/test_real_models.py::test_more_architectures_transform_within_autocasts_error[wav2vec2]",
    "tests/models/test_conformance.py::test_conformance[mixtral-bf16-eager]",
    "tests/models/test_conformance.py::test_conformance[gpt2-fp16-eager]",
    "tests/models/test_conformance.py::test_conformance[vit-bf16-eager]",
    "tests/precision/test_ranges.py::test_a_subnormal_bias_of_a_vit_mlp_keeps_its_matmuls_in_fp16",
    "tests/precision/test_ranges.py::test_on_the_zoo_no_range_decides_anything[gpt2]",
    "tests/precision/test_declarations.py::test_inkling2_router_gate_runs_fp32_in_bf16",
    # Default run: the trainers in fp16 (the scaler's path), the backend's loss curve, T5 and
    # static-cache generation.
    "tests/training/test_trainer.py::test_trains_in_the_trainers_dtype_finite_and_near_fp32[bf16]",
    "tests/training/test_accelerate.py::test_the_loop_trains_finite_near_fp32_without_autocast[bf16]",
    "tests/training/test_checkerboard.py::test_training_follows_autocasts_loss_curve[transform_bf16]",
    "tests/compile/test_generation.py::test_greedy_tokens_equal_autocast_and_the_model_is_untouched[dynamic]",
    "tests/compile/test_generation.py::test_default_config_causal_and_seq2seq_models_generate_as_autocast[gpt2]",
    "tests/test_cli.py::test_a_seq2seq_factory_with_keyword_inputs_checks",
    # Default run (2 gloo processes): amprewrite.fully_shard's gathers and losses, the fp16
    # recipe, the rank-0-only evaluation, one plan on every rank.
    "tests/training/test_fsdp_orders.py",
    "tests/training/test_distributed.py",
    "tests/training/test_sharding.py::test_fully_shard_gathers_float8_the_weights_the_plan_runs_in_float8",
    # Default run: the mask sentinel's rewrite on a small attention with fully masked rows.
    "tests/passes/test_freeze_dtype_reads.py::test_t5_with_a_left_padded_decoder_transforms_in_bf16_within_autocasts_error",
    # Property searches: the example-based tests of the same properties stay (test_fuzz.py's
    # cases found by fuzzing, test_conversions.py's position spellings, test_plan.py's cuts).
    "tests/test_fuzz.py::test_transform_properties",
    "tests/test_fuzz_positions.py",
    "tests/precision/test_plan.py::test_exhaustive_small_cuts_agree_with_networkx",
    # Default run: amprewrite.optimizer's unit tests (tests/compile/test_optimizer.py), the
    # bf16 params="low" Trainer, accelerate and Lightning runs, the 2-rank low shards.
    "tests/benchmarks/test_training_state_benchmark.py",
    "tests/training/test_trainer.py::test_params_low_trains_low_weights_with_amprewrites_optimizer_and_checkpoints[fp16]",
    "tests/training/test_accelerate.py::test_params_low_prepares_amprewrites_optimizer_and_trains_near_fp32[fp16]",
    "tests/training/test_lightning.py::test_params_low_trains_with_amprewrites_optimizer_and_resumes[fp16]",
    # Default run: BERT's and LLaMA's masks go without padding and stay with it, a buffer mask
    # stays, an additive causal mask becomes is_causal (test_simplify_attention_masks.py).
    "tests/passes/test_simplify_attention_masks.py::test_vit_and_gpt2_masks_go_and_a_sliding_window_stays",
    "tests/passes/test_simplify_attention_masks.py::test_a_dynamic_length_is_checked_at_its_bound_and_an_unbounded_one_keeps_the_mask",
    # Default run: the 2-rank TP collectives in bf16 and fp16 and the eval plans agreeing.
    "tests/training/test_tp_collectives.py::test_tp_and_fsdp2_on_a_2x2_mesh_send_and_gather_low",
    # Default run: Qwen2's first new length warns once and its advice serves every length
    # (test_retransform_warning.py); GPT-2 (n_positions) repeats it.
    "tests/graph/test_retransform_warning.py::test_first_new_length_warns_once_with_the_dynamic_shapes_that_avoid_it[gpt2]",
    # Default run: AutoencoderKL's report names the line that bounds its batch at 63
    # (test_dynamic_bounds.py); the UNet's exported artefact says the same.
    "tests/graph/test_dynamic_bounds.py::test_the_exported_artefact_says_why_its_batch_stops_at_63",
    # Default run: LLaMA's plan applied to a fresh instance (same code and report), the UNet's
    # in fp16, an edited plan, a changed Stack, the backend per block. Extended: the UNet in
    # bf16, LLaMA with a layer added, a plan from another process, dynamo -> export.
    "tests/precision/test_plan_file.py::test_unet_round_trip[bf16]",
    "tests/precision/test_plan_file.py::test_llama_with_a_layer_added",
    "tests/precision/test_plan_file.py::test_a_plan_saved_in_another_process_applies_here",
    "tests/precision/test_plan_file.py::test_a_dynamo_plan_applies_to_an_export_capture_where_nodes_correspond",
)

# test (file::function) -> its main parameter: one item of each of its values stays in the
# default run, the other parameters taken in turn.
SAMPLED: dict[str, str] = {
    "tests/passes/test_replace_upsample.py::test_symbolic_graph_equals_native":
        "case",
    "tests/passes/test_functionalize.py::test_mutation_pattern_matches_fp32":
        "pattern",
    "tests/passes/test_vectorize_loops.py::test_batch_gather_family_is_rerolled_and_exact":
        "form",
    "tests/precision/test_conversions.py::test_positions_stay_distinct_in_bf16":
        "name",
    "tests/precision/test_precision_classes.py::test_fp32_family_beats_its_flipped_class":
        "case",
    "tests/precision/test_precision_classes.py::test_low_family_is_planned_low_and_accurate":
        "family",
    "tests/precision/test_ops.py::test_issue_table_row_is_finite_and_at_most_autocasts_error":
        "row",
    "tests/precision/test_mixed.py::test_mixed_numerics_equal_the_fp32_islands":
        "family",
}


def _function(nodeid: str) -> str:
    return nodeid.split("[", 1)[0]


def _matches(nodeid: str, entry: str) -> bool:
    """A file, a test (with all its parameters), or a test with the start of its parameters."""
    if "[" in entry:
        return nodeid.startswith(entry)
    return nodeid == entry or nodeid.startswith((entry + "[", entry + "::"))


def extended_items(items: list) -> list:
    """The items to mark ``extended``. A sampled test's ``slow`` items are neither kept nor
    counted (``-m slow`` runs them).

    >>> class Item:
    ...     def __init__(self, nodeid, **params):
    ...         self.nodeid = nodeid
    ...         self.callspec = type("C", (), {"params": params})()
    >>> t = "tests/passes/test_functionalize.py::test_mutation_pattern_matches_fp32"
    >>> items = [Item(f"{t}[{p}-{d}]", pattern=p, dtype=d) for p in "abc" for d in (1, 2)]
    >>> [i.nodeid[-4:] for i in extended_items(items)]  # a-1, b-2 and c-1 stay
    ['a-2]', 'b-1]', 'c-2]']
    """
    marked = [i for i in items if any(_matches(i.nodeid, e) for e in EXTENDED)]
    groups: dict[str, dict[object, list]] = {}
    for item in items:
        main = SAMPLED.get(_function(item.nodeid))
        spec = getattr(item, "callspec", None)
        slow = getattr(item, "get_closest_marker", lambda name: None)("slow")
        if main is not None and spec is not None and main in spec.params and slow is None:
            values = groups.setdefault(_function(item.nodeid), {})
            values.setdefault(spec.params[main], []).append(item)
    for values in groups.values():
        for k, group in enumerate(values.values()):
            marked += [item for j, item in enumerate(group) if j != k % len(group)]
    return marked


def stale_entries(items: list) -> list[str]:
    """The entries that match no item, of the files ``items`` come from (call it only when
    whole files were collected: a ``file::test`` argument collects part of one)."""
    files = {i.nodeid.split("::")[0] for i in items}
    ids = [i.nodeid for i in items]
    return [e for e in (*EXTENDED, *SAMPLED) if e.split("::")[0] in files
            and not any(_matches(n, e) for n in ids)]
