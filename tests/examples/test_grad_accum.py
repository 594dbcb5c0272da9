"""``--grad-accum N`` through the CLI: the same data, the same run, less memory.

``--batch-size`` is the sequences of one optimizer step whatever N is, so a
run with ``--grad-accum 2`` or ``4`` must train on the same batches to the
same losses and weights as ``--grad-accum 1``, for TACO's layer-wise step
(accumulated layer by layer) and for an optax peer (``optax.MultiSteps``).
Completions of different lengths make the micro-batches' token counts differ,
so a per-micro-batch mean (each token weighed by how few its micro-batch
holds) fails here.
"""

import json
import os
import re

import jax
import numpy as np
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import checkpoint
from examples.finetune import data as data_lib
from examples.finetune import flags
from examples.finetune import resume
from tests.support import tiny_llama


def _squad(workspace):
  path = workspace['root'] / 'squad-accum.jsonl'
  if not path.exists():
    # Answers of 1 to 12 characters: the micro-batches' loss tokens differ.
    records = [{'title': 'T', 'context': f'The answer is {"ab" * (i % 6) }z.',
                'question': 'What is the answer?',
                'answers': {'text': ['ab' * (i % 6) + 'z'],
                            'answer_start': [14]}} for i in range(12)]
    tiny_llama.write_jsonl(path, records)
  return str(path)


def _args(workspace, output_dir, optimizer, *extra):
  train = _squad(workspace)
  return ['--model', workspace['model'], '--task', 'squad',
          '--train-file', train, '--test-file', train, '--steps', '3',
          '--batch-size', '4', '--seq-len', '48', '--max-new-tokens', '2',
          '--eval-size', '4', '--eval-batch-size', '4',
          '--optimizer', optimizer, '--lr', '1e-3',
          '--output-dir', str(output_dir), '--no-progress', *extra]


def _run(workspace, name, optimizer, *extra):
  output_dir = workspace['root'] / name
  assert cli.main(_args(workspace, output_dir, optimizer, *extra)) == 0
  with open(output_dir / 'results.json') as f:
    results = json.load(f)
  found = checkpoint.latest(os.path.join(output_dir, resume.CHECKPOINT_DIR))
  tree = checkpoint.restore(found)
  weights = tree['params'] if 'params' in tree else tree[
      next(iter(tree))]  # nnx: (model, optimizer); the model's first
  return results, weights


@pytest.mark.long
@pytest.mark.parametrize('optimizer', [
    'taco', pytest.param('adamw', marks=pytest.mark.jax_versions)])
def test_split_batches_train_to_the_same_result(workspace, optimizer):
  whole, whole_weights = _run(workspace, f'accum-1-{optimizer}', optimizer)
  # One micro-batch per row: the most a batch of 4 splits into.
  count = 4
  split, split_weights = _run(workspace, f'accum-{count}-{optimizer}',
                              optimizer, '--grad-accum', str(count))
  np.testing.assert_allclose(split['losses'], whole['losses'], rtol=2e-5)
  # TACO moves each column by lr * s at its winner: the same winners give
  # the same weights up to the sums' rounding (a wrong winner is off by
  # 1e-3). AdamW's step lr * m / (sqrt(v) + eps) at a weight whose gradient
  # is near eps turns the sums' rounding into a fraction of one step
  # (observed: 1 of 1024 entries, 3.7% with 2 and 6.6% with 4 micro-
  # batches on jax 0.10.2, 11.7% on 0.12.1): such a weight stays within
  # one step, lr, and the rest within the sums' rounding; a wrong mean
  # moves every weight.
  for a, b in zip(jax.tree.leaves(split_weights),
                  jax.tree.leaves(whole_weights)):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if optimizer == 'taco':
      np.testing.assert_allclose(a, b, atol=2e-6)
    else:
      np.testing.assert_allclose(a, b, atol=1e-3)
      assert (np.abs(a - b) > 2e-6).mean() <= 0.01, (
          int((np.abs(a - b) > 2e-6).sum()), a.size)
  if optimizer == 'taco':  # the same step on a quarter of the batch
    assert split['peak_memory_bytes'] < whole['peak_memory_bytes'], (
        split['peak_memory_bytes'], whole['peak_memory_bytes'])
  else:  # MultiSteps: its float32 accumulator is optimizer state
    assert (split['optimizer_state_bytes']
            >= whole['optimizer_state_bytes'] + whole['parameter_bytes'])


