"""Export: a run's model as a Hugging Face directory or GGUF file, read back.

Round trips per family: export -> our loader -> the same logits bit for bit;
export -> ``transformers.AutoModelForCausalLM`` -> logits within the loaders'
parity tolerance; GGUF export -> ``gguf`` reader -> our loader -> the same
logits. Then the CLI: the end-of-run export, ``--eval-only``, the export and
generate commands, and their one-line refusals.
"""

import json
import os
import shutil
import subprocess
import sys

from flax import nnx
import hf_checkpoints
import jax.numpy as jnp
import numpy as np
import pytest

from examples.finetune import __main__ as cli
from examples.finetune import checkpoint as checkpoint_lib
from examples.finetune import checkpoint_files
from examples.finetune import export as export_cli
from examples.finetune import flags as flags_lib
from examples.finetune import generate as generate_cli
from examples.finetune import trained as trained_lib
from examples.finetune.model import config as config_lib
from examples.finetune.model import decoder as decoder_lib
from examples.finetune.model import gguf as gguf_lib
from examples.finetune.model import gguf_export
from examples.finetune.model import loading
from examples.finetune.model import saving
from tests.support import tiers
from tests.support import tiny_llama

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))


def _batch(vocab=128):
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, vocab, size=(2, 12)).astype(np.int32)
  mask = np.ones(tokens.shape, bool)
  mask[1, 8:] = False  # right padding
  return tokens, mask


def _logits(model, tokens, mask):
  return np.asarray(model(jnp.asarray(tokens), jnp.asarray(mask)))


@pytest.mark.parametrize('name', tiers.first_fast(
    sorted(hf_checkpoints.HF_MODELS), fast=['gpt_neox']))
def test_export_round_trips_through_our_loader_and_transformers(name,
                                                                tmp_path):
  source = str(tmp_path / 'source')
  hf_checkpoints.save_hf_model(name, source)
  _, transformers = hf_checkpoints.torch_and_transformers()
  tokens, mask = _batch()
  # float32 with listed layers (one file), bfloat16 with scanned layers
  # (sharded: a shard limit below the model's size).
  for dtype, scan_layers, shard in ((jnp.float32, False, None),
                                    (jnp.bfloat16, True, 20_000)):
    model, tokenizer, config = loading.load_pretrained(
        source, dtype=dtype, remat=None, scan_layers=scan_layers)
    target = str(tmp_path / f'export-{jnp.dtype(dtype).name}')
    saving.save_pretrained(model, tokenizer, target, source=source,
                           **({'max_shard_bytes': shard} if shard else {}))
    files = os.listdir(target)
    assert ('model.safetensors.index.json' in files) == bool(shard), files
    assert not os.path.exists(target + saving.PARTIAL)
    again, _, again_config = loading.load_pretrained(
        target, dtype=dtype, remat=None, scan_layers=scan_layers)
    assert again_config == config
    ours = _logits(model, tokens, mask)
    np.testing.assert_array_equal(_logits(again, tokens, mask), ours)
    reference = hf_checkpoints.reference_logits(
        transformers.AutoModelForCausalLM.from_pretrained(target).float(),
        tokens, mask)
    if dtype == jnp.float32:  # the tolerance of test_loading's parity test
      np.testing.assert_allclose(
          ours[mask], reference[mask], rtol=1e-4,
          atol=1e-4 * np.abs(reference[mask]).max())
    else:  # bf16 activations: ~1% of the largest logit (test_loading)
      error = np.abs(ours - reference)[mask].max() / np.abs(
          reference[mask]).max()
      assert error < 5e-2, error


@pytest.mark.parametrize('family', config_lib.FAMILIES)
def test_built_config_json_reads_back_to_the_same_config(family):
  config = config_lib.ModelConfig.tiny(family)
  assert config_lib.ModelConfig.from_hf_config(
      saving.hf_config(config, 'float32')) == config


