"""Checkpoints: bit-exact save/restore, resume equivalence, refusal of bad ones.

The sharded round trip needs 8 host devices; as in ``test_sharding.py`` it
runs in this process under
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and otherwise
``tests/test_multidevice.py`` reruns it in a fresh process.
"""

import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import optax
import pytest

from examples.finetune import checkpoint
import taco_optax
from tests.support import multidevice
from tests.support.bitwise import assert_bitwise_equal

needs_mesh = multidevice.needs_devices(8)

METADATA = {'model': 'tiny-mlp', 'k': 4, 'learning_rate': 0.01}


# A tiny model trained with taco_optax.taco, with a deterministic data order
# and RNG that live in the checkpointed state.

NUM_EXAMPLES, BATCH = 40, 8


def dataset():
  rng = np.random.default_rng(0)
  inputs = rng.normal(size=(NUM_EXAMPLES, 8)).astype(np.float32)
  targets = rng.normal(size=(NUM_EXAMPLES, 4)).astype(np.float32)
  return inputs, targets


def make_optimizer(k=METADATA['k']):
  return taco_optax.taco(learning_rate=METADATA['learning_rate'], k=k)


def initial_state(tx):
  keys = jax.random.split(jax.random.key(1), 2)
  params = {'w1': jax.random.normal(keys[0], (8, 16)) * 0.3,
            'b1': jnp.zeros((16,)),
            'w2': jax.random.normal(keys[1], (16, 4)) * 0.3}
  return {'params': params, 'opt_state': tx.init(params),
          'data': {'epoch': np.int32(0), 'position': np.int32(0)},
          'rng': jax.random.key_data(jax.random.key(2))}


def next_batch(data, inputs, targets):
  """The batch at (epoch, position); each epoch shuffles with its own seed."""
  epoch, position = int(data['epoch']), int(data['position'])
  if position + BATCH > NUM_EXAMPLES:
    epoch, position = epoch + 1, 0
  order = np.random.default_rng(1000 + epoch).permutation(NUM_EXAMPLES)
  chosen = order[position:position + BATCH]
  data = {'epoch': np.int32(epoch), 'position': np.int32(position + BATCH)}
  return (inputs[chosen], targets[chosen]), data


def train(state, num_steps, tx):
  inputs, targets = dataset()

  @jax.jit
  def step(params, opt_state, key_data, batch):
    key, dropout_key = jax.random.split(jax.random.wrap_key_data(key_data))

    def loss(p):
      keep = jax.random.bernoulli(dropout_key, 0.9, (batch[0].shape[0], 16))
      hidden = jnp.tanh(batch[0] @ p['w1'] + p['b1']) * keep / 0.9
      return jnp.mean((hidden @ p['w2'] - batch[1]) ** 2)

    updates, opt_state = tx.update(jax.grad(loss)(params), opt_state, params)
    return (optax.apply_updates(params, updates), opt_state,
            jax.random.key_data(key))

  for _ in range(num_steps):
    batch, data = next_batch(state['data'], inputs, targets)
    params, opt_state, rng = step(state['params'], state['opt_state'],
                                  state['rng'], batch)
    state = {'params': params, 'opt_state': opt_state, 'data': data,
             'rng': rng}
  return state


def abstract_of(tree):
  return jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype
                                     if not hasattr(x, 'dtype') else x.dtype,
                                     sharding=getattr(x, 'sharding', None)),
      tree)




def restore_latest(directory, abstract_state, metadata=None):
  """Resumes as a run does: settings checked, then the arrays read."""
  run = checkpoint.RunCheckpoints(directory, metadata or METADATA,
                                  resume=True)
  return run.start_step, run.restore(abstract_state), run.resumed_from.metadata


def float8_leaves(tree):
  return [x for x in jax.tree.leaves(tree)
          if np.asarray(x).dtype == jnp.float8_e4m3fn]


def test_round_trip_is_bit_exact_including_float8(tmp_path):
  tx = make_optimizer()
  state = train(initial_state(tx), 3, tx)
  assert float8_leaves(state) and any(
      np.asarray(x).astype(np.float32).any() for x in float8_leaves(state))
  checkpoint.save(tmp_path, 3, state, METADATA)
  step, restored, metadata = restore_latest(tmp_path, abstract_of(state))
  assert step == 3 and metadata == METADATA
  assert_bitwise_equal(restored, state)


