"""``--rounding`` and ``--measure-landed``: how 16-bit parameters are updated.

The flag's resolution per optimizer and dtype, what each choice builds (the
parameters' dtype, the optimizer's last transformation), what a run reports
(results.json and the summary name the rounding and its memory cost, the
share of updates that landed) and the resume rule.
"""

import json
import os
import shutil

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import data
from examples.finetune import flags
from examples.finetune import landed
from examples.finetune import memory_plan
from examples.finetune import optimizers
from examples.finetune import precision
from examples.finetune import preparation
from examples.finetune import report
from examples.finetune import trainers
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as model_lib
import taco_optax
from tests.support import tiny_llama

_BF16, _F32 = jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)


@pytest.mark.parametrize('optimizer', ['taco', 'adamw', 'lion'])
@pytest.mark.parametrize('rounding', precision.ROUNDINGS)
def test_rounding_resolves_per_optimizer_and_dtype(optimizer, rounding):
  wide = precision.resolve('float32', rounding, optimizer)
  # float32: all four are the same, and the log says so.
  assert wide[:3] == (_F32, _F32, precision.NO_ROUNDING)
  assert f'--rounding {rounding} changes nothing' in wide.why
  narrow = precision.resolve('bfloat16', rounding, optimizer)
  expected = rounding
  if rounding == 'auto':
    expected = 'stochastic' if optimizer == 'taco' else 'master'
  assert narrow.rounding == expected
  assert narrow.compute_dtype == _BF16
  assert narrow.param_dtype == (_F32 if expected == 'master' else _BF16)
  told = narrow.optimizer_rounding(seed=7)
  assert told == optimizers.Rounding(
      'stochastic' if expected == 'stochastic' else 'nearest', 7)


def test_rounding_flag_is_declared_documented_and_refused():
  assert flags.RunConfig().rounding == 'auto'
  assert flags.from_command_line(['--rounding', 'master']).rounding == (
      'master')
  with pytest.raises(flags.FinetuneError) as error:
    flags.from_command_line(['--rounding', 'up'])
  assert str(error.value).startswith(
      "--rounding must be one of 'auto', 'stochastic', 'nearest', 'master', "
      "got 'up'")
  with pytest.raises(flags.FinetuneError, match='^--rounding must be one of'):
    flags.RunConfig(rounding='up')
  assert flags.from_command_line(['--measure-landed']).measure_landed


def _bf16_params():
  return {'w': jnp.full((64, 32), 0.02, jnp.bfloat16),
          'b': jnp.full((32,), 1.0, jnp.bfloat16)}


def test_stochastic_ends_an_optax_peer_with_stochastic_rounding():
  params = _bf16_params()
  hints = optimizers.ModelHints()
  spec = optimizers.get('adamw')
  chained = spec.build(1e-6, hints, rounding=optimizers.Rounding(
      'stochastic', 3))
  plain = spec.build(1e-6, hints, rounding=optimizers.Rounding('nearest', 3))
  state = chained.init(params)
  # optax.chain(adamw, stochastic_rounding(3)): adamw's state, then its own.
  assert len(state) == 2
  assert jax.tree.structure(state[0]) == jax.tree.structure(
      plain.init(params))
  assert jax.tree.structure(state[1]) == jax.tree.structure(
      taco_optax.stochastic_rounding(3).init(params))
  grads = jax.tree.map(jnp.ones_like, params)
  # A 1e-6 step is far below half an ulp of 0.02 (6e-5): nearest drops it,
  # stochastic rounding lands about 1e-6 / 1.2e-4 of the weights.
  kept = optax.apply_updates(params, plain.update(grads, plain.init(params),
                                                  params)[0])
  assert all(bool((kept[k] == params[k]).all()) for k in params)
  moved = optax.apply_updates(params, chained.update(grads, state,
                                                     params)[0])
  assert not bool((moved['w'] == params['w']).all())


