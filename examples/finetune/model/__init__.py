"""The example's model stack: a Flax NNX decoder LM and how it is loaded.

* :mod:`config`: :class:`config.ModelConfig`, a model's architecture (read
  from a Hugging Face ``config.json`` or GGUF metadata).
* :mod:`layers`: the pieces every family shares (norms, rotary, attention,
  MLPs), configured rather than subclassed.
* :mod:`decoder`: :class:`decoder.DecoderLM` and what it tells TACO (which
  parameters are matrices, how to scale them).
* :mod:`weights`: a model from named checkpoint tensors, any file format.
* :mod:`loading`: Hugging Face directories; :mod:`gguf`: GGUF files.
* :mod:`sharding`: ``--mesh``, the parameters' and batches' shardings.
* :mod:`layered`: the model split into embed, blocks and head, the
  ``taco_optax.layerwise.LayeredLoss`` of the memory-lean layer-wise step.
"""
