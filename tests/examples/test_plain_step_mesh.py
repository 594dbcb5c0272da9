"""The example's plain (optax) step on an FSDP mesh: each block's weights
gathered for its use, not all at the step's start, and the same arithmetic.

``DecoderLM`` runs its blocks through ``taco_optax.layerwise.remat_layers``
(remat on, the default policy). These run on 8 simulated CPU devices (in the
rerun of ``tests/test_multidevice.py`` unless this process has them).
"""

import contextlib

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from examples.finetune import api
from examples.finetune import data as data_lib
from examples.finetune import losses
from examples.finetune import trainers
from examples.finetune.model import decoder
from examples.finetune.model import loading
from examples.finetune.model import sharding
import taco_optax
from tests.support import multidevice
from tests.support import tiny_llama
from tests.support.bitwise import assert_bitwise_equal

needs_mesh = multidevice.needs_devices()

# A Llama whose blocks outweigh its table, so a gathered block shows.
_HF_CONFIG = {
    'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
    'vocab_size': 512, 'hidden_size': 256, 'intermediate_size': 512,
    'num_hidden_layers': 2, 'num_attention_heads': 4,
    'num_key_value_heads': 2, 'head_dim': 64, 'max_position_embeddings': 128,
    'rms_norm_eps': 1e-5, 'rope_theta': 10000.0, 'hidden_act': 'silu',
    'tie_word_embeddings': True}


def _abstract_batch(mesh, rows, length):
  spec = NamedSharding(mesh, P(sharding.BATCH_AXES))
  struct = lambda dtype: jax.ShapeDtypeStruct((rows, length), dtype,
                                              sharding=spec)
  return data_lib.Batch(struct(jnp.int32), struct(jnp.bool_),
                        struct(jnp.float32))


def _gradient_temporaries(num_layers):
  """Temporaries of the decoder's ``value_and_grad`` at fsdp=8, compiled on
  shapes (unrolled blocks, remat, float32)."""
  config = api.model_config(_HF_CONFIG, num_layers)
  mesh = sharding.make_mesh('fsdp=8')
  mesh_shape = dict(zip(mesh.axis_names, mesh.axis_sizes))
  with jax.set_mesh(mesh):
    model = api.new_decoder(config, dtype=jnp.float32, abstract=True)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(mesh, sharding.param_spec(
                decoder.path_names(path), x.shape, mesh_shape))),
        nnx.as_pure(params))
    loss = lambda params, batch: losses.completion_loss(
        nnx.merge(graphdef, params, rest), batch)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(
        params, _abstract_batch(mesh, 16, 32)).compile()
  return compiled.memory_analysis().temp_size_in_bytes


@needs_mesh
def test_plain_step_gathers_each_block_when_used():
  # With jax.checkpoint per block XLA gathered every block's weights at the
  # step's start, for the forward and again for the recomputation: each
  # extra block added 2.05 blocks of temporaries. Now it adds its saved
  # input and its input's norm (0.05 blocks measured).
  block = api.tree_bytes(nnx.state(api.new_decoder(
      api.model_config(_HF_CONFIG, 1), dtype=jnp.float32,
      abstract=True).layers[0], nnx.Param))
  shallow, deep = _gradient_temporaries(2), _gradient_temporaries(6)
  per_layer = (deep - shallow) / 4
  assert per_layer < 0.25 * block, (shallow, deep, block)


def _checkpointed_layers(layer, layers, hidden, *, scan_layers):
  """``jax.checkpoint`` per block: the plain step before ``remat_layers``."""
  layer = jax.checkpoint(layer)
  if scan_layers:
    return jax.lax.scan(lambda h, p: (layer(p, h), None), hidden, layers)[0]
  for layer_params in layers:
    hidden = layer(layer_params, hidden)
  return hidden


@pytest.fixture(scope='module')
def tiny_models(tmp_path_factory):
  root = tmp_path_factory.mktemp('plain-step')
  models = {}
  for tied in (False, True):
    models[tied] = str(root / f'tiny-llama-{tied}')
    tiny_llama.write_tiny_llama(models[tied], vocab_size=264, tied=tied)
  return models