def test_taco_is_told_the_rounding_itself():
  params = _bf16_params()
  hints = optimizers.ModelHints()
  build = lambda mode: optimizers.get('taco').build(
      1e-6, hints, rounding=optimizers.Rounding(mode))
  grads = jax.tree.map(jnp.ones_like, params)
  landed_weights = {}
  for mode in ('stochastic', 'nearest'):
    tx = build(mode)
    updates, _ = tx.update(grads, tx.init(params), params)
    new = optax.apply_updates(params, updates)
    landed_weights[mode] = int((new['w'] != params['w']).sum())
  assert landed_weights['nearest'] == 0 < landed_weights['stochastic']


def test_master_stores_float32_and_computes_in_bfloat16(workspace):
  model, _, _, _ = preparation.load_model(
      workspace['model'], dtype=_BF16, param_dtype=_F32, remat=False)
  params = nnx.state(model, nnx.Param)
  assert {x.dtype for x in jax.tree.leaves(params)} == {_F32}
  ids = jnp.ones((1, 5), jnp.int32)
  assert model.hidden_states(ids).dtype == _BF16
  # Each matmul runs on bfloat16 copies of the float32 kernels.
  reference = jax.tree.map(lambda x: x.astype(_BF16), params)
  narrow, _, _, _ = preparation.load_model(workspace['model'], dtype=_BF16,
                                           remat=False)
  assert {x.dtype for x in jax.tree.leaves(nnx.state(narrow, nnx.Param))} == {
      _BF16}
  jax.tree.map(np.testing.assert_array_equal, reference,
               nnx.state(narrow, nnx.Param))
  np.testing.assert_array_equal(model(ids), narrow(ids))
  # The memory planner sees the float32 parameters and gradients.
  state_bytes = 0
  peaks = [memory_plan.model_peak(m, memory_plan.model_params(m), state_bytes,
                                  batch=2, seq=8, layerwise=False)
           for m in (model, narrow)]
  extra = memory_plan.tree_bytes(params) - memory_plan.tree_bytes(reference)
  assert extra == memory_plan.tree_bytes(params) // 2
  assert peaks[0] - peaks[1] == 2 * extra  # weights and their gradients


def _results(output_dir):
  with open(os.path.join(output_dir, 'results.json')) as f:
    return json.load(f)


@pytest.mark.parametrize('optimizer, rounding, expected', [
    ('adamw', 'auto', 'master'), ('adamw', 'stochastic', 'stochastic'),
    ('taco', 'auto', 'stochastic'), ('taco', 'nearest', 'nearest'),
    ('adamw', 'nearest', 'nearest'), ('taco', 'master', 'master')])
def test_each_rounding_names_itself_and_its_memory_cost(optimizer, rounding,
                                                        expected):
  # What a bfloat16 run records (results.json's master_weight_bytes and
  # updates_16bit), from the parameters as the run stores them and the
  # optimizer it builds; the CLI writes both (below, one run per default).
  told = precision.resolve('bfloat16', rounding, optimizer)
  assert told.rounding == expected
  params = {'w': jnp.zeros((64, 32), told.param_dtype),
            'b': jnp.zeros((32,), told.param_dtype)}
  tx = optimizers.get(optimizer).build(
      1e-3, optimizers.ModelHints(), rounding=told.optimizer_rounding(seed=0))
  cost = precision.master_cost(params, tx.init, told.compute_dtype)
  text = precision.describe(told, *cost)
  if expected == 'master':
    assert cost[0] == memory_plan.tree_bytes(params) // 2 > 0
    # AdamW's two moments follow the parameters' dtype; TACO's state is the
    # same in either (float8 history, float32 Adam moments for the vectors).
    assert cost[1] == (2 * cost[0] if optimizer == 'adamw' else 0)
    state = (f', +{report.format_bytes(cost[1])} of state' if cost[1]
             else '')
    assert text == (
        'float32 master weights, bfloat16 compute '
        f'(+{report.format_bytes(cost[0])} of parameters{state})')
  else:
    assert cost == (0, 0)
    assert '(no extra memory' in text
    assert text.startswith({'stochastic': 'stochastic rounding',
                            'nearest': 'round to nearest'}[expected])


@pytest.mark.long
@pytest.mark.parametrize('optimizer, rounding', [('adamw', 'master'),
                                                 ('taco', 'stochastic')])
