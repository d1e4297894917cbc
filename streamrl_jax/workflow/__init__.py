"""A run's step as a graph of stages bound to pools of devices (DistFlow): the graph and its checks (graph), what a
stage does (ops), the built-in graphs grpo, rloo, kl_reference, distill, judge and ppo (graphs), the run's choice
(config), one pool's flow (flow), a frozen model that scores tokens (teacher), a model's verdict as a reward (judge),
ppo's critic (critic) and the trainer program's flow with its pools (pools)."""

from streamrl_jax.workflow.config import WorkflowConfig
from streamrl_jax.workflow.graph import GraphError, Stage, StepGraph

__all__ = ["GraphError", "Stage", "StepGraph", "WorkflowConfig"]
