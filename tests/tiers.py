"""Which parametrised tests run in the fast tier, and which in the long one.

A plain ``python -m pytest`` runs the fast tier (``-m 'not long'``); ``python
-m pytest -m long`` the rest, and CI both. A test below is a matrix over model
families, layouts or dtypes whose cases exercise one code path each; its
first case (or the ones named) stays in the fast tier and the others are
marked ``long`` (``tests/conftest.py`` applies this at collection), so the
fast tier still runs every path once.
"""

# ``file::function`` -> the parameter ids kept in the fast tier (``None``:
# the first collected case).
FAST_CASES = {
    'tests/test_tunix.py::test_layerwise_trainer_matches_peft_trainer': None,
    'tests/test_tunix.py::test_checkpoint_resumes': None,
    'tests/test_memory_regression.py::test_layerwise_overhead_under_measured_bound':
        None,
    'tests/test_nnx_routing.py::test_every_tunix_matrix_goes_to_taco': None,
    'tests/examples/test_loading.py::test_logits_match_transformers':
        ('llama',),
    'tests/examples/test_export.py::'
    'test_export_round_trips_through_our_loader_and_transformers':
        ('gpt_neox',),
    'tests/examples/test_models.py::test_padding_matches_unpadded_rows': None,
    'tests/examples/test_models.py::test_logits_are_float32_with_vocab_width':
        None,
    'tests/examples/test_models.py::'
    'test_causal_future_tokens_do_not_change_past_logits': None,
    'tests/examples/test_models.py::'
    'test_one_taco_step_moves_one_weight_per_column': None,
    'tests/examples/test_layerwise.py::test_layerwise_steps_equal_optax_path':
        None,
    'tests/examples/test_layerwise.py::test_layered_loss_equals_model_loss':
        None,
    'tests/examples/test_optimizers.py::'
    'test_optimizer_lowers_the_loss_of_a_fixed_batch': ('adamw', 'taco'),
    'tests/examples/test_optimizers.py::test_taco_flags_reach_the_trainer':
        None,
    'tests/test_grad_norm.py::test_token_tables': None,
    'tests/test_grad_norm.py::test_dense_layers': None,
    'tests/test_clipping.py::test_clip_global_norm_equals_the_optax_chain':
        None,
    'tests/test_clipping.py::'
    'test_clip_with_accumulation_equals_multisteps_of_the_chain': None,
    'tests/test_accumulation.py::test_untied_equals_multisteps_bit_for_bit':
        None,
    'tests/test_rounding.py::test_layerwise_step_rounds_as_the_optax_path':
        None,
    'tests/test_rounding.py::test_taco_branch_is_the_chain_bit_for_bit': None,
    'tests/test_train_step.py::test_equals_plain_optax_path_bf16_with_schedule':
        None,
    'tests/test_pallas_kernel.py::test_matches_reference': None,
    'tests/test_grad_norm.py::test_accumulation_is_the_mean_gradients_norm':
        None,
    'tests/test_train_step.py::test_layerwise_step_peak_memory_is_near_forward':
        None,
    'tests/test_clipping.py::test_clipped_token_tables_formed_a_block_at_a_time':
        None,
    'tests/test_token_table.py::test_tied_table_in_two_phases_equals_plain_optax_path':
        None,
    'tests/test_token_table.py::test_equals_plain_optax_path_in_one_pass':
        None,
    'tests/test_token_table.py::'
    'test_two_phases_equal_the_column_step_on_ties_and_zero_columns': None,
}


def long_cases(items) -> list:
  """The collected ``items`` that :data:`FAST_CASES` sends to the long tier.
  """
  seen = set()
  marked = []
  for item in items:
    key = f'{item.nodeid.split("::")[0]}::{getattr(item, "originalname", "")}'
    if key not in FAST_CASES or not hasattr(item, 'callspec'):
      continue
    kept = FAST_CASES[key]
    if kept is None:
      fast = key not in seen
      seen.add(key)
    else:
      fast = item.callspec.id in kept
    if not fast:
      marked.append(item)
  return marked
