"""A token table split over its vocabulary on a mesh, updated a block of
columns at a time, against one device, bit for bit (issue 51, item 8).

Each device forms its rows of each block of the table's gradient from the
factors (``layerwise/sharded_table.py``). The tables here are larger than a
block (16 columns, 2 per block on the mesh), so a wrong block offset or a
block's rows written to another device's slice changes the weights. The
loss is elementwise in the logits, so the one-device step and the mesh step
compute every gradient entry in the same order (a softmax would sum over the
vocabulary across devices, in another order).

Like ``tests/test_sharding.py`` these run on 8 simulated CPU devices (in the
rerun of ``tests/test_multidevice.py`` unless this process has them).
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

import taco_optax
from taco_optax._src.layerwise import token_table
from tests.support import multidevice
from tests.support.bitwise import assert_bitwise_equal

NUM_DEVICES = multidevice.NUM_DEVICES
needs_mesh = multidevice.needs_devices(NUM_DEVICES)
DN = taco_optax.TacoDimensionNumbers

VOCAB, WIDTH = 64, 16
# Columns (WIDTH of them) per block: 2 on the mesh (8 rows per device).
BLOCK_ELEMENTS = 2 * VOCAB // NUM_DEVICES


def _split(table):
  try:
    spec = jax.typeof(table).sharding.spec
  except (TypeError, AttributeError):
    return False
  return bool(spec) and spec[0] == 'fsdp'


def _lookup(table, ids):
  """``table[ids]``; on the mesh each device looks up the ids it holds and
  the rows are summed (one is non-zero: exact)."""
  if not _split(table):
    return jnp.take(table, ids, axis=0)

  def local(block, ids):
    offset = ids - jax.lax.axis_index('fsdp') * block.shape[0]
    held = (offset >= 0) & (offset < block.shape[0])
    rows = jnp.take(block, jnp.clip(offset, 0, block.shape[0] - 1), axis=0)
    return jax.lax.psum(jnp.where(held[..., None], rows, 0.0), 'fsdp')

  return jax.shard_map(local, in_specs=(P('fsdp', None), P()),
                       out_specs=P())(table, ids)


def _project(features, table):
  """``features @ table.T``; on the mesh the logits come out split over the
  vocabulary, each device scoring against its rows."""
  if not _split(table):
    return features @ table.T

  def local(features, block):
    return features @ block.T

  return jax.shard_map(local, in_specs=(P(), P('fsdp', None)),
                       out_specs=P(*(None,) * (features.ndim - 1), 'fsdp'))(
      features, table)


def _loss(logits, tokens):
  # Elementwise in the logits (see the module docstring).
  weights = jnp.cos(jnp.arange(VOCAB, dtype=jnp.float32))
  del tokens
  return jnp.mean(jnp.square(logits - 0.1) * weights)


def _layer(p, hidden, tokens):
  del tokens
  return hidden + jnp.tanh(hidden @ p['w_up']) @ p['w_down']


LOSS = taco_optax.layerwise.LayeredLoss(
    embed=taco_optax.layerwise.TableLookup(
        ('embedding',), ids=lambda tokens: tokens,
        apply=lambda outer, rows, tokens: rows, gather=_lookup),
    layer=_layer,
    head=taco_optax.layerwise.TableProjection(
        ('head',), lambda outer, hidden, tokens: hidden, _loss,
        project=_project),
    scan_layers=False)


def _params():
  keys = jax.random.split(jax.random.key(0), 4)
  normal = lambda key, shape: jax.random.normal(key, shape) / shape[-1]**.5
  outer = {'embedding': normal(keys[0], (VOCAB, WIDTH)),
           'head': normal(keys[1], (VOCAB, WIDTH))}
  layers = [{'w_up': normal(keys[2], (WIDTH, 2 * WIDTH)),
             'w_down': normal(keys[3], (2 * WIDTH, WIDTH))}]
  return outer, layers


def _dims(params):
  outer, layers = params
  return ({'embedding': DN(1, 0), 'head': DN(1, 0)},
          jax.tree.map(lambda _: DN(), layers))


def _tokens(step):
  return jax.random.randint(jax.random.key(100 + step), (4, 8), 0, VOCAB)


def _run(params, steps=3):
  tx = taco_optax.taco(1e-2, k=3, mu=0.9, update_topk=1,
                       weight_dimension_numbers=_dims, rounding='nearest')
  step = jax.jit(taco_optax.layerwise.train_step(
      LOSS, tx, column_block_elements=BLOCK_ELEMENTS))
  state = tx.init(params)
  for i in range(steps):
    params, state, _ = step(params, state, _tokens(i))
  return params, state


@needs_mesh
def test_vocabulary_split_tables_in_blocks_equal_one_device(monkeypatch):
  expected = _run(_params())
  blocks = []
  counted = token_table.TableGradient.columns

  def columns(self, start, size):
    blocks.append(size)
    return counted(self, start, size)

  def no_dense(self):
    raise AssertionError('a table gradient was formed whole on the mesh')

  monkeypatch.setattr(token_table.TableGradient, 'columns', columns)
  monkeypatch.setattr(token_table.TableGradient, 'dense', no_dense)
  mesh = jax.make_mesh((NUM_DEVICES,), ('fsdp',))
  with jax.set_mesh(mesh):
    outer, layers = _params()
    outer = jax.device_put(outer, NamedSharding(mesh, P('fsdp', None)))
    got = _run((outer, layers))
  # Both tables went through blocks of 2 columns (8 blocks of their 16).
  assert blocks and set(blocks) == {2}, blocks
  assert_bitwise_equal(got, expected)
  # The tables did move.
  assert not np.array_equal(expected[0][0]['head'], _params()[0]['head'])
