"""Fine-tune a Hugging Face or GGUF decoder LM with TACO (Flax NNX)."""