def _gguf_tokenizer():
  import tokenizers  # pylint: disable=g-import-not-at-top
  alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
  return gguf_lib.gguf_tokenizer({
      'tokenizer.ggml.model': 'gpt2', 'tokenizer.ggml.pre': 'smollm',
      'tokenizer.ggml.tokens': alphabet + ['<s>', '</s>', 'Ġt'],
      'tokenizer.ggml.merges': ['Ġ t'],
      'tokenizer.ggml.token_type': [1] * 256 + [3, 3, 1]})


def _tiny_llama(**overrides):
  config = config_lib.ModelConfig.tiny(
      'llama', vocab_size=259, bos_token_id=256, eos_token_id=257,
      **overrides)
  return decoder_lib.DecoderLM(config, dtype=jnp.float32,
                               param_dtype=jnp.float32, remat=None,
                               rngs=nnx.Rngs(3))


@pytest.mark.parametrize('tied', [False, True])
def test_gguf_export_round_trips(tmp_path, tied):
  pytest.importorskip('gguf', reason='GGUF tests need: pip install gguf')
  model, tokenizer = _tiny_llama(tie_word_embeddings=tied), _gguf_tokenizer()
  tokens, mask = _batch(259)
  ours = _logits(model, tokens, mask)
  for tensor_type, tolerance in (('f32', 0.0), ('f16', 5e-3),
                                 ('bf16', 3e-2)):
    path = str(tmp_path / f'model-{tensor_type}.gguf')
    gguf_export.save_gguf(model, tokenizer, path, tensor_type=tensor_type)
    again, again_tokenizer, config = loading.load_pretrained(
        path, dtype=jnp.float32, remat=None)
    assert config.tie_word_embeddings == tied
    logits = _logits(again, tokens, mask)
    if tolerance == 0.0:  # float32: the Q/K rotary order put back exactly
      np.testing.assert_array_equal(logits, ours)
    else:
      error = np.abs(logits - ours)[mask].max() / np.abs(ours[mask]).max()
      assert 0 < error < tolerance, (tensor_type, error)
    assert (again_tokenizer.encode('it 12 <s>').ids
            == tokenizer.encode('it 12 <s>').ids)


def test_gguf_source_exports_a_directory_transformers_reads(tmp_path):
  """A GGUF-sourced model (as the default SmolLM2): config.json built from
  the GGUF metadata, tokenizer.json from its vocabulary and merges, its chat
  template carried into tokenizer_config.json."""
  pytest.importorskip('gguf', reason='GGUF tests need: pip install gguf')
  _, transformers = hf_checkpoints.torch_and_transformers()
  path = str(tmp_path / 'source.gguf')
  template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
  gguf_export.save_gguf(_tiny_llama(tie_word_embeddings=True),
                        _gguf_tokenizer(), path, chat_template=template)
  model, tokenizer, _ = loading.load_pretrained(path, dtype=jnp.float32,
                                                remat=None)
  target = str(tmp_path / 'hf')
  saving.save_pretrained(model, tokenizer, target, source=path)
  config = hf_checkpoints.read_config(target)
  assert config['architectures'] == ['LlamaForCausalLM']
  assert config['tie_word_embeddings'] and config['torch_dtype'] == 'float32'
  with open(os.path.join(target, 'tokenizer_config.json')) as f:
    assert json.load(f)['chat_template'] == template
  tokens, mask = _batch(259)
  ours = _logits(model, tokens, mask)
  np.testing.assert_array_equal(_logits(loading.load_pretrained(
      target, dtype=jnp.float32, remat=None)[0], tokens, mask), ours)
  reference = hf_checkpoints.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(target), tokens, mask)
  np.testing.assert_allclose(ours[mask], reference[mask], rtol=1e-4,
                             atol=1e-4 * np.abs(reference[mask]).max())
  hf_tokenizer = transformers.AutoTokenizer.from_pretrained(target)
  assert (hf_tokenizer('it 12 <s>')['input_ids']
          == tokenizer.encode('it 12 <s>').ids)


def test_gguf_export_refuses_other_families(tmp_path):
  model = decoder_lib.DecoderLM(config_lib.ModelConfig.tiny('qwen3'),
                                rngs=nnx.Rngs(0))
  path = tmp_path / 'x.gguf'
  with pytest.raises(saving.ExportError, match='the qwen3 family'):
    gguf_export.save_gguf(model, _gguf_tokenizer(), str(path))
  assert not os.listdir(tmp_path)


