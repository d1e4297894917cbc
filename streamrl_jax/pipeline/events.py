"""The controller's events (samplers joining, leaving, lost; prompts recovered; shards refused; pauses) as
one log line each."""

from __future__ import annotations

from streamrl_jax.messages import row_step


def describe_event(event: dict) -> str:
  """One log line for a controller event."""
  kind, name = event["event"], event.get("sampler", "")
  if kind == "sampler_joined":
    return f"sampler {name} joined (takes leases from step {row_step(event['next_step'])})"
  if kind == "sampler_left":
    return f"sampler {name} left; {event['leases_returned']} lease(s) returned to the plan"
  if kind == "sampler_lost":
    return (f"sampler {name} is silent past ControllerConfig.lease_timeout_s: declared lost, "
            f"{event['leases_returned']} lease(s) leased again")
  if kind == "re_leased_delivered":
    return (f"prompts of lost sampler {event['lost_sampler']} (step {row_step(event['step'])}) delivered by {name}, "
            f"{event['since_lost_s']} s after the loss")
  if kind == "shard_refused":
    return event["reason"]
  if kind == "broadcast_tree":
    if event.get("unchanged"):
      return f"weights of version {event['version']} go down the same tree"
    return f"weights of version {event['version']} go down this tree:\n{event['drawing']}"
  if kind == "trainer_paused":
    return f"this trainer was paused for {event['seconds']} s; samplers get a fresh heartbeat timeout"
  return f"{kind}: {event}"
