"""Scheduling: pure policies over plain data (dispatch, admission order, resource split, elasticity), the
output-length ranker that drives them, and the config the pipeline reads."""

from streamrl_jax.scheduling.controller import (CPU_PTL_CURVE, SchedulingConfig, StepDispatch, dispatch_requests,
                                                elastic_target, engine_slots)
from streamrl_jax.scheduling.policies import (DispatchPlan, elastic_decision, instance_latency,
                                              longest_first_admission, lpt_assign, lpt_order, ptl_at,
                                              random_dispatch, resource_split, skew_aware_dispatch)
from streamrl_jax.scheduling.ranker import (LengthRanker, OnlineRanker, RankerConfig, RankerState, lengths_from_scores,
                                            pairwise_ranking_loss, ranking_metrics, recall_at)

__all__ = ["CPU_PTL_CURVE", "DispatchPlan", "LengthRanker", "OnlineRanker", "RankerConfig", "RankerState",
           "SchedulingConfig", "StepDispatch", "dispatch_requests", "elastic_decision", "elastic_target", "engine_slots",
           "instance_latency", "lengths_from_scores", "longest_first_admission", "lpt_assign", "lpt_order",
           "pairwise_ranking_loss", "ptl_at", "random_dispatch", "ranking_metrics", "recall_at", "resource_split",
           "skew_aware_dispatch"]