def test_export_refuses_a_folder_that_is_not_empty(tmp_path):
  (tmp_path / 'out').mkdir()
  (tmp_path / 'out' / 'keep.txt').write_text('mine')
  with pytest.raises(saving.ExportError, match='exists and is not empty'):
    saving.save_pretrained(_tiny_llama(), _gguf_tokenizer(),
                           str(tmp_path / 'out'))
  assert sorted(os.listdir(tmp_path)) == ['out']
  assert os.listdir(tmp_path / 'out') == ['keep.txt']


# The command line, on the tiny Hugging Face llama of tests/support/tiny_llama.

@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """A 3-step TACO run with its end-of-run export."""
  root = tmp_path_factory.mktemp('export')
  model_dir = str(root / 'tiny-llama')
  tiny_llama.write_tiny_llama(model_dir, vocab_size=264)
  records = [{'text': f'{w} day {i}', 'label': 'pos' if i % 2 else 'neg'}
             for i, w in enumerate(['good', 'bad', 'fine', 'awful'] * 4)]
  data = str(root / 'data.jsonl')
  with open(data, 'w') as f:
    f.writelines(json.dumps(r) + '\n' for r in records)
  task = ['--task', 'text', '--train-file', data, '--test-file', data,
          '--label-words', 'neg=bad,pos=good', '--template', '{text}. It was',
          '--seq-len', '24', '--eval-size', '8', '--eval-batch-size', '4',
          '--no-progress']
  output_dir = root / 'run'
  assert cli.main(['--model', model_dir, *task, '--steps', '3',
                   '--batch-size', '2', '--lr', '3e-2',
                   '--output-dir', str(output_dir)]) == 0
  with open(output_dir / 'results.json') as f:
    results = json.load(f)
  return {'root': root, 'source': model_dir, 'task': task,
          'output_dir': output_dir, 'results': results}


def _eval_only(run_, model, capsys):
  capsys.readouterr()
  assert cli.main(['--model', str(model), *run_['task'], '--eval-only']) == 0
  return capsys.readouterr().out


def test_run_exports_a_model_that_transformers_loads(run):
  exported = run['output_dir'] / 'model'
  assert run['results']['exported_to'] == str(exported)
  assert sorted(os.listdir(exported)) == [
      'config.json', 'generation_config.json', 'model.safetensors',
      'tokenizer.json', 'tokenizer_config.json']
  _, transformers = hf_checkpoints.torch_and_transformers()
  model = transformers.AutoModelForCausalLM.from_pretrained(str(exported))
  tokenizer = transformers.AutoTokenizer.from_pretrained(str(exported))
  ids = tokenizer('good day', return_tensors='pt')
  out = model.generate(**ids, max_new_tokens=4, do_sample=False)
  assert out.shape[1] == ids['input_ids'].shape[1] + 4
  # The trained weights, not the source's: the checkpoint's, by name.
  trained = trained_lib.load(str(run['output_dir']))
  ours = loading.load_pretrained(str(exported), dtype=jnp.float32,
                                 remat=None)[0]
  tokens, mask = _batch(264)
  np.testing.assert_array_equal(_logits(ours, tokens, mask),
                                _logits(trained.model, tokens, mask))
  source = loading.load_pretrained(run['source'], dtype=jnp.float32,
                                   remat=None)[0]
  assert not np.array_equal(_logits(source, tokens, mask),
                            _logits(ours, tokens, mask))


def test_eval_only_reproduces_the_runs_metric(run, capsys):
  after = run['results']['after']['accuracy']
  step = checkpoint_lib.latest(str(run['output_dir'] / 'checkpoints')).path
  for model in (run['output_dir'] / 'model', run['output_dir'], step):
    out = _eval_only(run, model, capsys)
    assert f'held-out accuracy {after:.4f}' in out, out
    assert f'the run recorded accuracy {after:.4f}' in out, out


