"""streamrl_jax: StreamRL-style RL post-training of LLMs in JAX."""

__version__ = "0.1.0"


def train(config_files=(), settings=(), workdir="runs/train", *, resume=False, arms=()) -> dict:
  """`streamrl train` from Python: returns the run's summary (`streamrl_jax.commands.train.train`)."""
  from streamrl_jax.commands.train import train as _train

  return _train(config_files, settings, workdir, resume=resume, arms=arms)