def test_micro_batches_split_rows_and_keep_the_whole_batch_mean():
  batch = data_lib.Batch(
      np.arange(24, dtype=np.int32).reshape(4, 6), np.ones((4, 6), bool),
      np.array([[0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0, 1, 1, 0, 0],
                [0, 1, 0, 0, 0, 0]], np.float32))
  micro = data_lib.micro_batches(batch, 2)
  np.testing.assert_array_equal(micro.input_ids[1], batch.input_ids[2:])
  # 5 + 1 + 2 + 1 loss tokens after the first position: each micro-batch
  # divides by 9 / 2, so the mean of the two losses divides by 9.
  np.testing.assert_allclose(micro.loss_tokens, [4.5, 4.5])
  with pytest.raises(ValueError, match='do not split into 3'):
    data_lib.micro_batches(batch, 3)


@pytest.mark.parametrize('args, message', [
    (['--batch-size', '6', '--grad-accum', '4'],
     '--grad-accum 4 does not divide --batch-size 6'),
    (['--grad-accum', '0'], '--grad-accum must be an integer >= 1, got 0'),
])
def test_grad_accum_refusals(args, message):
  with pytest.raises(flags.FinetuneError) as error:
    flags.from_command_line(args)
  assert message in str(error.value)


def _smollm2_peaks(layerwise, optimizer, batch=32, steps=4):
  """Planned peaks of SmolLM2-135M (abstract), ``batch`` x 64 tokens: as one
  batch, as ``steps`` micro-batches, and one micro-batch alone."""
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  from benchmarks import presets  # pylint: disable=g-import-not-at-top
  from examples.finetune import memory_plan  # pylint: disable=g-import-not-at-top
  from examples.finetune import optimizers  # pylint: disable=g-import-not-at-top
  from examples.finetune.model import config as config_lib  # pylint: disable=g-import-not-at-top
  from examples.finetune.model import decoder  # pylint: disable=g-import-not-at-top
  config = config_lib.ModelConfig.from_hf_config(
      presets.PRESETS['smollm2-135m'])
  model = nnx.eval_shape(lambda: decoder.DecoderLM(
      config, remat='block', scan_layers=True, rngs=nnx.Rngs(0)))
  params = memory_plan.model_params(model)
  tx = optimizers.get(optimizer).build(
      1e-3, optimizers.decoder_hints(config), optimizers.TacoSettings(), None)

  def peak(batch, steps):
    state_tx = (optax.MultiSteps(tx, steps).gradient_transformation()
                if steps > 1 and not layerwise else tx)
    state = memory_plan.tree_bytes(
        jax.eval_shape(state_tx.init, nnx.state(model, nnx.Param)))
    return memory_plan.model_peak(model, params, state, batch=batch, seq=64,
                                  layerwise=layerwise,
                                  accumulation_steps=steps)
  return peak(batch, 1), peak(batch // steps, steps), peak(batch // steps, 1)


def test_the_planner_sees_the_micro_batch():
  whole, split, small = _smollm2_peaks(True, 'taco')
  # Layer-wise: one micro-batch's activations and logits, every micro-batch's
  # layer inputs, the outer leaves' means (every token scored: the token
  # table's as its float32 accumulator, which at 8 x 64 outweighs what
  # splitting saves).
  assert small < split < whole, (small, split, whole)
  whole, split, _ = _smollm2_peaks(True, 'taco', batch=8)
  assert split > whole, (split, whole)
  whole, split, small = _smollm2_peaks(False, 'adamw')
  # MultiSteps: a micro-batch's step plus its float32 accumulator.
  assert split > small and split < whole + 4 * 135e6, (small, split, whole)


def test_memory_refusal_names_the_split(workspace):
  message = tiny_llama.memory_error(
      workspace, workspace['root'] / 'never-accum-oom', optimizer='taco',
      batch_size=8, grad_accum=4, memory_limit_gb=1e-6)
  assert message.startswith('--optimizer taco at --batch-size 8 '
                            '(--grad-accum 4) x --seq-len 24 needs about'), (
                                message)


def test_memory_refusal_plans_the_micro_batch(workspace):
  # 64 x 24 tokens: the tiny model's logits (and activations) are then large
  # enough against the planner's fixed terms to show at 3 digits.
  predicted = lambda **kw: _predicted_gb(tiny_llama.memory_error(
      workspace, workspace['root'] / 'never-accum-oom', optimizer='taco',
      batch_size=64, memory_limit_gb=1e-6, **kw))
  assert predicted(grad_accum=8) < predicted(), (predicted(grad_accum=8),
                                                 predicted())


def _predicted_gb(message):
  return float(re.search(r'needs about (\S+) GB', message).group(1))
