"""Held-out evaluation of an agent program: each prompt one episode, played against the policy served greedily
(every request at temperature 0, whatever the agent asks) on one device, scored as training scores it."""

from __future__ import annotations

from flax import nnx

from streamrl_jax.agents.program import POLICY_MODEL
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.agents.rollouts import AgentRollouts, scored_text, serving_for
from streamrl_jax.rewards import RewardScorer
from streamrl_jax.sampling import SamplerConfig, StreamingSampler, make_engine
from streamrl_jax.serving.app import ServedModel
from streamrl_jax.serving.bridge import RequestBridge
from streamrl_jax.serving.config import ServeConfig
from streamrl_jax.serving.server import GenerationLoop
from streamrl_jax.tasks.heldout import evaluation_where, heldout_prompts
from streamrl_jax.tasks.rows import question, verifier

EVAL_WAIT_S = 1.0


def agent_completions(model, tokenizer, task, sampler: SamplerConfig, max_new_tokens: int, prompts: int,
                      seed: int) -> list[tuple[str, str, float]]:
  """(prompt, the agent's answer or last reply, reward) of one greedy episode per held-out prompt (drawn with
  their own seed, as `evaluation.decoded` draws them), with `sampler`'s engine, agent program and rewards and the run's
  `max_new_tokens` (each reply's and each episode's bound); a failed episode scores 0."""
  import secrets

  graphdef, params = nnx.split(model)
  engine = StreamingSampler([make_engine(graphdef, model.config, sampler.engine, single_device_mesh())], params)
  bridge = RequestBridge()
  served = ServedModel(POLICY_MODEL, tokenizer, sampler.engine.max_prompt_length, max_new_tokens)
  server = serving_for(ServeConfig(port=0, api_key=secrets.token_hex(16), max_requests=4096, temperature=0.0),
                       served, bridge)
  loop = GenerationLoop(engine, bridge)
  agents = AgentRollouts(sampler.env, server, max_new_tokens)
  items = heldout_prompts(task, prompts, seed)
  results = {}
  try:
    for i, (prompt, row) in enumerate(items):
      agents.start((i,), {"prompt": question(task, prompt), **row.fields}, 1)
    while agents.running:
      agents.wait(EVAL_WAIT_S)
      results.update({r.key[0]: r for r in agents.finished()})
  finally:
    agents.close()
    server.stop()
    loop.stop()
  out = []
  with RewardScorer(sampler.reward, builtin=verifier(task)) as scorer:
    for i, (prompt, row) in enumerate(items):
      text, env_reward, failure = scored_text(results[i])
      if failure:
        out.append((prompt, f"(the agent failed: {failure})", 0.0))
        continue
      score = scorer.score(question(task, prompt), text, row.fields, evaluation_where(prompt, row))
      out.append((prompt, text, score.total + env_reward))
  return out