def test_export_command_and_generate(run, capsys):
  target = run['root'] / 'exported-again'
  assert export_cli.main([str(run['output_dir']), '--to', str(target)]) == 0
  for name in ('model.safetensors', 'config.json'):
    with open(target / name, 'rb') as a, open(
        run['output_dir'] / 'model' / name, 'rb') as b:
      assert a.read() == b.read(), name
  capsys.readouterr()
  assert generate_cli.main([str(target), '--prompt', 'good day',
                            '--max-new-tokens', '3']) == 0
  assert capsys.readouterr().out.startswith('good day')


def _refusal(module, args):
  process = subprocess.run(
      [sys.executable, '-m', module, *args], cwd=_REPO_ROOT,
      capture_output=True, text=True, timeout=120,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  lines = process.stderr.strip().splitlines()
  assert process.returncode == 2 and len(lines) == 1, process.stderr
  return lines[0]


def test_refusals_are_one_line_and_write_nothing(run, tmp_path):
  occupied = tmp_path / 'occupied'
  occupied.mkdir()
  (occupied / 'x').write_text('x')
  line = _refusal('examples.finetune.export',
                  [str(run['output_dir']), '--to', str(occupied)])
  assert 'exists and is not empty' in line
  bare = tmp_path / 'bare-run'
  bare.mkdir()
  (bare / 'results.json').write_text('{}')
  line = _refusal('examples.finetune.export',
                  [str(bare), '--to', str(tmp_path / 'a')])
  assert 'run without checkpoints' in line
  line = _refusal('examples.finetune',
                  ['--model', run['source'], *run['task'], '--steps', '1',
                   '--output-dir', str(tmp_path / 'r'),
                   '--export-dir', str(occupied)])
  assert line.startswith('error: --export-dir: ') and 'not empty' in line
  other = tmp_path / 'qwen3'
  hf_checkpoints.save_hf_model('qwen3', str(other))
  line = _refusal('examples.finetune.export',
                  [str(other), '--gguf', str(tmp_path / 'q.gguf')])
  assert 'the qwen3 family' in line
  assert sorted(os.listdir(tmp_path)) == ['bare-run', 'occupied', 'qwen3']


def _run_with_edited_checkpoint(run, copy, edit):
  """A copy of the run whose latest checkpoint.json is ``edit(info)``, its
  manifest rewritten to match (so only the edit is what is refused)."""
  shutil.copytree(run['output_dir'], copy)
  found = checkpoint_lib.latest(str(copy / 'checkpoints'))
  info_path = os.path.join(found.path, 'checkpoint.json')
  with open(info_path) as f:
    info = json.load(f)
  checkpoint_files.write_json(info_path, edit(info))
  checkpoint_files.write_json(os.path.join(found.path, 'manifest.json'),
                              checkpoint_files.file_digests(found.path))
  return copy


def test_checkpoint_of_another_model_is_refused_in_one_line(run, tmp_path):
  """A run whose checkpoint names another model file (here one with
  another vocabulary): refused by the first parameter that differs."""
  other_model = str(tmp_path / 'other-llama')
  tiny_llama.write_tiny_llama(other_model, vocab_size=300)
  def other_model_file(info):
    info['metadata']['model file'] = other_model
    return info

  copy = _run_with_edited_checkpoint(run, tmp_path / 'run', other_model_file)
  line = _refusal('examples.finetune.export',
                  [str(copy), '--to', str(tmp_path / 'out')])
  assert 'embed/embedding of shape (264, 32)' in line, line
  assert 'another model' in line
  assert not os.path.exists(tmp_path / 'out')


def test_checkpoint_of_another_model_is_refused_by_name(run):
  found = checkpoint_lib.latest(str(run['output_dir'] / 'checkpoints'))
  other = _tiny_llama()  # vocabulary 259, not the run's 264
  tree = checkpoint_lib.restore(found)
  with pytest.raises(flags_lib.FinetuneError,
                     match='embed/embedding of shape'):
    trained_lib.put_params(other, checkpoint_lib.named_params(found, tree),
                           found.path)


def test_positional_checkpoint_still_reads_by_its_layout(run):
  """Format 2 stored the layer-wise trainer's (outer, layers) by position."""
  found = checkpoint_lib.latest(str(run['output_dir'] / 'checkpoints'))
  tree = checkpoint_lib.restore(found)
  named = tree['params']
  layers = named['layers']
  old = {'params': {'0': {k: v for k, v in named.items() if k != 'layers'},
                    '1': [layers[str(i)] for i in range(len(layers))]}}
  old_checkpoint = found._replace(format=2)
  model = trained_lib.load(run['source']).model
  trained_lib.put_params(
      model, checkpoint_lib.named_params(old_checkpoint, old), 'old')
  expected = trained_lib.load(str(run['output_dir'])).model
  tokens, mask = _batch(264)
  np.testing.assert_array_equal(_logits(model, tokens, mask),
                                _logits(expected, tokens, mask))


def test_positional_checkpoint_refuses_to_resume_in_one_line(run, tmp_path,
                                                              capsys):
  copy = _run_with_edited_checkpoint(run, tmp_path / 'old-run',
                                     lambda info: {**info, 'format': 2})
  capsys.readouterr()
  assert cli.main(['--model', run['source'], *run['task'], '--steps', '4',
                   '--batch-size', '2', '--lr', '3e-2', '--resume',
                   '--resume-allow-changes', '--output-dir', str(copy)]) == 2
  line, = capsys.readouterr().err.strip().splitlines()
  assert 'has format 2' in line and 'examples.finetune.export' in line


def test_docs_transformers_example_runs_on_a_runs_export(run, capsys):
  from tests.support import docs_pages  # pylint: disable=g-import-not-at-top
  hf_checkpoints.torch_and_transformers()
  block = docs_pages.block('docs/example.md', 'AutoModelForCausalLM')
  assert "model_dir = 'runs/taco/model'" in block
  block = block.replace("'runs/taco/model'",
                        repr(str(run['output_dir'] / 'model')))
  capsys.readouterr()
  exec(block, {})  # pylint: disable=exec-used
  assert capsys.readouterr().out.startswith('The capital of France is')


@pytest.mark.long
def test_bf16_scanned_run_exports_bf16_that_transformers_reads(run, tmp_path):
  """--dtype bfloat16 (TACO: bf16 weights, stochastic rounding) with
  scanned layers: the export is bfloat16, one tensor per layer."""
  output_dir = tmp_path / 'bf16'
  assert cli.main(['--model', run['source'], *run['task'], '--steps', '2',
                   '--batch-size', '2', '--dtype', 'bfloat16',
                   '--scan-layers', 'on', '--output-dir',
                   str(output_dir)]) == 0
  exported = str(output_dir / 'model')
  config = hf_checkpoints.read_config(exported)
  assert config['torch_dtype'] == 'bfloat16'
  with open(os.path.join(exported, 'model.safetensors'), 'rb') as f:
    header = json.loads(f.read(int.from_bytes(f.read(8), 'little')))
  assert header['model.layers.1.self_attn.q_proj.weight']['dtype'] == 'BF16'
  # The checkpoint's weights, read by name, are the export's.
  trained = trained_lib.load(str(output_dir))
  ours = loading.load_pretrained(exported, dtype=jnp.bfloat16, remat=None,
                                 scan_layers=True)[0]
  tokens, mask = _batch(264)
  np.testing.assert_array_equal(_logits(ours, tokens, mask),
                                _logits(trained.model, tokens, mask))
  # transformers in float32 on the bf16 weights, against ours in float32.
  _, transformers = hf_checkpoints.torch_and_transformers()
  reference = hf_checkpoints.reference_logits(
      transformers.AutoModelForCausalLM.from_pretrained(exported).float(),
      tokens, mask)
  ours = _logits(loading.load_pretrained(exported, dtype=jnp.float32,
                                         remat=None)[0], tokens, mask)
  np.testing.assert_allclose(ours[mask], reference[mask], rtol=1e-4,
                             atol=1e-4 * np.abs(reference[mask]).max())
