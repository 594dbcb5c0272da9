"""``python -m examples.smollm2``: see :mod:`main`."""

from examples.smollm2 import main

if __name__ == '__main__':
  main.main()
