"""Predicts the peak training memory of TACO and AdamW for a Hugging Face model.

Give a ``config.json`` (Llama, Mistral, Qwen3, OPT, GPT-NeoX) or a preset and
a batch size / sequence length; :func:`plan` predicts the peak of

* TACO with the layerwise step (``taco_optax.layerwise.train_step``),
* TACO with the plain optax step (every dense gradient alive at once),
* AdamW with the plain optax step (moments in the parameter dtype, as optax
  does by default, and with float32 moments),

and the script prints whether each fits on a GPU of ``--gpu-gb`` GB. The
formula is ``examples/finetune/memory_plan.py``'s, which the example also uses
to refuse a run that cannot fit its device; its docstring gives it. Parameter
and state sizes are exact; the rest was checked against XLA's compiled memory
analysis of the same step on small models (``--validate`` repeats that
check).

  python -m benchmarks.planner --preset opt-30b --batch 4 --seq 128
  python -m benchmarks.planner --config path/to/config.json --gpu-gb 80
  python -m benchmarks.planner --validate
"""

import argparse
import json

import jax
import jax.numpy as jnp
import optax

from benchmarks import memory
from benchmarks import presets
from examples.finetune import api

GB = api.GB


def plan(hf_config, *, batch, seq, dtype=jnp.bfloat16, scan_layers=True,
         remat=True):
  """Predicted peak bytes of TACO and AdamW for a Hugging Face config.

  Args:
    hf_config: a ``config.json`` as a dict.
    batch: sequences per step.
    seq: tokens per sequence.
    dtype: parameter (and compute) dtype.
    scan_layers: stacked layers (``lax.scan``) or unrolled ones.
    remat: recompute each block in the backward pass of the plain step.

  Returns:
    A dict of the model ``config``, the bytes of ``weights``, ``taco_state``,
    ``adamw_state``, ``saved_inputs``, ``head_phase``, ``layer_phase``,
    ``position_grads``, and ``peaks``: predicted peak bytes per method.
  """
  config = api.model_config(hf_config)
  formula = api.plan_memory(config, dtype=dtype, batch=batch, seq=seq,
                            scan_layers=scan_layers, remat=remat)
  plan_terms, params = formula.terms, formula.params
  taco = api.optimizer('taco').build(3e-5, api.decoder_hints(config))
  taco_state = api.tree_bytes(jax.eval_shape(taco.init, params))
  adamw_state = api.tree_bytes(
      jax.eval_shape(optax.adamw(1e-5).init, params))
  adamw_state_f32 = 8 * plan_terms.weights // jnp.dtype(dtype).itemsize
  return {
      'config': config, 'weights': plan_terms.weights,
      'taco_state': taco_state, 'adamw_state': adamw_state,
      'saved_inputs': plan_terms.saved_inputs,
      'head_phase': plan_terms.head_phase,
      'layer_phase': plan_terms.layer_phase,
      'position_grads': plan_terms.embed_matrix_grads,
      'peaks': {
          'taco layerwise': formula.layerwise_peak(taco_state),
          'taco plain': formula.plain_peak(taco_state),
          'adamw plain': formula.plain_peak(adamw_state),
          'adamw plain, f32 moments': formula.plain_peak(adamw_state_f32),
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
        f'{result["layer_phase"] / GB:.3f}, position-table grads '
        f'{result["position_grads"] / GB:.3f}')
  print(f'  {"method":<28}{"peak GB":>9}  fits {gpu_gb:g} GB')
  for method, peak in result['peaks'].items():
    print(f'  {method:<28}{peak / GB:>9.2f}  '
          f'{"yes" if peak <= gpu_gb * GB else "no"}')


def validate():
  """Formula vs compiled memory analysis on small models (CPU, float32), with
  and without remat, stacked and unrolled layers."""
  print('\nvalidation: formula vs XLA compiled peak (float32, batch 4, seq 64)')
  print(f'  {"model":<22}{"layers":<10}{"remat":<7}{"method":<16}'
        f'{"compiled MB":>12}{"formula MB":>12}{"ratio":>7}')
  ratios = []
  for name, layers in (('smollm2-135m', None), ('opt-30b', 2)):
    hf = dict(presets.PRESETS[name])
    if layers:
      hf['num_hidden_layers'] = layers
    label = name + (f' L={layers}' if layers else '')
    for scan_layers, remat in ((True, True), (False, True), (True, False),
                               (False, False)):
      _, _, rows = memory.measure(hf, dtype=jnp.float32,
                                  scan_layers=scan_layers, batch=4, seq=64,
                                  paths=('forward', 'taco layerwise', 'adamw'),
                                  remat=remat)
      predicted = plan(hf, batch=4, seq=64, dtype=jnp.float32,
                       scan_layers=scan_layers, remat=remat)['peaks']
      for path, peak, *_ in rows[1:]:
        formula = predicted['taco layerwise' if 'taco' in path
                            else 'adamw plain']
        ratios.append(formula / peak)
        print(f'  {label:<22}{"stacked" if scan_layers else "unrolled":<10}'
              f'{"on" if remat else "off":<7}{path:<16}{peak / 1e6:>12.1f}'
              f'{formula / 1e6:>12.1f}{formula / peak:>7.3f}')
  return ratios


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--config', help='a Hugging Face config.json')
  parser.add_argument('--preset', choices=sorted(presets.PRESETS),
                      action='append')
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
    targets.append((name, presets.PRESETS[name]))
  errors = {}
  for name, hf in targets:
    result = plan(hf, batch=args.batch, seq=args.seq,
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
