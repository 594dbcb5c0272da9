"""Predicts the peak training memory of TACO and AdamW for a Hugging Face model.

Give a ``config.json`` (Llama, Mistral, Qwen3, OPT, GPT-NeoX) or a preset and
a batch size / sequence length; prints the predicted peak of

* TACO with the layerwise step (``taco_optax.layerwise_train_step``),
* TACO with the plain optax step (every dense gradient alive at once),
* AdamW with the plain optax step (moments in the parameter dtype, as optax
  does by default, and with float32 moments),

and whether each fits on a GPU of ``--gpu-gb`` GB. The estimate is
``examples/finetune/memory_plan.py``, which the example also uses to refuse
a run that cannot fit its device; its docstring gives the formula. Parameter
and state sizes are exact; the rest was checked against XLA's compiled memory
analysis of the same step on small models (``--validate`` repeats that
check).

  python -m benchmarks.planner --preset opt-30b --batch 4 --seq 128
  python -m benchmarks.planner --config path/to/config.json --gpu-gb 80
  python -m benchmarks.planner --validate
"""

import argparse
import json

import jax.numpy as jnp

from examples.finetune import memory_plan

GB = memory_plan.GB

# Public Hugging Face config.json values (the keys the planner needs).
PRESETS = {
    'opt-13b': {
        'architectures': ['OPTForCausalLM'], 'model_type': 'opt',
        'hidden_size': 5120, 'num_hidden_layers': 40,
        'num_attention_heads': 40, 'ffn_dim': 20480, 'vocab_size': 50272,
        'max_position_embeddings': 2048, 'word_embed_proj_dim': 5120,
        'do_layer_norm_before': True, 'activation_function': 'relu',
        'enable_bias': True, 'layer_norm_elementwise_affine': True,
        'tie_word_embeddings': True, 'bos_token_id': 2, 'eos_token_id': 2,
        'pad_token_id': 1,
    },
    'opt-30b': {
        'architectures': ['OPTForCausalLM'], 'model_type': 'opt',
        'hidden_size': 7168, 'num_hidden_layers': 48,
        'num_attention_heads': 56, 'ffn_dim': 28672, 'vocab_size': 50272,
        'max_position_embeddings': 2048, 'word_embed_proj_dim': 7168,
        'do_layer_norm_before': True, 'activation_function': 'relu',
        'enable_bias': True, 'layer_norm_elementwise_affine': True,
        'tie_word_embeddings': True, 'bos_token_id': 2, 'eos_token_id': 2,
        'pad_token_id': 1,
    },
    'qwen3-32b': {
        'architectures': ['Qwen3ForCausalLM'], 'model_type': 'qwen3',
        'hidden_size': 5120, 'num_hidden_layers': 64,
        'num_attention_heads': 64, 'num_key_value_heads': 8, 'head_dim': 128,
        'intermediate_size': 25600, 'vocab_size': 151936,
        'max_position_embeddings': 40960, 'rms_norm_eps': 1e-6,
        'rope_theta': 1000000.0, 'tie_word_embeddings': False,
        'hidden_act': 'silu', 'attention_bias': False,
        'bos_token_id': 151643, 'eos_token_id': 151645,
    },
    'smollm2-135m': {
        'architectures': ['LlamaForCausalLM'], 'model_type': 'llama',
        'vocab_size': 49152, 'hidden_size': 576, 'intermediate_size': 1536,
        'num_hidden_layers': 30, 'num_attention_heads': 9,
        'num_key_value_heads': 3, 'head_dim': 64,
        'max_position_embeddings': 8192, 'rms_norm_eps': 1e-5,
        'rope_theta': 100000.0, 'tie_word_embeddings': True,
        'hidden_act': 'silu', 'bos_token_id': 0, 'eos_token_id': 0,
    },
}

# The paper's measured peak memory of TACO on SST-2, in GB (OPT-13B: Figure 4;
# OPT-30B and Qwen3-32B: Table 5).
PAPER_TABLE5_GB = {'opt-13b': 27.5, 'opt-30b': 62.5, 'qwen3-32b': 70.0}


