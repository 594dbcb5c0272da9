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
import sys

import jax.numpy as jnp

from benchmarks import memory
from benchmarks import presets
from benchmarks import provenance
from examples.finetune import api

GB = api.GB


# The example's planner (``examples/finetune/memory_plan.py``): a config's
# predicted peak per method, on one device and on a mesh.
plan = api.plan_peaks
plan_on_mesh = api.plan_peaks_on_mesh


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


# Reduced-layer versions of these are compiled on CPU meshes to check the
# per-device formula (--validate-mesh): at MESH_VALIDATION_LAYERS layers on
# every mesh, and at MESH_VALIDATION_DEEPER layers at fsdp=8, so that a term
# that grows with the depth (gathered blocks kept, gradients kept) shows.
MESH_VALIDATION_MODELS = ('opt-13b', 'qwen3-32b', 'llama-3-70b')
MESH_VALIDATION_MESHES = ('fsdp=2', 'fsdp=4', 'fsdp=8')
MESH_VALIDATION_LAYERS = 2
MESH_VALIDATION_DEEPER = ((4, 'fsdp=8'),)


def validate_mesh(batch=8, seq=64, dtype=jnp.float32,
                  models=MESH_VALIDATION_MODELS,
                  meshes=MESH_VALIDATION_MESHES):
  """Per-device formula vs XLA's compiled per-device peak, on reduced-layer
  versions of ``models``, each mesh compiled in its own process with that
  many CPU devices (shapes only: nothing is allocated)."""
  print(f'\nvalidation on meshes: formula vs XLA compiled per-device peak '
        f'({jnp.dtype(dtype).name}, batch {batch}, seq {seq}, unrolled, '
        'remat)')
  print(f'  {"model":<14}{"layers":>6} {"mesh":<9}{"method":<16}'
        f'{"weights MB":>11}{"compiled MB":>12}{"formula MB":>12}'
        f'{"ratio":>7}')
  rows = [(name, MESH_VALIDATION_LAYERS, mesh) for name in models
          for mesh in meshes]
  rows += [(name, layers, mesh) for name in models
           for layers, mesh in MESH_VALIDATION_DEEPER]
  ratios = []
  for name, layers, mesh in rows:
    hf = dict(presets.PRESETS[name], num_hidden_layers=layers)
    got = memory.compiled_on_mesh_in_subprocess(
        hf, mesh, dtype=dtype, batch=batch, seq=seq, num_layers=None)
    predicted = plan_on_mesh(hf, api.parse_mesh(mesh), batch=batch,
                             seq=seq, dtype=dtype)
    for method, formula in predicted['peaks'].items():
      peak = got[method]['peak']
      ratios.append(formula / peak)
      print(f'  {name:<14}{layers:>6} {mesh:<9}{method:<16}'
            f'{got["weights"] / 1e6:>11.1f}{peak / 1e6:>12.1f}'
            f'{formula / 1e6:>12.1f}{formula / peak:>7.3f}', flush=True)
  return ratios


# The README's "will it fit" table: models, and (label, mesh, GB per GPU).
FIT_MODELS = ('opt-13b', 'opt-30b', 'qwen3-32b', 'llama-3-70b')
FIT_MACHINES = (('1 x 80 GB', {}, 80), ('8 x 24 GB', {'fsdp': 8}, 24),
                ('8 x 80 GB', {'fsdp': 8}, 80))


