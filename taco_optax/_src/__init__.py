"""taco_optax\x27s implementation: four subpackages, each with its surface."""
