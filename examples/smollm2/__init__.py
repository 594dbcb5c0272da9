"""Fine-tune SmolLM2-135M with TACO: the example to read first.

Four files in the shape of Flax's lm1b example: the model
(:mod:`model`, and :mod:`weights` to fill it from the GGUF checkpoint), the
data (:mod:`input_pipeline`), the loss, the optimizers and the two train
steps (:mod:`train`) and the command line (:mod:`main`). The A/B harness
with every optimizer, task, mesh and checkpoint feature is
``examples/finetune/``.
"""