def fit_table(batch=8, seq=128, dtype=jnp.bfloat16):
  """Prints one device's predicted peak of TACO and AdamW per model and
  machine (FSDP over the GPUs), as Markdown."""
  print(f'Predicted peak per GPU, GB ({jnp.dtype(dtype).name} weights and '
        f'compute, batch {batch} x {seq} tokens, the CLI\'s unrolled layers '
        'with remat, FSDP over the GPUs; TACO: the layer-wise step, AdamW: '
        'the plain step with moments in the parameter dtype, each block\'s '
        'weights gathered when used, two at a time, as the example\'s '
        'decoder runs it (taco_optax.layerwise.remat_layers); the formula '
        'is checked against XLA:CPU\'s compiled programs, not on a GPU); '
        '"no": over the GPU\'s memory.\n')
  print('| model | ' + ' | '.join(f'{label}: TACO / AdamW'
                                   for label, _, _ in FIT_MACHINES) + ' |')
  print('| --- |' + ' --- |' * len(FIT_MACHINES))
  for name in FIT_MODELS:
    cells = []
    for _, mesh, gpu_gb in FIT_MACHINES:
      peaks = plan_on_mesh(presets.PRESETS[name], mesh, batch=batch, seq=seq,
                           dtype=dtype)['peaks']
      show = lambda peak: (f'{peak / GB:.1f}'
                           + ('' if peak <= gpu_gb * GB else ' (no)'))
      cells.append(f'{show(peaks["taco layerwise"])} / '
                   f'{show(peaks["adamw plain"])}')
    print(f'| {name} | ' + ' | '.join(cells) + ' |')


def _validate_mesh_report():
  ratios = validate_mesh()
  print(f'mesh_formula_over_compiled_max={max(ratios):.3f} '
        f'mesh_formula_over_compiled_min={min(ratios):.3f}')


def print_mesh_plan(name, mesh, result, gpu_gb):
  t = result['terms']
  print(f'\n{name} on {mesh}, per device (GB): weights {t.weights / GB:.2f}, '
        f'TACO state {result["taco_state"] / GB:.3f}, AdamW state '
        f'{result["adamw_state"] / GB:.2f}, layer inputs '
        f'{t.layer_inputs / GB:.3f}, gathered block '
        f'{t.gathered_block / GB:.3f}, plain step\'s kept gradients '
        f'{t.plain_gradients / GB:.3f}, logits {t.head_phase / GB:.3f}')
  for method, peak in result['peaks'].items():
    print(f'  {method:<28}{peak / GB:>9.2f}  fits {gpu_gb:g} GB: '
          f'{"yes" if peak <= gpu_gb * GB else "no"}')


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
  parser.add_argument('--mesh', help='e.g. fsdp=8 or data=2,fsdp=4: '
                      'predict one device\'s peak on that mesh (the CLI\'s '
                      'unrolled layers and sharding rule)')
  parser.add_argument('--validate-mesh', action='store_true',
                      help='formula vs compiled per-device peak on reduced-'
                      'layer models at fsdp = 2, 4, 8 (CPU devices)')
  parser.add_argument('--fit-table', action='store_true',
                      help='the README\'s table: OPT-13B to Llama-3-70B on '
                      '1 x 80 GB, 8 x 24 GB and 8 x 80 GB')
  parser.add_argument('--write', metavar='PATH',
                      help='with --fit-table or --validate-mesh: also write '
                      'the output, with its provenance, as Markdown')
  args = parser.parse_args()
  if args.fit_table or args.validate_mesh:
    command = 'python -m benchmarks.planner ' + ' '.join(sys.argv[1:])
    report, title = ((fit_table, 'Will it fit: predicted memory per GPU')
                     if args.fit_table else
                     (_validate_mesh_report, 'Memory per GPU on meshes'))
    text = provenance.captured(report)
    if args.write:
      provenance.write_report(args.write, title, command, text)
    return

  dtype = jnp.dtype(args.dtype)
  targets = []
  if args.config:
    with open(args.config) as f:
      targets.append((args.config, json.load(f)))
  for name in args.preset or ([] if args.config else sorted(PAPER_TABLE5_GB)):
    targets.append((name, presets.PRESETS[name]))
  errors = {}
  for name, hf in targets:
    if args.mesh:
      print_mesh_plan(name, args.mesh, plan_on_mesh(
          hf, api.parse_mesh(args.mesh), batch=args.batch, seq=args.seq,
          dtype=dtype), args.gpu_gb)
      continue
    result = plan(hf, batch=args.batch, seq=args.seq, dtype=dtype)
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
