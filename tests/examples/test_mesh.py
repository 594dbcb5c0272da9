"""``--mesh``: the fine-tuning example on a simulated 8-device CPU mesh.

Tests marked ``needs_mesh`` run in a subprocess with 8 host devices (see
``tests/support/multidevice.py``); the rest run in the one-device suite.
"""

import json

from flax import nnx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import checkpoint
from examples.finetune import data as data_lib
from examples.finetune import resume
from examples.finetune.model import loading
from examples.finetune.model import sharding
from tests.support import multidevice
from tests.support import tiny_llama

NUM_DEVICES = 8
MESH = 'data=2,fsdp=2,tensor=2'
needs_mesh = multidevice.needs_devices(NUM_DEVICES)


_MESH_SHAPE = {'data': 2, 'fsdp': 2, 'tensor': 2}


@pytest.mark.parametrize('names, shape, tied, spec', [
    (('layers', '0', 'attn', 'q', 'kernel'), (32, 64), False,
     P('fsdp', 'tensor')),
    (('layers', 'mlp', 'down', 'kernel'), (4, 48, 32), False,
     P(None, 'tensor', 'fsdp')),  # scanned: the layer axis stays whole
    (('layers', 'attn', 'qkv', 'kernel'), (4, 32, 3, 64), False,
     P(None, 'fsdp', None, 'tensor')),
    # Token tables: the vocabulary over fsdp x tensor, d whole.
    (('lm_head', 'kernel'), (32, 260), False, P(None, ('fsdp', 'tensor'))),
    (('embed', 'embedding'), (260, 32), False, P(('fsdp', 'tensor'), None)),
    (('embed', 'embedding'), (260, 32), True, P(('fsdp', 'tensor'), None)),
    (('positions', 'embedding'), (130, 32), True, P('tensor', 'fsdp')),
    (('final_norm', 'scale'), (32,), False, P()),
    (('layers', '1', 'attn', 'q', 'bias'), (64,), False, P()),
])
def test_parameter_sharding_rule(names, shape, tied, spec):
  assert sharding.param_spec(names, shape, _MESH_SHAPE, tied) == spec


@pytest.mark.parametrize('names, shape', [
    (('lm_head', 'kernel'), (32, 258)), (('embed', 'embedding'), (257, 32))])
def test_a_vocabulary_the_mesh_does_not_divide_is_refused(names, shape):
  with pytest.raises(sharding.MeshError, match='not divisible by the 4 '
                     'devices of mesh axes fsdpxtensor') as error:
    sharding.param_spec(names, shape, _MESH_SHAPE)
  assert len(str(error.value).splitlines()) == 1


