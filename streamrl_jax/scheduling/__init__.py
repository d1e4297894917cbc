"""Scheduling: pure policies over plain data (dispatch, admission order, resource split, elasticity), the
registry of policies by name, the output-length ranker that drives them, and the config the pipeline reads."""

from streamrl_jax.scheduling.config import CPU_PTL_CURVE, RankerConfig, SchedulingConfig
from streamrl_jax.scheduling.dispatch import StepDispatch, dispatch_requests, engine_slots
from streamrl_jax.scheduling.policies import (DispatchPlan, adaptive_steps, elastic_decision, elastic_target,
                                              fifo_order, fixed_steps, instance_latency, longest_first_admission,
                                              lpt_assign, lpt_order, ptl_at, random_dispatch, resource_split,
                                              skew_aware_dispatch)
from streamrl_jax.scheduling.ranker import (LengthRanker, OnlineRanker, RankerState, lengths_from_scores,
                                            pairwise_ranking_loss, ranking_metrics, recall_at)
from streamrl_jax.scheduling.registry import SCHEDULING_POLICIES, SchedulingPolicy

__all__ = ["CPU_PTL_CURVE", "DispatchPlan", "LengthRanker", "OnlineRanker", "RankerConfig", "RankerState",
           "SCHEDULING_POLICIES", "SchedulingConfig", "SchedulingPolicy", "StepDispatch", "adaptive_steps",
           "dispatch_requests", "elastic_decision", "elastic_target", "engine_slots", "fifo_order", "fixed_steps",
           "instance_latency",
           "lengths_from_scores", "longest_first_admission", "lpt_assign", "lpt_order", "pairwise_ranking_loss",
           "ptl_at", "random_dispatch", "ranking_metrics", "recall_at", "resource_split", "skew_aware_dispatch"]
