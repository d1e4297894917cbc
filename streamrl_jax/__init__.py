"""streamrl_jax: StreamRL-style RL post-training of LLMs in JAX."""

__version__ = "0.1.0"