def _batch(rows=16, length=24):
  rng = np.random.default_rng(0)
  lengths = rng.integers(length // 2, length + 1, rows)
  mask = np.arange(length)[None, :] < lengths[:, None]
  ids = np.where(mask, rng.integers(0, 256, (rows, length)), 0)
  return data_lib.Batch(ids.astype(np.int32), mask,
                        (mask & (np.arange(length) >= 4)).astype(np.float32))


def _trained(model_dir, mesh_spec, *, scan_layers, dtype, optimizer,
             accumulation_steps):
  """Losses, parameters and optimizer state after two plain steps."""
  mesh = sharding.make_mesh(mesh_spec) if mesh_spec else None
  with jax.set_mesh(mesh) if mesh else contextlib.nullcontext():
    model, _, config = loading.load_pretrained(model_dir, dtype=dtype,
                                               scan_layers=scan_layers)
    tx = (optax.adamw(1e-2) if optimizer == 'adamw' else
          api.optimizer('taco').build(1e-2, api.decoder_hints(config)))
    trainer = trainers.NnxTrainer(model, tx, needs_loss=False,
                                  accumulation_steps=accumulation_steps)
    batch = _batch()
    if mesh:
      batch = sharding.shard_batch(batch, mesh)
    losses_seen = [trainer.step(batch) for _ in range(2)]
    return losses_seen, trainer.checkpoint_tree()


def _assert_equal_but_norm_sums(got, expected):
  """Bit for bit, but for a norm scale's gradient summed over the mesh.

  On jax 0.12 XLA sums the fsdp-sharded gradient of the first block's norm
  scale in another order when the block is gathered at its use than when
  ``jax.checkpoint`` gathers it (jax 0.10.2: bit for bit). Measured: its Adam
  moments within 3.1e-7 of the leaf's largest entry (<= 38 ulp), the scale
  itself within 1 ulp. Those leaves are held to 2**-16 of the leaf's largest
  entry and 2 ulp; every other leaf, TACO's state included, bit for bit.
  """
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  loose = {}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got),
                          jax.tree.leaves(expected)):
    name = jax.tree_util.keystr(path)
    if np.asarray(a).tobytes() != np.asarray(b).tobytes() and (
        'norm' in name and name.endswith("['scale']")):
      loose[name] = (np.asarray(a, np.float64), np.asarray(b, np.float64),
                     np.asarray(b).dtype)
  blank = lambda tree: jax.tree_util.tree_map_with_path(
      lambda path, x: (jnp.zeros_like(x) if jax.tree_util.keystr(path)
                       in loose else x), tree)
  assert_bitwise_equal(blank(got), blank(expected))
  for name, (a, b, dtype) in loose.items():
    if "['mu']" in name or "['nu']" in name:
      np.testing.assert_allclose(a, b, rtol=0, err_msg=name,
                                 atol=2.0**-16 * np.abs(b).max())
    else:
      ulps = np.abs(a - b) / np.spacing(np.abs(b).astype(dtype))
      assert ulps.max() <= 2, (name, ulps.max())


@needs_mesh
@pytest.mark.parametrize('mesh_spec, scan_layers, dtype, tied, optimizer, '
                         'accumulation_steps', [
                             # The float order of the sums at fsdp=8 differs
                             # between jax versions (the bounds below).
                             pytest.param('fsdp=8', False, jnp.float32, True,
                                          'adamw', 1,
                                          marks=pytest.mark.jax_versions),
                             ('fsdp=8', True, jnp.float32, False, 'adamw', 1),
                             ('fsdp=8', False, jnp.bfloat16, False, 'adamw',
                              1),
                             ('fsdp=8', False, jnp.float32, True, 'adamw', 2),
                             pytest.param('fsdp=8', False, jnp.float32, False,
                                          'taco', 1,
                                          marks=pytest.mark.jax_versions),
                             (None, False, jnp.float32, True, 'adamw', 1)])
def test_plain_step_equals_jax_checkpoint_per_block(
    tiny_models, monkeypatch, mesh_spec, scan_layers, dtype, tied, optimizer,
    accumulation_steps):
  # The losses, the parameters and the whole optimizer state after two
  # steps, bit for bit as with jax.checkpoint per block, on one device
  # (where remat_layers is jax.checkpoint) and at fsdp=8.
  run = lambda: _trained(tiny_models[tied], mesh_spec,
                         scan_layers=scan_layers, dtype=dtype,
                         optimizer=optimizer,
                         accumulation_steps=accumulation_steps)
  got = run()
  monkeypatch.setattr(taco_optax.layerwise, 'remat_layers',
                      _checkpointed_layers)
  expected = run()
  if tied and mesh_spec and jax.__version_info__ >= (0, 12, 1):
    _assert_equal_but_tied_table_sums(got, expected, lr=1e-2)
  else:
    _assert_equal_but_norm_sums(got, expected)
  assert got[0][0] != got[0][1]  # it trained


def _assert_equal_but_tied_table_sums(got, expected, *, lr):
  """The same run up to the float order of a tied table's gradient.

  On jax 0.12.1 (not 0.10.2 or 0.12.0.1) XLA sums the two uses of a tied
  token table in another order at fsdp=8 when the blocks are gathered at
  their use, and from the second step every leaf follows at float-order
  distance. Measured (two AdamW steps at lr 1e-2): the losses bit for bit,
  the Adam moments within 3e-6 of each leaf's largest entry, the weights
  within 3.7e-6 (a few ten-thousandths of one step). A wrong gradient or a
  lost use of the table moves a weight by a whole step, lr.
  """
  assert_bitwise_equal(got[0], expected[0])  # the losses
  assert jax.tree.structure(got) == jax.tree.structure(expected)
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got[1]),
                          jax.tree.leaves(expected[1])):
    name = jax.tree_util.keystr(path)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if "['mu']" in name or "['nu']" in name:
      atol = 2.0**-16 * np.abs(b).max()
    elif "['params']" in name:
      atol = 1e-3 * lr
    else:  # step counts
      atol = 0
    np.testing.assert_allclose(a, b, rtol=0, atol=atol, err_msg=name)