def test_resume_equals_uninterrupted_run_bitwise(tmp_path):
  tx = make_optimizer()
  uninterrupted = train(initial_state(tx), 9, tx)  # crosses an epoch at 5
  first_part = train(initial_state(tx), 4, tx)
  checkpoint.save(tmp_path, 4, first_part, METADATA)
  del first_part
  # A new process would rebuild the optimizer and the abstract state.
  tx = make_optimizer()
  abstract = jax.eval_shape(lambda: initial_state(tx))
  step, state, _ = restore_latest(tmp_path, abstract)
  resumed = train(state, 9 - step, tx)
  assert_bitwise_equal(resumed, uninterrupted)


def test_no_checkpoint(tmp_path):
  assert checkpoint.latest(tmp_path / 'absent') is None
  assert checkpoint.latest(tmp_path) is None
  with pytest.raises(checkpoint.CheckpointError, match='no checkpoint in'):
    checkpoint.RunCheckpoints(tmp_path, METADATA, resume=True)
  fresh = checkpoint.RunCheckpoints(tmp_path, METADATA, resume=False)
  assert fresh.start_step == 0 and fresh.history == {}


def test_interrupted_save_falls_back_to_latest_complete(tmp_path, monkeypatch):
  tx = make_optimizer()
  state = initial_state(tx)
  checkpoint.save(tmp_path, 1, state, METADATA)
  later = train(state, 1, tx)

  def crash(*args, **kwargs):
    raise KeyboardInterrupt('killed while writing the manifest')

  monkeypatch.setattr(checkpoint, '_file_digests', crash)
  with pytest.raises(KeyboardInterrupt):
    checkpoint.save(tmp_path, 2, later, METADATA)
  monkeypatch.undo()
  assert os.path.isdir(tmp_path / 'step_00000002.partial')
  assert checkpoint.complete_steps(tmp_path) == [1]
  step, restored, _ = restore_latest(tmp_path, abstract_of(state))
  assert step == 1
  assert_bitwise_equal(restored, state)
  # Saving step 2 again replaces the leftover partial directory.
  checkpoint.save(tmp_path, 2, later, METADATA, keep=1)
  assert checkpoint.complete_steps(tmp_path) == [2]
  assert not os.path.exists(tmp_path / 'step_00000002.partial')


def test_corrupt_checkpoint_is_refused(tmp_path):
  tx = make_optimizer()
  state = initial_state(tx)
  path = checkpoint.save(tmp_path, 5, state, METADATA)
  with open(os.path.join(path, 'manifest.json')) as f:
    files = sorted(json.load(f))
  data_file = max((os.path.join(path, name) for name in files),
                  key=os.path.getsize)
  with open(data_file, 'r+b') as f:
    f.seek(os.path.getsize(data_file) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0xFF]))
  with pytest.raises(checkpoint.CheckpointError, match='corrupt'):
    restore_latest(tmp_path, abstract_of(state))


def test_checkpoint_of_another_run_is_refused(tmp_path):
  tx = make_optimizer()
  state = initial_state(tx)
  checkpoint.save(tmp_path, 5, state, METADATA)
  with pytest.raises(checkpoint.CheckpointError,
                     match='checkpoint has k 4, this run k 8'):
    restore_latest(tmp_path, abstract_of(state), dict(METADATA, k=8))
  with pytest.raises(checkpoint.CheckpointError,
                     match='checkpoint has model tiny-mlp, this run model '
                     'other .pass --resume-allow-changes'):
    restore_latest(tmp_path, abstract_of(state), dict(METADATA, model='other'))
  # Same metadata, but the state says otherwise: k=8 history, another width.
  other_k = initial_state(make_optimizer(k=8))
  with pytest.raises(checkpoint.CheckpointError, match='does not match'):
    restore_latest(tmp_path, abstract_of(other_k))
  other_model = dict(state, params=dict(state['params'],
                                        w2=jnp.zeros((16, 5))))
  with pytest.raises(checkpoint.CheckpointError, match=r"\['w2'\]"):
    restore_latest(tmp_path, abstract_of(other_model))


