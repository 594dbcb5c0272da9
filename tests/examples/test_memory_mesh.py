"""Memory on a mesh: the memory check's limit is all the mesh's devices
together, and no device holds the whole token table.

The mesh test runs in the 8-device rerun (``tests/support/multidevice.py``).
"""

import re

import jax
import pytest

from examples.finetune import api
from examples.finetune import memory_plan
from examples.finetune.model import sharding
from taco_optax._src.layerwise import token_table
from tests.support import multidevice
from tests.support import tiny_llama


def _workspace(tmp_path, vocab_size=264, tied=False):
  model_dir = str(tmp_path / 'tiny-llama')
  tiny_llama.write_tiny_llama(model_dir, vocab_size=vocab_size, tied=tied)
  records = [{'text': f'{w} day {i}', 'label': 'pos' if i % 2 else 'neg'}
             for i, w in enumerate(['good', 'bad', 'fine'] * 4)]
  return {
      'model': model_dir,
      'train': tiny_llama.write_jsonl(tmp_path / 'train.jsonl', records),
      'test': tiny_llama.write_jsonl(tmp_path / 'test.jsonl', records[:6]),
  }


@multidevice.needs_devices()
def test_limit_counts_every_device_of_the_mesh(tmp_path):
  workspace = _workspace(tmp_path)
  output_dir = tmp_path / 'never-oom'
  with jax.set_mesh(sharding.make_mesh('data=2,fsdp=2,tensor=2')):
    message = tiny_llama.memory_error(workspace, output_dir, optimizer='adamw',
                                      batch_size=2, memory_limit_gb=1e-6)
  assert 'the 8 devices have 8e-06 GB' in message, message


def _no_dense(self):
  raise AssertionError('the table gradient was formed dense')


_HLO_ARRAY = re.compile(r'^\s*(?:ROOT )?%[\w.\-]+ = \w+\[([\d,]*)\]')


def _vocab_sized(words, vocab):
  """The shapes, in the compiled step of the example's ``words``, with an
  axis as long as the whole vocabulary (inside fusions too)."""
  hlo = api.compile_first_step(words).compiled.as_text()
  return sorted({m.group(1) for m in map(_HLO_ARRAY.match, hlo.splitlines())
                 if m and str(vocab) in m.group(1).split(',')})


@multidevice.needs_devices()
@pytest.mark.parametrize('extra', [
    ('--mesh', 'fsdp=8'), ('--mesh', 'data=2,fsdp=2,tensor=2', 'tied'),
    ('--mesh', 'fsdp=8', '--batch-size', '8', '--grad-accum', '2'),
    ('--mesh', 'fsdp=8', '--taco-step', 'optax')])
def test_no_device_holds_the_whole_token_table(tmp_path, monkeypatch, extra):
  # The table (and an untied head) is split over the vocabulary: no buffer
  # of the step, table, gradient, logits or lookup, spans every token (a
  # table left whole, gathered for the head or the lookup, or its gradient
  # formed dense and reduced, would).
  vocab = 264
  if '--taco-step' not in extra:
    # In column blocks of 128 elements (the tiny table would fit one), the
    # layer-wise step forms each device's rows of the table's gradient a
    # block at a time, never its dense gradient, not even a shard's.
    monkeypatch.setattr(memory_plan, 'COLUMN_BLOCK_ELEMENTS', 128)
    monkeypatch.setattr(token_table.TableGradient, 'dense', _no_dense)
  tied = 'tied' in extra
  workspace = _workspace(tmp_path, vocab, tied)
  words = tiny_llama.text_args(workspace, tmp_path / 'out', '--no-checkpoint',
                               *(w for w in extra if w != 'tied'))
  assert _vocab_sized(words, vocab) == []
  if extra == ('--mesh', 'fsdp=8'):
    # The same step on one device has them (the probe sees such buffers).
    assert _vocab_sized([w for w in words if w not in extra], vocab)
