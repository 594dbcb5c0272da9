"""A :class:`RunResults` for tests of what reads one: the required fields
filled with plain values, any field given by keyword."""

from examples.finetune import results as results_lib


def run_results(**fields) -> results_lib.RunResults:
  """A run's results with ``fields`` set; the rest a plain 40-step run."""
  required = dict(
      optimizer='taco', learning_rate=1e-4, learning_rate_source='--lr',
      warmup_steps=4, model='model.gguf', family='llama', task='tweets',
      metric='accuracy', before={'accuracy': 0.5},
      after={'accuracy': 0.5}, evals=[], losses=[1.0] * 40,
      optimizer_state_bytes=0, parameter_bytes=0)
  return results_lib.RunResults(**{**required, **fields})
