"""``python -m benchmarks.quality``: see :mod:`benchmarks.quality`."""

from benchmarks.quality import benchmark

benchmark.main()
