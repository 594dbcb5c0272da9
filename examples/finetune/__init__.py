"""Fine-tune a Hugging Face or GGUF decoder LM with TACO (Flax NNX).

``python -m examples.finetune`` (:mod:`__main__`) parses :mod:`flags`, then
:func:`loop.run` prepares the run (:mod:`preparation`), trains it and writes
its results (:mod:`report`). Beside them: the task formats and metrics
(:mod:`tasks`), data files and batches (:mod:`data`), the losses
(:mod:`losses`), held-out evaluation (:mod:`evaluation`), the optimizer
registry (:mod:`optimizers`), how 16-bit parameters are stored and updated
(:mod:`precision`, ``--rounding``), the share of updates that landed
(:mod:`landed`, ``--measure-landed``), the train steps (:mod:`trainers`),
the memory prediction (:mod:`memory_plan`), checkpoints and resume
(:mod:`checkpoint`, :mod:`resume`, :mod:`run_dirs`), progress lines
(:mod:`phases`) and
``python -m examples.finetune.compare`` (:mod:`compare`). The model itself
is the subpackage :mod:`model`. Scripts and benchmarks use the example
through :mod:`api` alone, its public surface.
"""
