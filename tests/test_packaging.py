"""What ``taco_optax`` shows a type checker and ``help()``: short signatures.

The wheel's contents (``py.typed``, the kernel's sources) are checked on the
wheel ``tests/test_installed_wheel.py`` builds.
"""

import inspect

import taco_optax


def test_taco_signature_names_its_types_instead_of_expanding_them():
  signature = inspect.signature(taco_optax.taco)
  # Expanded aliases spelled optax's ScalarOrSchedule out twice (~1100
  # characters, jaxlib and numpy scalar types included): every annotation
  # stays a short name, however many arguments taco() takes.
  text = str(signature)
  assert 'jaxlib' not in text and 'numpy' not in text, text
  assert "learning_rate: 'optax.ScalarOrSchedule'" in text
  for name, parameter in signature.parameters.items():
    assert len(str(parameter.annotation)) < 60, (name, parameter.annotation)