@pytest.mark.parametrize('mesh, message', [
    ('data=3', 'has 3 devices but JAX sees'),
    ('data=2,data=4', 'given twice'),
    ('model=8', 'expected NAME=SIZE'),
    ('data=two', 'expected NAME=SIZE'),
    ('fsdp=0,data=8', 'size >= 1'),
])
def test_bad_mesh_is_a_one_line_error(mesh, message, capsys):
  assert cli.main(['--mesh', mesh]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith('error: --mesh') and message in err, err
  assert len(err.splitlines()) == 1


@needs_mesh
def test_loaded_model_and_batch_are_split_over_the_mesh(workspace):
  mesh = sharding.make_mesh(MESH)
  with jax.set_mesh(mesh):
    model, _, _ = loading.load_pretrained(workspace['model'],
                                          dtype=jnp.float32)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    specs = jax.tree.map(lambda x: x.sharding.spec, params)
    block = specs['layers'][0]
    assert block['attn']['q']['kernel'] == P('fsdp', 'tensor')
    assert block['mlp']['down']['kernel'] == P('tensor', 'fsdp')
    assert specs['embed']['embedding'] == P(('fsdp', 'tensor'), None)
    assert specs['final_norm']['scale'] == P()
    batch = sharding.shard_batch(
        data_lib.Batch(np.zeros((4, 8), np.int32), np.ones((4, 8), bool),
                       np.ones((4, 8), np.float32)), mesh)
    assert batch.input_ids.sharding.spec == P(('data', 'fsdp'))
    # The model runs on the explicit mesh, batch split or not.
    logits = nnx.jit(lambda m, b: m(b.input_ids, b.attention_mask))(model,
                                                                    batch)
    assert logits.shape == (4, 8, 264)
    assert logits.sharding.spec == P(('data', 'fsdp'), None, None)


@needs_mesh
def test_a_tied_embedding_is_split_like_any_embedding(tied_model):
  with jax.set_mesh(sharding.make_mesh(MESH)):
    model, _, config = loading.load_pretrained(tied_model, dtype=jnp.float32)
    assert config.tie_word_embeddings and not hasattr(model, 'lm_head')
    assert model.embed.embedding[...].sharding.spec == P(('fsdp', 'tensor'),
                                                         None)


def _run(workspace, name, *extra):
  output_dir = workspace['root'] / name
  assert cli.main(tiny_llama.text_args(workspace, output_dir, *extra)) == 0
  with open(output_dir / 'results.json') as f:
    return json.load(f)


def _final_state(workspace, name):
  """The arrays of a run's last checkpoint: params and optimizer state."""
  directory = resume.checkpoint_dir(str(workspace['root'] / name))
  saved = checkpoint.latest(directory)
  assert saved is not None and saved.step == 3, directory
  return {jax.tree_util.keystr(path): np.asarray(leaf) for path, leaf in
          jax.tree_util.tree_flatten_with_path(checkpoint.restore(saved))[0]}


@pytest.fixture(scope='module')
def tied_model(workspace):
  """A tiny Llama whose output projection is its token embedding."""
  directory = str(workspace['root'] / 'tiny-llama-tied')
  tiny_llama.write_tiny_llama(directory, vocab_size=264, tied=True)
  return directory


@pytest.fixture(scope='module')
def opt_model(workspace):
  """A tiny OPT (learned positions, biases, LayerNorm) saved by transformers.
  """
  import hf_checkpoints  # pylint: disable=g-import-not-at-top
  directory = str(workspace['root'] / 'tiny-opt')
  hf_checkpoints.save_hf_model('opt', directory)
  return directory


# One run per path through the CLI on a mesh, each feature in one of them:
# the tied table split over the mesh with scanned layers and micro-batches of
# 4 split over the batch axes (data x fsdp); OPT, whose position table is
# split over both axes and gathered for the lookup (the vocabulary-split
# lookup refused it). The default run on this mesh against one device is
# tests/examples/test_multiprocess_cli.py's (its one-process run); the optax
# path's step on a mesh: compiled by the CLI with no buffer the vocabulary
# long (tests/examples/test_memory_mesh.py), equal to one device
# (test_taco_alias_train_step_on_mesh_matches_single_device,
# tests/test_sharding.py) and to jax.checkpoint per block at fsdp=8
# (tests/examples/test_plain_step_mesh.py). The same steps are compared with
# one device below the CLI, on fsdp=8 meshes: the layer-wise step, scanned or
# not (tests/test_sharding.py, tests/test_auto_mesh.py), the example's plain
# step with AdamW, scan, bfloat16, a tied table and accumulation
# (tests/examples/test_plain_step_mesh.py), micro-batches kept whole when
# they do not divide the batch axes
# (test_micro_batches_keep_rows_over_the_batch_axes, below).
@needs_mesh
@pytest.mark.parametrize('extra', [('tied', '--scan-layers', 'on',
                                    '--batch-size', '8', '--grad-accum', '2'),
                                   ('opt',)])
def test_cli_on_a_mesh_matches_one_device(workspace, tied_model, opt_model,
                                          extra):
  one_device, mesh = ('one-device-' + '-'.join(extra),
                      'mesh-' + '-'.join(extra))
  if extra[:1] == ('tied',):  # the tied table is split over the mesh too
    extra = ('--model', tied_model) + extra[1:]
  if extra[:1] == ('opt',):
    extra = ('--model', opt_model) + extra[1:]
  expected = _run(workspace, one_device, *extra)
  got = _run(workspace, mesh, '--mesh', MESH, *extra)
  assert len(got['losses']) == 3
  # Sharded matmuls sum in another order: last-bit differences only.
  np.testing.assert_allclose(got['losses'], expected['losses'], rtol=1e-5)
  assert got['optimizer_state_bytes'] == expected['optimizer_state_bytes']
  tiny_llama.assert_state_equal_up_to_sum_order(
      _final_state(workspace, mesh), _final_state(workspace, one_device))


@needs_mesh
@pytest.mark.parametrize('mesh_spec', ['fsdp=8', 'data=2,fsdp=4'])
@pytest.mark.parametrize('rows, count', [(8, 2), (16, 2), (8, 4), (16, 8)])
def test_micro_batches_keep_rows_over_the_batch_axes(mesh_spec, rows, count):
  # Fewer micro-batches than batch devices: a plain reshape would have to
  # put the rows' devices on the micro-batch axis (fsdp=8, 2 micro-batches
  # failed to trace before).
  mesh = sharding.make_mesh(mesh_spec)
  host = np.arange(rows * 3, dtype=np.int32).reshape(rows, 3)
  with jax.set_mesh(mesh):
    x = sharding.shard_batch(data_lib.Batch(host, host > 0,
                                            host.astype(np.float32)), mesh)
    split = jax.jit(lambda b: data_lib.micro_batches(b, count))(x)
  entry = x.input_ids.sharding.spec[0]
  assert entry == sharding.BATCH_AXES
  # Each micro-batch's rows over the batch axes when they divide them, else
  # whole (as shard_batch leaves a batch they do not divide).
  want = entry if (rows // count) % 8 == 0 else None
  for got, whole in ((split.input_ids, x.input_ids),
                     (split.attention_mask, x.attention_mask),
                     (split.loss_mask, x.loss_mask)):
    np.testing.assert_array_equal(
        np.asarray(got), np.asarray(whole).reshape((count, -1, 3)))
    assert tuple(got.sharding.spec)[:2] == (None, want), got.sharding.spec


@needs_mesh
def test_export_from_a_mesh_writes_the_gathered_model(workspace, tmp_path):
  """Split parameters (FSDP x tensor, the vocabulary over both) are gathered
  and written as the unsplit model's bytes."""
  from examples.finetune.model import saving  # pylint: disable=g-import-not-at-top
  model, tokenizer, _ = loading.load_pretrained(workspace['model'],
                                                dtype=jnp.float32)
  saving.save_pretrained(model, tokenizer, str(tmp_path / 'one'),
                         source=workspace['model'])
  with jax.set_mesh(sharding.make_mesh(MESH)):
    split, tokenizer, _ = loading.load_pretrained(workspace['model'],
                                                  dtype=jnp.float32)
    table = nnx.state(split, nnx.Param)['embed']['embedding'][...]
    assert not table.sharding.is_fully_replicated
    saving.save_pretrained(split, tokenizer, str(tmp_path / 'mesh'),
                           source=workspace['model'])
  for name in ('model.safetensors', 'config.json', 'tokenizer.json'):
    assert ((tmp_path / 'mesh' / name).read_bytes()
            == (tmp_path / 'one' / name).read_bytes()), name