def print_plan(name, result, gpu_gb):
  config = result['config']
  print(f'\n{name}: {config.family}, d={config.hidden_size}, '
        f'L={config.num_layers}, vocab={config.vocab_size}; weights '
        f'{result["weights"] / GB:.2f} GB, TACO state '
        f'{result["taco_state"] / GB:.3f} GB, AdamW state '
        f'{result["adamw_state"] / GB:.2f} GB')
  print(f'  terms (GB): saved inputs {result["saved_inputs"] / GB:.3f}, head '
        f'{result["head_phase"] / GB:.3f}, one layer '
        f'{result["layer_phase"] / GB:.3f}, embedding grads '
        f'{result["outer_grads"] / GB:.3f}')
  print(f'  {"method":<28}{"peak GB":>9}  fits {gpu_gb:g} GB')
  for method, peak in result['peaks'].items():
    print(f'  {method:<28}{peak / GB:>9.2f}  '
          f'{"yes" if peak <= gpu_gb * GB else "no"}')


def validate():
  """Formula vs compiled memory analysis on small models (CPU, float32)."""
  from benchmarks import memory  # pylint: disable=import-outside-toplevel
  print('\nvalidation: formula vs XLA compiled peak (float32, batch 4, seq 64)')
  print(f'  {"model":<22}{"method":<16}{"compiled MB":>12}{"formula MB":>12}'
        f'{"ratio":>7}')
  ratios = []
  for name, layers in (('smollm2-135m', None), ('opt-30b', 2)):
    hf = dict(PRESETS[name])
    if layers:
      hf['num_hidden_layers'] = layers
    _, _, rows = memory.measure(hf, dtype=jnp.float32, scan_layers=True,
                                batch=4, seq=64,
                                paths=('forward', 'taco layerwise', 'adamw'))
    predicted = memory_plan.plan(hf, batch=4, seq=64,
                                 dtype=jnp.float32)['peaks']
    for path, peak, *_ in rows[1:]:
      formula = predicted['taco layerwise' if 'taco' in path
                          else 'adamw plain']
      ratios.append(formula / peak)
      print(f'  {name + (f" L={layers}" if layers else ""):<22}{path:<16}'
            f'{peak / 1e6:>12.1f}{formula / 1e6:>12.1f}'
            f'{formula / peak:>7.3f}')
  return ratios


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', help='a Hugging Face config.json')
  parser.add_argument('--preset', choices=sorted(PRESETS), action='append')
  parser.add_argument('--batch', type=int, default=4)
  parser.add_argument('--seq', type=int, default=128)
  parser.add_argument('--dtype', default='bfloat16')
  parser.add_argument('--gpu-gb', type=float, default=80.0)
  parser.add_argument('--validate', action='store_true')
  args = parser.parse_args()
  dtype = jnp.dtype(args.dtype)
  targets = []
  if args.config:
    with open(args.config) as f:
      targets.append((args.config, json.load(f)))
  for name in args.preset or ([] if args.config else sorted(PAPER_TABLE5_GB)):
    targets.append((name, PRESETS[name]))
  errors = {}
  for name, hf in targets:
    result = memory_plan.plan(hf, batch=args.batch, seq=args.seq,
                              dtype=dtype)
    print_plan(name, result, args.gpu_gb)
    if name in PAPER_TABLE5_GB:
      paper = PAPER_TABLE5_GB[name]
      predicted = result['peaks']['taco layerwise'] / GB
      errors[name] = predicted / paper - 1
      print(f'  paper (TACO, SST-2): {paper} GB; predicted '
            f'{predicted:.1f} GB ({100 * errors[name]:+.1f}%)')
  ratios = validate() if args.validate else []
  line = ' '.join(f'{name.replace("-", "_")}_vs_paper={1 + e:.3f}'
                  for name, e in errors.items())
  if ratios:
    line += f' formula_over_compiled_max={max(ratios):.3f}'
    line += f' formula_over_compiled_min={min(ratios):.3f}'
  if line:
    print(line.strip())


if __name__ == '__main__':
  main()
