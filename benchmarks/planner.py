"""Predicts the peak training memory of TACO and AdamW for a Hugging Face model.

Give a ``config.json`` (Llama, Mistral, Qwen3, OPT, GPT-NeoX) or a preset and
a batch size / sequence length; prints the predicted peak of

* TACO with the layerwise step (``taco_optax.layerwise_train_step``),
* TACO with the plain optax step (every dense gradient alive at once),
* AdamW with the plain optax step (moments in the parameter dtype, as optax
  does by default, and with float32 moments),

and whether each fits on a GPU of ``--gpu-gb`` GB. Parameter and state sizes
are exact (abstract shapes of the example's ``DecoderLM``: ``nnx.eval_shape``
and ``jax.eval_shape`` of the optimizer's ``init``); the rest is a formula
(below) whose terms were checked against XLA's compiled memory analysis of
the same step on small models (``--validate`` repeats that check).

Formula (bytes; b = parameter dtype size, B batch, T sequence, d width,
L layers, V vocabulary):

* weights ``P * b``; optimizer state exact;
* saved layer inputs (remat per layer) ``L * B * T * d * b``;
* head phase: float32 logits and their gradient ``2 * B * T * V * 4``;
* one layer's backward: its gradients ``P_layer * b`` plus its recomputed
  activations ``B * T * (4 d + 3 ffn) * b + 2 * B * heads * T^2 * 4``, plus,
  with scanned layers, a copy of that layer's weights ``P_layer * b`` (XLA
  materialises the ``dynamic_slice`` of the stacked weights that feeds the
  matmuls; seen in the CPU buffer assignment, in the forward pass too);
* the layerwise step keeps the dense gradients of the matrices the embedding
  reads (token and position tables) until the end and updates an untied LM
  head right after the head's backward; the plain step keeps every
  gradient.

  python benchmarks/planner.py --preset opt-30b --batch 4 --seq 128
  python benchmarks/planner.py --config path/to/config.json --gpu-gb 80
  python benchmarks/planner.py --validate
"""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from examples.finetune import config as config_lib
from examples.finetune import model as model_lib
import taco_optax

GB = 1e9

# Public Hugging Face config.json values (the keys the planner needs).
PRESETS = {
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

# The paper's Table 5 peak memory of TACO (SST-2), in GB.
PAPER_TABLE5_GB = {'opt-30b': 62.5, 'qwen3-32b': 70.0}


def tree_bytes(tree) -> int:
  return sum(math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(tree))


def abstract_params(config, dtype):
  """``(outer, layers)`` abstract parameter states of a scanned DecoderLM."""
  model = nnx.eval_shape(lambda: model_lib.DecoderLM(
      config, dtype=dtype, param_dtype=dtype, scan_layers=True,
      rngs=nnx.Rngs(0)))
  state = nnx.state(model, nnx.Param)
  outer = {k: v for k, v in state.items() if k != 'layers'}
  return outer, state['layers']


def plan(hf_config, *, batch, seq, dtype=jnp.bfloat16, scan_layers=True):
  """Predicted peak bytes per method, with the terms."""
  config = config_lib.ModelConfig.from_hf_config(hf_config)
  outer, layers = abstract_params(config, dtype)
  params = (outer, layers)
  itemsize = jnp.dtype(dtype).itemsize
  weights = tree_bytes(params)
  taco = taco_optax.taco(
      3e-5, weight_dimension_numbers=model_lib.taco_dimension_numbers,
      update_scale=model_lib.taco_update_scale)
  taco_state = tree_bytes(jax.eval_shape(taco.init, params))
  adamw_state = tree_bytes(jax.eval_shape(optax.adamw(1e-5).init, params))
  adamw_state_f32 = 8 * weights // itemsize
  d, ffn, heads = config.hidden_size, config.intermediate_size, config.num_heads
  num_layers = config.num_layers
  layer_bytes = tree_bytes(layers) // num_layers
  outer_matrix_bytes = sum(tree_bytes(x) for x in jax.tree.leaves(outer)
                           if len(x.shape) >= 2)
  # Gradients of matrices the embedding reads (token/position tables) are
  # complete only at the end; an untied LM head is updated right away.
  embed_matrix_bytes = sum(
      tree_bytes(outer[name]) for name in ('embed', 'positions')
      if name in outer)
  saved_inputs = num_layers * batch * seq * d * itemsize
  head_phase = 2 * batch * seq * config.vocab_size * 4
  layer_activations = (batch * seq * (4 * d + 3 * ffn) * itemsize
                       + 2 * batch * heads * seq * seq * 4)
  slice_copy = layer_bytes if scan_layers else 0
  layer_phase = layer_bytes + layer_activations + slice_copy
  layerwise = (weights + taco_state + saved_inputs
               + max(head_phase + outer_matrix_bytes,
                     layer_phase + embed_matrix_bytes))
  all_grads = weights
  plain = lambda state: (weights + state + saved_inputs + all_grads
                         + max(head_phase, layer_activations + slice_copy))
  return {
      'config': config, 'weights': weights, 'taco_state': taco_state,
      'adamw_state': adamw_state, 'saved_inputs': saved_inputs,
      'head_phase': head_phase, 'layer_phase': layer_phase,
      'outer_grads': embed_matrix_bytes,
      'peaks': {
          'taco layerwise': layerwise,
          'taco plain': plain(taco_state),
          'adamw plain': plain(adamw_state),
          'adamw plain, f32 moments': plain(adamw_state_f32),
      },
  }


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
    predicted = plan(hf, batch=4, seq=64, dtype=jnp.float32)['peaks']
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
    result = plan(hf, batch=args.batch, seq=args.seq, dtype=dtype)
    print_plan(name, result, args.gpu_gb)
    if name in PAPER_TABLE5_GB:
      paper = PAPER_TABLE5_GB[name]
      predicted = result['peaks']['taco layerwise'] / GB
      errors[name] = predicted / paper - 1
      print(f'  paper Table 5 (TACO, SST-2): {paper} GB; predicted '
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