def test_results_and_summary_name_the_rounding_and_its_cost(
    workspace, capsys, optimizer, rounding):
  # Each optimizer's default in bfloat16, end to end; the other roundings
  # (--rounding) build and describe themselves as in the test above.
  output_dir = workspace['root'] / f'rounding-{optimizer}-{rounding}'
  assert cli.main(tiny_llama.text_args(
      workspace, output_dir, '--optimizer', optimizer, '--dtype', 'bfloat16',
      '--measure-landed')) == 0
  out = capsys.readouterr().out
  results = _results(output_dir)
  assert results['rounding'] == rounding
  assert results['compute_dtype'] == 'bfloat16'
  cost = results['master_weight_bytes']
  table_line = next(line for line in out.splitlines()
                    if line.startswith('16-bit updates '))
  assert results['updates_16bit'] in table_line
  if rounding == 'master':
    assert results['parameter_dtype'] == 'float32'
    # Measured: half of the float32 parameters' bytes, and AdamW's moments.
    assert cost['parameters'] == results['parameter_bytes'] // 2 > 0
    assert cost['state'] > 0
    assert results['updates_16bit'].startswith(
        'float32 master weights, bfloat16 compute '
        f'(+{report.format_bytes(cost["parameters"])} of parameters, '
        f'+{report.format_bytes(cost["state"])} of state)')
  else:
    assert results['parameter_dtype'] == 'bfloat16'
    assert cost == {'parameters': 0, 'state': 0}
    assert '(no extra memory' in results['updates_16bit']
    assert results['updates_16bit'].startswith(
        {'stochastic': 'stochastic rounding',
         'nearest': 'round to nearest'}[rounding])
  shares = results['landed_updates']
  assert set(shares) == set(landed.GROUPS)
  for entry in shares.values():
    assert 0 < entry['moved'] and 0 <= entry['landed'] <= entry['moved']
    assert entry['share'] == entry['landed'] / entry['moved']
  assert 'updates landed    matrices ' in out
  assert '16-bit updates: ' in out  # the log line


@pytest.mark.long
def test_float32_runs_say_nothing_is_rounded(workspace, capsys):
  output_dir = workspace['root'] / 'rounding-float32'
  assert cli.main(tiny_llama.text_args(
      workspace, output_dir, '--rounding', 'nearest')) == 0
  out = capsys.readouterr().out
  assert ('16-bit updates: none: float32 parameters (--rounding nearest '
          'changes nothing: float32 updates land as computed)') in out
  results = _results(output_dir)
  assert (results['rounding'], results['parameter_dtype']) == ('none',
                                                               'float32')
  assert results['landed_updates'] is None
  assert 'updates landed    not measured (--measure-landed)' in out


def test_resume_refuses_another_rounding(workspace, capsys, monkeypatch):
  output_dir = workspace['root'] / 'rounding-resume'
  args = tiny_llama.text_args(
      workspace, output_dir, '--optimizer', 'adamw', '--dtype', 'auto',
      '--checkpoint-every', '1')
  assert cli.main(args) == 0
  # Resume from step 2 of 3 with the same flags.
  shutil.rmtree(output_dir / 'checkpoints' / 'step_00000003')
  capsys.readouterr()

  def refusal(*changes):
    assert cli.main(args + ['--resume', *changes]) == 2
    return capsys.readouterr().err

  assert ('checkpoint has --rounding auto, this run --rounding master'
          in refusal('--rounding', 'master'))
  # The same flags resolving to another rounding (--dtype auto on an
  # accelerator, where AdamW gets float32 master weights) are refused too.
  monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
  message = refusal()
  assert ('checkpoint has 16-bit updates none, this run 16-bit updates '
          'master') in message, message


def _tiny_batch():
  rng = np.random.default_rng(0)
  return data.collate([data.TokenizedExample(tuple(rng.integers(3, 96, 6)),
                                             (7, 8)) for _ in range(4)],
                      seq_len=10)


