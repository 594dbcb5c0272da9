"""tunix's models from the installed package through the plain-loss step.

A user's loss over a tunix decoder (``nnx.split`` / ``nnx.merge`` and a
masked next-token cross-entropy, not ``taco_optax.tunix``'s trainer) given to
``layerwise.train_step(loss_fn, tx)``: with ``remat_config=DECODER`` each
decoder layer is one ``remat`` equation of the loss's jaxpr, and the step
equals ``jax.grad -> tx.update -> apply_updates`` bit for bit in float32 over
three steps, parameters and the whole optimizer state. tunix's default
``remat_config=NONE`` (no blocks), ``BLOCK`` (the attention alone is
rematerialised) and Gemma 3's mixed local and global layers are refused,
each naming what to change.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip('tunix')

from flax import nnx  # pylint: disable=g-import-not-at-top

from benchmarks import tunix_models  # pylint: disable=g-import-not-at-top
from taco_optax import layerwise  # pylint: disable=g-import-not-at-top
from tests.support import tiers  # pylint: disable=g-import-not-at-top
from tests.support import toy_lm  # pylint: disable=g-import-not-at-top

VOCAB, DIM = 256, 64


@pytest.fixture(autouse=True)
def _tunix_flags():
  with tunix_models.tunix_flags():
    yield


def _qwen3(remat, layers=2, tied=False):
  module = tunix_models.tunix_module('qwen3')
  return module.Qwen3(module.ModelConfig(
      num_layers=layers, vocab_size=VOCAB, embed_dim=DIM, hidden_dim=2 * DIM,
      num_heads=4, head_dim=DIM // 4, num_kv_heads=2, rope_theta=10_000,
      norm_eps=1e-6, use_tied_embedding=tied,
      remat_config=module.RematConfig[remat]), rngs=nnx.Rngs(0))


def _llama3(remat, layers=2):
  module = tunix_models.tunix_module('llama3')
  return module.Llama3(module.ModelConfig(
      num_layers=layers, vocab_size=VOCAB, embed_dim=DIM, hidden_dim=2 * DIM,
      num_heads=4, head_dim=DIM // 4, num_kv_heads=2, rope_theta=10_000,
      norm_eps=1e-6, weight_tying=False,
      remat_config=module.RematConfig[remat]), rngs=nnx.Rngs(0))


def _gemma(remat, layers=2):
  module = tunix_models.tunix_module('gemma')
  return module.Gemma(module.ModelConfig(
      num_layers=layers, num_embed=VOCAB, embed_dim=DIM, hidden_dim=2 * DIM,
      num_heads=4, head_dim=DIM // 4, num_kv_heads=2,
      final_logit_softcap=None, use_post_attn_norm=False,
      use_post_ffw_norm=False,
      attention_types=(module.AttentionType.GLOBAL,) * layers,
      remat_config=module.RematConfig[remat]), rngs=nnx.Rngs(0))


def _gemma3(remat, layers=2):
  # Gemma 3 cycles five local (sliding-window) layers and one global one:
  # two layers are both local.
  module = tunix_models.tunix_module('gemma3')
  return module.Gemma3(module.ModelConfig(
      num_layers=layers, num_embed=VOCAB, embed_dim=DIM, hidden_dim=2 * DIM,
      num_heads=4, head_dim=DIM // 4, num_kv_heads=2, sliding_window_size=4,
      param_dtype=jnp.float32, remat_config=module.RematConfig[remat]),
                       rngs=nnx.Rngs(0))


MODELS = {
    'qwen3': _qwen3,
    'qwen3-tied': lambda remat: _qwen3(remat, tied=True),
    'llama3': _llama3,
    'gemma': _gemma,
    'gemma3': _gemma3,
}


def _randomised(params):
  """tunix initialises some kernels (Qwen3's MLP) to zeros, so no gradient
  reaches them: each zero leaf of rank >= 2 drawn at random instead."""
  keys = iter(jax.random.split(jax.random.key(7), len(jax.tree.leaves(params))))
  return jax.tree.map(
      lambda x: (0.05 * jax.random.normal(next(keys), x.shape, x.dtype)
                 if x.ndim >= 2 and not np.asarray(x).any() else x), params)


def _user_loss(model):
  """The loss a user writes for ``jax.grad`` over a tunix decoder."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params = _randomised(params)

  def loss_fn(params, batch):
    logits, _ = nnx.merge(graphdef, params, rest)(
        batch['input_tokens'], batch['positions'], None,
        batch['attention_mask'])
    log_p = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32))
    nll = -jnp.take_along_axis(log_p, batch['input_tokens'][:, 1:, None],
                               -1)[..., 0]
    mask = batch['input_mask'][:, 1:].astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.sum(mask)

  return loss_fn, params


def _batches(steps):
  return [tunix_models.model_input(b)
          for b in tunix_models.batches(steps, vocab=VOCAB)]


@pytest.mark.parametrize('name', tiers.first_fast(sorted(MODELS),
                                                  fast=['qwen3']))
def test_equals_the_plain_optax_path_f32(name):
  model = MODELS[name]('DECODER')
  loss_fn, params = _user_loss(model)
  tx = tunix_models.taco(model)
  got = toy_lm.assert_same_runs(
      jax.jit(toy_lm.plain_step(loss_fn, tx)),
      jax.jit(layerwise.train_step(loss_fn, tx)), params, tx, _batches(3))
  # Every matrix moved: the comparison is not of untouched weights.
  moved = [bool((np.asarray(a) != np.asarray(b)).any())
           for a, b in zip(jax.tree.leaves(got[0]), jax.tree.leaves(params))
           if a.ndim >= 2]
  assert moved and all(moved), moved


def _refusal(model):
  loss_fn, params = _user_loss(model)
  with pytest.raises(ValueError) as raised:
    layerwise.layered_loss_of(loss_fn, params, _batches(1)[0])
  return str(raised.value)


def test_tunix_default_remat_none_is_refused_naming_how_to_mark_blocks():
  message = _refusal(_qwen3('NONE'))
  assert message.startswith('The layer-wise step found no blocks'), message
  assert 'nnx.remat' in message, message


def test_remat_of_the_attention_alone_is_refused():
  # BLOCK rematerialises each layer's attention only: its MLP runs between
  # the blocks.
  message = _refusal(_qwen3('BLOCK'))
  assert 'between its blocks' in message, message


def test_gemma3_local_and_global_layers_are_refused():
  # Six layers: five local (sliding-window) and a global one, whose block
  # programs differ.
  message = _refusal(_gemma3('DECODER', layers=6))
  assert 'not the same program' in message, message
