"""pytest: skip collecting the optional tunix module where tunix is absent."""

import importlib.util

# taco_optax/tunix.py subclasses tunix's trainer at import; its doctests and
# tests need ``pip install "taco_optax[tunix]"``.
collect_ignore = ([] if importlib.util.find_spec('tunix')
                  else ['taco_optax/tunix.py'])