def _measured_trainer(taco_step, dtype, mode, lr=3e-3):
  config = config_lib.ModelConfig.tiny('llama')
  model = model_lib.DecoderLM(config, dtype=dtype, param_dtype=dtype,
                              rngs=nnx.Rngs(0))
  hints = optimizers.decoder_hints(config)
  schedule = optimizers.linear_schedule(lr, 4, 1)
  measurement = landed.Measurement(hints.taco_dimension_numbers, 1, schedule,
                                   landed.LandedCounts())
  tx = optimizers.get('taco').build(schedule, hints,
                                    rounding=optimizers.Rounding(mode))
  return trainers.make_trainer(flags.RunConfig(taco_step=taco_step), model,
                               tx, measurement)


def _changed_entries(before, after):
  """``{group: entries whose bits changed}``: TACO's matrices (every
  parameter of two or more axes in the tiny Llama) and the rest."""
  changed = {group: 0 for group in landed.GROUPS}
  for old, new in zip(before, after):
    group = landed.GROUPS[0] if old.ndim >= 2 else landed.GROUPS[1]
    changed[group] += int((old != new).sum())
  return changed


@pytest.mark.long
@pytest.mark.jax_versions
def test_both_taco_paths_count_the_same_landed_updates():
  """Each path's count is the entries its step changed, exactly, and both
  count the same moves. The landed counts are not compared across the
  paths: in bfloat16 their backward passes differ in the last bits (the
  layer-wise step runs each block's backward as its own program), which
  moves a few stochastic roundings (measured over three steps: norm
  scales 167 vs 166 landed of 320 on jax 0.10.2, 167 vs 163 on jax 0.12;
  with float32 compute 172 vs 166 on jax 0.10.2). That the two paths round
  the same update to the same bits is ``tests/test_rounding.py``'s."""
  batch = _tiny_batch()
  counts = {}
  for taco_step in ('layerwise', 'optax'):
    trainer = _measured_trainer(taco_step, jnp.bfloat16, 'stochastic')
    changed = {group: 0 for group in landed.GROUPS}
    for _ in range(3):
      before = [np.array(x) for x in jax.tree.leaves(
          nnx.state(trainer.model, nnx.Param))]
      trainer.step(batch)
      after = [np.array(x) for x in jax.tree.leaves(
          nnx.state(trainer.model, nnx.Param))]
      for group, n in _changed_entries(before, after).items():
        changed[group] += n
    counts[taco_step] = trainer.measurement.counts.shares()
    for group in landed.GROUPS:
      assert counts[taco_step][group]['landed'] == changed[group] > 0, (
          taco_step, group)
  for group in landed.GROUPS:
    assert (counts['layerwise'][group]['moved']
            == counts['optax'][group]['moved'] > 0)
  # The first step (warm-up, rate 0) moves nothing; then every column one.
  assert 0 < counts['optax']['matrices']['landed'] < (
      counts['optax']['matrices']['moved'])


@pytest.mark.long
def test_every_update_lands_in_float32_and_few_round_to_nearest():
  batch = _tiny_batch()
  shares = {}
  for dtype, mode in ((jnp.float32, 'nearest'), (jnp.bfloat16, 'nearest'),
                      (jnp.bfloat16, 'stochastic')):
    trainer = _measured_trainer('layerwise', dtype, mode, lr=1e-5)
    for _ in range(3):
      trainer.step(batch)
    shares[dtype, mode] = trainer.measurement.counts.shares()['matrices']
  assert shares[jnp.float32, 'nearest']['share'] == 1.0
  assert shares[jnp.bfloat16, 'nearest']['share'] < 0.5
  assert (shares[jnp.bfloat16, 'nearest']['share']
          < shares[jnp.bfloat16, 'stochastic']['share'] < 1.0)


def test_landed_counts_carry_over_a_resume():
  counts = landed.LandedCounts()
  counts.add({'matrices': [3, 4], 'vectors': [0, 2]})
  resumed = landed.LandedCounts(json.loads(json.dumps(counts.totals())))
  resumed.add({'matrices': [1, 0], 'vectors': [5, 5]}, {'matrices': 4,
                                                        'vectors': 5})
  assert resumed.shares() == {
      'matrices': {'landed': 4.0, 'moved': 8.0, 'share': 0.5},
      'vectors': {'landed': 5.0, 'moved': 7.0, 'share': 5 / 7}}
  assert landed.summary(resumed.shares()) == 'matrices 50.0%, vectors 71.4%'
