"""taco_optax\x27s implementation: six subpackages, each with its surface."""