def test_run_checkpoints_accept_other_settings_only_when_asked(tmp_path):
  state = initial_state(make_optimizer())
  first = checkpoint.RunCheckpoints(tmp_path, METADATA, resume=False, every=2)
  assert [first.due(step) for step in (1, 2, 3, 4)] == [False, True] * 2
  first.save(1, state, {'losses': [1.5]})
  first.check({'data': 'abc'})  # settings known later are saved as well
  first.save(2, state, {'losses': [1.5, 1.25]})
  assert checkpoint.complete_steps(tmp_path) == [1, 2]
  logged = []
  resumed = checkpoint.RunCheckpoints(
      tmp_path, dict(METADATA, learning_rate=0.1), resume=True,
      allow_changes=True, log=logged.append)
  assert resumed.start_step == 2
  assert resumed.history == {'losses': [1.5, 1.25]}
  assert logged == ['resuming with changed settings: checkpoint has '
                    'learning_rate 0.01, this run learning_rate 0.1']
  strict = checkpoint.RunCheckpoints(tmp_path, METADATA, resume=True)
  with pytest.raises(checkpoint.CheckpointError,
                     match='^checkpoint has data abc, this run data xyz '):
    strict.check({'data': 'xyz'})
  # A fresh run's first save replaces the checkpoints of the run before.
  fresh = checkpoint.RunCheckpoints(tmp_path, METADATA, resume=False)
  fresh.save(1, state, {})
  assert checkpoint.complete_steps(tmp_path) == [1]


def test_changed_settings_name_each_setting():
  stored = {'--taco-k': 16, '--lr': 1e-4, '--remat': True, '--seed': 0}
  assert checkpoint.changed_settings(stored, dict(stored)) == []
  assert checkpoint.changed_settings(
      stored, {'--taco-k': 8, '--lr': 1e-4, '--remat': False,
               '--mesh': 'data=2'}) == [
                   'checkpoint has --taco-k 16, this run --taco-k 8',
                   'checkpoint has --remat on, this run --remat off',
                   'checkpoint has --mesh <missing>, this run --mesh data=2']


def test_latest_reads_settings_and_history_without_the_arrays(tmp_path):
  tx = make_optimizer()
  state = initial_state(tx)
  history = {'losses': [0.1, 1 / 3], 'before': {'accuracy': 0.5}}
  path = checkpoint.save(tmp_path, 2, state, METADATA, history=history)
  found = checkpoint.latest(tmp_path)
  assert (found.path, found.step) == (path, 2)
  assert found.metadata == METADATA and found.history == history
  assert_bitwise_equal(checkpoint.restore(found, abstract_of(state)), state)
  # Without an abstract tree the same arrays come back, in plain containers.
  as_saved = checkpoint.restore(found)
  assert_bitwise_equal(
      sorted(np.asarray(x).tobytes() for x in jax.tree.leaves(as_saved)),
      sorted(np.asarray(x).tobytes() for x in jax.tree.leaves(state)))


def test_save_keeps_the_newest_and_drops_an_abandoned_trajectory(tmp_path):
  tx = make_optimizer()
  state = initial_state(tx)
  for step in (1, 2, 3):
    checkpoint.save(tmp_path, step, state, METADATA, keep=2)
  assert checkpoint.complete_steps(tmp_path) == [2, 3]
  os.makedirs(tmp_path / 'step_00000009.partial')  # a crash mid-save
  # A fresh run in the same folder saves step 1: steps 2 and 3 belong to the
  # run it replaces, and would otherwise be resumed from.
  checkpoint.save(tmp_path, 1, state, METADATA, keep=2)
  assert checkpoint.complete_steps(tmp_path) == [1]
  assert sorted(os.listdir(tmp_path)) == ['step_00000001']


@needs_mesh
def test_sharded_round_trip_is_bit_exact(tmp_path):
  mesh = jax.make_mesh((2, 4), ('fsdp', 'tensor'))
  layouts = {'w1': P('fsdp', 'tensor'), 'b1': P('tensor'),
             'w2': P('tensor', 'fsdp')}
  tx = make_optimizer()
  state = train(initial_state(tx), 3, tx)
  with jax.set_mesh(mesh):
    params = {n: jax.device_put(x, NamedSharding(mesh, layouts[n]))
              for n, x in state['params'].items()}
    shardings = taco_optax.state_shardings(tx, params)
    opt_state = jax.device_put(state['opt_state'], shardings)
    sharded = dict(state, params=params, opt_state=opt_state)
    checkpoint.save(tmp_path, 3, sharded, METADATA)
    _, restored, _ = restore_latest(tmp_path, abstract_of(sharded))
  assert_bitwise_equal(restored, state)
  taco_values = restored['opt_state'].inner_states['taco'].inner_state[0].values
  assert taco_values['w1'].sharding.spec == P(None, 'fsdp')
  assert restored['params']['w2'].sharding.spec == P('tensor', 'fsdp')
  # The same checkpoint restores unsharded (e.g. on one device).
  _, unsharded, _ = restore_latest(tmp_path, jax.eval_shape(lambda: state))
  assert_bitwise_equal(unsharded, state)
