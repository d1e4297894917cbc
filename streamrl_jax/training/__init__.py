"""RL objectives as pure functions and the streamed-micro-batch train step on the trainer mesh."""

from streamrl_jax.training.advantages import ADVANTAGES, compute_advantages, gae
from streamrl_jax.training.config import OptimizerConfig, TrainerConfig
from streamrl_jax.training.logprobs import chunked_token_logprobs, entropy, token_logprobs
from streamrl_jax.training.objectives import (AGGREGATIONS, OBJECTIVES, ObjectiveConfig, aggregate, clipped_value_loss,
                                              kl_penalized_rewards, kl_penalty)
from streamrl_jax.training.micro_batches import MicroBatcher
from streamrl_jax.training.trainer import Buckets, Scoring, Trainer, TrainState, make_optimizer

__all__ = ["TrainerConfig", "chunked_token_logprobs", "ADVANTAGES", "MicroBatcher", "AGGREGATIONS", "OBJECTIVES", "ObjectiveConfig", "OptimizerConfig", "TrainState", "Trainer",
           "aggregate", "clipped_value_loss", "compute_advantages", "entropy", "gae", "kl_penalized_rewards",
           "kl_penalty", "make_optimizer", "token_logprobs", "Buckets", "Scoring"]
