"""Advantage estimators and objectives against plain numpy formulas, clipping boundaries, AIPO gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl_jax.training import (ObjectiveConfig, aggregate, clipped_value_loss, compute_advantages, entropy, gae,
                                   kl_penalized_rewards, kl_penalty)
from streamrl_jax.training.corrections import CorrectionConfig
from streamrl_jax.training.objectives import OBJECTIVES, policy_loss

RNG = np.random.default_rng(0)
B, T = 4, 7
MASK = np.zeros((B, T), bool)
for row, (start, end) in enumerate([(2, 7), (3, 5), (1, 7), (4, 6)]):  # completions of different lengths
  MASK[row, start:end] = True
LOGP = RNG.normal(-2, 0.5, (B, T)).astype(np.float32)
SAMPLER = (LOGP + RNG.normal(0, 0.4, (B, T))).astype(np.float32)
OLD = (LOGP + RNG.normal(0, 0.3, (B, T))).astype(np.float32)
ADV = np.repeat(RNG.normal(0, 1, (B, 1)), T, 1).astype(np.float32)
BATCH = dict(advantages=jnp.asarray(ADV), logprobs=jnp.asarray(SAMPLER), old_logprobs=jnp.asarray(OLD))


def np_aggregate(per_token, mask, mode, constant=10.0):
  lengths = mask.sum(1)
  if mode == "token_mean":
    return (per_token * mask).sum() / mask.sum()
  if mode == "seq_mean_token_sum":
    return (per_token * mask).sum(1).sum() / B
  if mode == "seq_mean_token_mean":
    return ((per_token * mask).sum(1) / lengths).sum() / B
  return (per_token * mask).sum() / (B * constant)


def np_clip_surrogate(logp, ref, adv, lo, hi):
  ratio = np.exp(logp - ref)
  return -np.minimum(ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv)


def np_gspo(c):
  s = np.exp(((LOGP - OLD) * MASK).sum(1, keepdims=True) / MASK.sum(1, keepdims=True))
  return -np.minimum(s * ADV, np.clip(s, 1 - c.clip_low, 1 + c.clip_high) * ADV)


NP_OBJECTIVES = {  # each surrogate against the old policy OLD, times the default correction min(OLD / SAMPLER, cap)
    "ppo": lambda c: np_clip_surrogate(LOGP, OLD, ADV, c.clip_low, c.clip_high),
    "gspo": np_gspo,
    "cispo": lambda c: -np.clip(np.exp(LOGP - OLD), 1 - c.clip_low, 1 + c.clip_high) * ADV * LOGP,
    "aipo": lambda c: -np.minimum(np.exp(LOGP - OLD), c.aipo_rho) * ADV * LOGP,
    "reinforce": lambda c: -ADV * LOGP,
}


@pytest.mark.parametrize("objective", sorted(NP_OBJECTIVES))
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "constant"])
def test_objective_and_aggregation_match_numpy(objective, mode):
  cfg = ObjectiveConfig(objective=objective, aggregation=mode, clip_low=0.2, clip_high=0.28, constant_normalizer=10.0,
                        bands=CorrectionConfig(tis_cap=1.2), aipo_rho=2.0)
  per_token, _ = policy_loss(jnp.asarray(LOGP), {**BATCH, "loss_mask": jnp.asarray(MASK)}, cfg)
  numerator, denominator = aggregate(per_token, jnp.asarray(MASK), cfg)
  weight = np.minimum(np.exp(OLD - SAMPLER), 1.2)
  expected = np_aggregate(weight * NP_OBJECTIVES[objective](cfg), MASK, mode)
  np.testing.assert_allclose(float(numerator / denominator), expected, rtol=1e-5)
  assert (np.exp(OLD - SAMPLER)[MASK] > 1.2).any()  # the cap is exercised


def test_renamed_objectives_and_bypass_with_a_correction_are_refused_by_name():
  with pytest.raises(ValueError, match="'ppo_tis' is now objective='ppo', correction='token_tis'"):
    ObjectiveConfig(objective="ppo_tis")
  with pytest.raises(ValueError, match="old_logprobs='sampler'.*correction='none'"):
    ObjectiveConfig(old_logprobs="sampler")
  with pytest.raises(ValueError, match="ObjectiveConfig.correction: unknown off-policy correction 'tis'"):
    ObjectiveConfig(correction="tis")
  assert ObjectiveConfig(correction="none").correction == () and not ObjectiveConfig(correction="none").corrected
  assert ObjectiveConfig(old_logprobs="sampler", correction="none").corrected  # the ratio to mu is the correction
  assert ObjectiveConfig(correction="veto").correction == ("veto",)


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_ppo_clip_boundaries_stop_the_gradient(advantage):
  cfg = ObjectiveConfig(clip_low=0.2, clip_high=0.28)
  ratios = np.array([0.7, 0.85, 1.0, 1.2, 1.35], np.float32)
  logp = jnp.log(jnp.asarray(ratios))
  batch = dict(advantages=jnp.full(5, advantage), old_logprobs=jnp.zeros(5))
  grad = np.asarray(jax.grad(lambda lp: OBJECTIVES.get("ppo")(lp, batch, cfg, None).sum())(logp))
  # A > 0: the ceiling 1.28 binds (ratio 1.35 has no gradient); A < 0: the floor 0.8 binds (ratio 0.7).
  zero = ratios > 1.28 if advantage > 0 else ratios < 0.8
  np.testing.assert_array_equal(grad[zero], 0.0)
  np.testing.assert_allclose(grad[~zero], -advantage * ratios[~zero], rtol=1e-6)
  values = np.asarray(OBJECTIVES.get("ppo")(logp, batch, cfg, None))
  np.testing.assert_allclose(values, np_clip_surrogate(np.log(ratios), 0, advantage, 0.2, 0.28), rtol=1e-6)


def test_aipo_and_cispo_gradients_survive_truncation():
  cfg = ObjectiveConfig(objective="aipo", aipo_rho=2.0, clip_high=1.0)
  ratios = np.array([0.5, 1.5, 3.0, 8.0], np.float32)  # the last two are truncated at rho = 2 (cispo: 1 + 1)
  batch = dict(advantages=jnp.ones(4), old_logprobs=jnp.zeros(4))
  for name in ("aipo", "cispo"):
    grad = np.asarray(jax.grad(lambda lp: OBJECTIVES.get(name)(lp, batch, cfg, None).sum())(  # noqa: B023
        jnp.log(jnp.asarray(ratios))))
    floor = 0.8 if name == "cispo" else 0.0  # cispo's weight is clipped below too, at 1 - clip_low
    np.testing.assert_allclose(grad, -np.clip(ratios, floor, 2.0), rtol=1e-6)
  # The mistake of clamping the ratio inside the differentiated term zeroes those gradients:
  wrong = jax.grad(lambda lp: (-jnp.minimum(jnp.exp(lp), 2.0)).sum())(jnp.log(jnp.asarray(ratios)))
  assert np.all(np.asarray(wrong)[2:] == 0) and np.all(grad[2:] != 0)


def test_kl_estimators_entropy_and_value_loss_match_numpy():
  ref = (LOGP + 0.3).astype(np.float32)
  r = LOGP - ref
  expected = {"k1": r, "k2": 0.5 * r**2, "k3": np.exp(-r) + r - 1}
  for name, value in expected.items():
    np.testing.assert_allclose(np.asarray(kl_penalty(jnp.asarray(LOGP), jnp.asarray(ref), name)), value, rtol=1e-5)
  logits = RNG.normal(0, 2, (3, 11)).astype(np.float32)
  p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  np.testing.assert_allclose(np.asarray(entropy(jnp.asarray(logits))), -(p * np.log(p)).sum(-1), rtol=1e-5)
  v, v_old, ret = (RNG.normal(0, 1, 6).astype(np.float32) for _ in range(3))
  vc = v_old + np.clip(v - v_old, -0.2, 0.2)
  np.testing.assert_allclose(np.asarray(clipped_value_loss(v, v_old, ret, 0.2)),
                             0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2), rtol=1e-6)
  rewards = np.array([1.0, 0.0, 1.0, 0.5], np.float32)
  np.testing.assert_allclose(np.asarray(kl_penalized_rewards(rewards, LOGP, ref, MASK, 0.1, "k1")),
                             rewards - 0.1 * (r * MASK).sum(1), rtol=1e-5)


def test_advantage_estimators_by_hand():
  rewards = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
  groups = np.array([0, 0, 0, 0, 1, 1])
  # group 0: mean 0.5, std 0.5; group 1: mean 3, std 2
  np.testing.assert_allclose(compute_advantages("grpo", rewards, groups), [1, -1, -1, 1, -1, 1], atol=1e-5)
  np.testing.assert_allclose(compute_advantages("dr_grpo", rewards, groups), [0.5, -0.5, -0.5, 0.5, -2, 2])
  np.testing.assert_allclose(compute_advantages("rloo", rewards, groups),
                             [1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3, -4, 4], rtol=1e-6)
  np.testing.assert_allclose(compute_advantages("reinforce_pp", rewards, groups),
                             (rewards - rewards.mean()) / rewards.std(), rtol=1e-5)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(-5, 5), min_size=2, max_size=8), st.integers(2, 4))
def test_rloo_equals_leave_one_out_mean(rewards, groups):
  rewards = np.asarray(rewards * groups)
  ids = np.repeat(np.arange(groups), len(rewards) // groups)
  got = compute_advantages("rloo", rewards, ids)
  for i in range(len(rewards)):
    others = rewards[(ids == ids[i]) & (np.arange(len(rewards)) != i)]
    np.testing.assert_allclose(got[i], rewards[i] - others.mean(), rtol=1e-4, atol=1e-4)


def test_gae_matches_a_numpy_loop():
  rewards = RNG.normal(0, 1, (B, T)).astype(np.float32)
  values = RNG.normal(0, 1, (B, T)).astype(np.float32)
  adv, ret = gae(rewards * MASK, values, MASK, gamma=0.9, lam=0.8)
  expected = np.zeros((B, T))
  for b in range(B):
    idx = np.flatnonzero(MASK[b])
    last = 0.0
    for j in reversed(range(len(idx))):
      t = idx[j]
      next_value = values[b, idx[j + 1]] if j + 1 < len(idx) else 0.0
      last = rewards[b, t] + 0.9 * next_value - values[b, t] + 0.9 * 0.8 * last
      expected[b, t] = last
  np.testing.assert_allclose(np.asarray(adv), expected, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(ret), (expected + values) * MASK, rtol=1e-5, atol=1e-5)


def test_bad_configs_get_clear_errors():
  with pytest.raises(ValueError, match="unknown advantage estimator 'gpro'; known: .*'grpo'"):
    compute_advantages("gpro", [1.0, 0.0], [0, 0])
  with pytest.raises(ValueError, match="unknown policy objective 'ppo2'; known: .*'aipo'"):
    ObjectiveConfig(objective="ppo2")
  with pytest.raises(ValueError, match="clip_low must be > 0"):
    ObjectiveConfig(clip_low=0.0)
  with pytest.raises(ValueError, match="clip_high must be > 0"):
    ObjectiveConfig(clip_high=-0.1)
  with pytest.raises(ValueError, match="group size 1"):
    compute_advantages("grpo", [1.0, 0.0], [0, 1])
  with pytest.raises(ValueError, match="aipo_rho must be >= 1"):
    ObjectiveConfig(objective="aipo", aipo_rho=0.5)
  with pytest.raises(ValueError, match="unknown aggregation"):
    ObjectiveConfig(aggregation="sum")
