"""Scheduling: pure policies over plain data (dispatch, admission order, resource split, elasticity)."""

from streamrl_jax.scheduling.policies import (DispatchPlan, elastic_decision, instance_latency,
                                              longest_first_admission, lpt_assign, lpt_order, ptl_at,
                                              random_dispatch, resource_split, skew_aware_dispatch)

__all__ = ["DispatchPlan", "elastic_decision", "instance_latency", "longest_first_admission", "lpt_assign",
           "lpt_order", "ptl_at", "random_dispatch", "resource_split", "skew_aware_dispatch"]
