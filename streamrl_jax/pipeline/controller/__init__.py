"""The controller, in parts: the samplers' roster (`roster`), the leases (`leases`), the steps' plans and
summaries (`plans`), the weight broadcast trees (`weight_trees`), the door's shard check (`door`) and the
timeline of events and counters (`timeline`); `core.Controller` holds the lock and routes each message to them."""

from streamrl_jax.pipeline.controller.core import MAX_LEASE_WAIT_S, Controller, ControllerSetup, JoinTerms

__all__ = ["MAX_LEASE_WAIT_S", "Controller", "ControllerSetup", "JoinTerms"]
