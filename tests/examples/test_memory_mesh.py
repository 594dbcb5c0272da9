"""The memory check on a mesh: the limit is all the mesh's devices together.

The mesh test runs in the 8-device rerun (``tests/multidevice.py``).
"""

import jax

from examples.finetune.model import sharding
from tests import multidevice
import test_cli  # pylint: disable=g-bad-import-order  (the tiny model writers)


@multidevice.needs_devices()
def test_limit_counts_every_device_of_the_mesh(tmp_path):
  model_dir = str(tmp_path / 'tiny-llama')
  test_cli._write_tiny_llama(model_dir, vocab_size=264)  # pylint: disable=protected-access
  records = [{'text': f'{w} day {i}', 'label': 'pos' if i % 2 else 'neg'}
             for i, w in enumerate(['good', 'bad', 'fine'] * 4)]
  workspace = {
      'model': model_dir,
      'train': test_cli._write_jsonl(tmp_path / 'train.jsonl', records),  # pylint: disable=protected-access
      'test': test_cli._write_jsonl(tmp_path / 'test.jsonl', records[:6]),  # pylint: disable=protected-access
  }
  output_dir = tmp_path / 'never-oom'
  with jax.set_mesh(sharding.make_mesh('data=2,fsdp=2,tensor=2')):
    message = test_cli._memory_error(workspace, output_dir, optimizer='adamw',  # pylint: disable=protected-access
                                     batch_size=2, memory_limit_gb=1e-6)
  assert 'the 8 devices have 8e-06 GB' in message, message
