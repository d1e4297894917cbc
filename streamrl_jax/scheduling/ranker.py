"""The output-length ranker: a small Flax encoder over a prompt's tokens whose score orders prompts by
the output length the current policy will produce.

Pure parts: `RankerState` (parameters, optimizer state, step) as a pytree, `ranker_train_step(state,
batch) -> (state, metrics)` with a pairwise logistic ranking loss (RankNet), `ranking_metrics`.
Inference over a prompt batch is one `jax.shard_map` across the sampler mesh: parameters replicated,
prompts split over every device of the mesh. `OnlineRanker` holds the history of observed
(prompt, length) pairs and trains on it in a background thread while the sampler runs.

Scores are ranks, not lengths; `lengths_from_scores` turns them into predicted lengths by mapping each
prompt's rank in its batch to the same quantile of recently observed lengths.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from streamrl_jax.counters import Counters
from streamrl_jax import launch
from streamrl_jax.meshes import single_device_mesh
from streamrl_jax.scheduling.config import RankerConfig

RECALL_FRACTIONS = (0.2, 0.1, 0.05)


class LengthRanker(nnx.Module):
  """Token + position embeddings, one masked self-attention layer and a token MLP, then masked mean
  and max pooling plus log(prompt length) into an MLP head: one score per prompt."""

  def __init__(self, config: RankerConfig, *, rngs: nnx.Rngs):
    d = config.embed_dim
    self.embed = nnx.Embed(config.vocab_buckets, d, rngs=rngs)
    self.position = nnx.Embed(config.max_prompt_length, d, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads=2, in_features=d, decode=False, rngs=rngs)
    self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in, self.mlp_out = nnx.Linear(d, config.hidden_dim, rngs=rngs), nnx.Linear(config.hidden_dim, d, rngs=rngs)
    self.head_in = nnx.Linear(2 * d + 1, config.hidden_dim, rngs=rngs)
    self.head_out = nnx.Linear(config.hidden_dim, 1, rngs=rngs)

  def __call__(self, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """tokens [B, L] (already hashed), mask [B, L] bool -> scores [B]."""
    h = self.embed(tokens) + self.position(jnp.arange(tokens.shape[1]))[None]
    pair_mask = mask[:, None, :, None] & mask[:, None, None, :]
    h = h + self.attention(self.norm1(h), mask=pair_mask)
    h = h + self.mlp_out(jax.nn.gelu(self.mlp_in(self.norm2(h))))
    m = mask[..., None].astype(h.dtype)
    count = jnp.maximum(m.sum(1), 1.0)
    pooled = jnp.concatenate([(h * m).sum(1) / count, jnp.where(m > 0, h, -1e9).max(1), jnp.log(count)], -1)
    return self.head_out(jax.nn.gelu(self.head_in(pooled)))[:, 0]


@flax.struct.dataclass
class RankerState:
  params: nnx.State
  opt_state: optax.OptState
  step: jax.Array


def encode_prompts(prompts: Sequence, config: RankerConfig, rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [rows, L], mask [rows, L]): hashed ids, left-aligned, truncated to the last L tokens; rows
  past the prompts are empty (all-false mask)."""
  rows = len(prompts) if rows is None else rows
  length = config.max_prompt_length
  tokens, mask = np.zeros((rows, length), np.int32), np.zeros((rows, length), bool)
  for i, prompt in enumerate(prompts):
    ids = np.asarray(prompt, np.int64).reshape(-1)[-length:]
    if ids.size == 0:
      raise ValueError(f"prompt {i} is empty: the ranker needs at least one token")
    tokens[i, : ids.size] = ids % config.vocab_buckets
    mask[i, : ids.size] = True
  return tokens, mask


def pairwise_ranking_loss(scores: jax.Array, lengths: jax.Array, valid: jax.Array) -> jax.Array:
  """RankNet: mean over valid pairs with length_i > length_j of softplus(score_j - score_i)."""
  longer = (lengths[:, None] > lengths[None, :]) & valid[:, None] & valid[None, :]
  losses = jax.nn.softplus(scores[None, :] - scores[:, None])
  return jnp.sum(jnp.where(longer, losses, 0.0)) / jnp.maximum(jnp.sum(longer), 1)


def _optimizer(config: RankerConfig):
  return optax.adamw(config.learning_rate, weight_decay=1e-4)


def init_ranker(config: RankerConfig) -> tuple[nnx.GraphDef, RankerState]:
  model = LengthRanker(config, rngs=nnx.Rngs(config.seed))
  graphdef, params = nnx.split(model)
  return graphdef, RankerState(params, _optimizer(config).init(params), jnp.zeros((), jnp.int32))


def make_train_step(graphdef, config: RankerConfig):
  """jitted (state, tokens, mask, lengths, valid) -> (state, loss)."""
  tx = _optimizer(config)

  def loss_fn(params, tokens, mask, lengths, valid):
    return pairwise_ranking_loss(nnx.merge(graphdef, params)(tokens, mask), lengths, valid)

  def step(state: RankerState, tokens, mask, lengths, valid):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, tokens, mask, lengths, valid)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    return RankerState(optax.apply_updates(state.params, updates), opt_state, state.step + 1), loss

  # no donation: a checkpoint may still be reading the previous state. One device (the default): a
  # single-device program needs no launcher (launch.py)
  return jax.jit(step)


def make_scorer(graphdef, mesh: Mesh):
  """jitted (params, tokens, mask) -> scores, one `shard_map` over every device of `mesh`: parameters
  replicated, rows split across the devices (rows must be a multiple of mesh.size)."""
  rows = PartitionSpec(mesh.axis_names)

  def local(params, tokens, mask):
    return nnx.merge(graphdef, params)(tokens, mask)

  mapped = jax.shard_map(local, mesh=mesh, in_specs=(PartitionSpec(), rows, rows), out_specs=rows)
  return launch.launcher(mesh).jit(mapped, out_shardings=NamedSharding(mesh, rows))


def recall_at(predicted: np.ndarray, actual: np.ndarray, fraction: float) -> float:
  """Share of the true top-`fraction` longest that are among the predicted top-`fraction` (k >= 1)."""
  k = max(1, int(round(fraction * len(actual))))
  top_true = set(np.argsort(-np.asarray(actual), kind="stable")[:k].tolist())
  top_pred = set(np.argsort(-np.asarray(predicted), kind="stable")[:k].tolist())
  return len(top_true & top_pred) / k


def ranking_metrics(predicted: Sequence[float], actual: Sequence[float]) -> dict:
  """recall_top20/10/5 and Spearman's rho of predictions against realised lengths."""
  predicted, actual = np.asarray(predicted, float), np.asarray(actual, float)
  if predicted.shape != actual.shape or predicted.size < 2:
    raise ValueError(f"need two equal-length sequences of >= 2 values, got {predicted.shape} and {actual.shape}")
  out = {f"recall_top{round(f * 100)}": recall_at(predicted, actual, f) for f in RECALL_FRACTIONS}
  from scipy import stats  # here, not at the top: scipy.stats takes ~0.7 s to import, and every program imports this

  rho = stats.spearmanr(predicted, actual).statistic if np.ptp(predicted) > 0 and np.ptp(actual) > 0 else 0.0
  out["spearman"] = float(rho)
  return out


def lengths_from_scores(scores: Sequence[float], history: Sequence[float], default: float) -> np.ndarray:
  """Predicted lengths: the prompt ranked at quantile q of its batch gets quantile q of `history`
  (recent observed lengths); `default` for all when there is no history yet."""
  scores = np.asarray(scores, float)
  if len(history) == 0:
    return np.full(scores.shape, float(default))
  from scipy import stats  # (see `ranking_metrics`)

  ranks = stats.rankdata(scores, method="average")
  return np.quantile(np.asarray(history, float), (ranks - 0.5) / len(scores))


@dataclasses.dataclass(slots=True, eq=False)
class RankerCounters(Counters):
  """What the ranker has seen, trained and predicted, and its last training loss."""

  observed: int = 0
  train_steps: int = 0
  predict_calls: int = 0
  predict_s: float = 0.0
  train_s: float = 0.0
  last_loss: float = float("nan")


class OnlineRanker:
  """The ranker as the sampler uses it: `scores` / `predict_lengths` before dispatch, `observe` as lengths
  come back, and training on the recent history in the background (`start`/`stop`) or on call (`train`)."""

  def __init__(self, config: RankerConfig = RankerConfig(), mesh: Mesh | None = None):
    self.config = config
    self.mesh = mesh if mesh is not None else single_device_mesh(jax.devices()[0])
    self.graphdef, state = init_ranker(config)
    self._train_step = make_train_step(self.graphdef, config)
    self._score = make_scorer(self.graphdef, self.mesh)
    self._replicated = NamedSharding(self.mesh, PartitionSpec())
    self._lock, self._new_data = threading.Lock(), threading.Event()
    self._state = state
    self._serving = launch.put(state.params, self._replicated)
    self._tokens = np.zeros((0, config.max_prompt_length), np.int32)
    self._mask = np.zeros((0, config.max_prompt_length), bool)
    self._lengths = np.zeros((0,), np.float32)
    self._rng = np.random.default_rng(config.seed)
    self._thread: threading.Thread | None = None
    self._stop = threading.Event()
    self.error: BaseException | None = None
    self.counters = RankerCounters()

  # ---- inference ---------------------------------------------------------------------------
  def scores(self, prompts: Sequence) -> np.ndarray:
    """One score per prompt (higher = longer output), computed across the mesh's devices."""
    if len(prompts) == 0:
      return np.zeros((0,), np.float32)
    start = time.perf_counter()
    size = self.mesh.size
    rows = max(size, 1 << (len(prompts) - 1).bit_length())  # power-of-two buckets: few compiled shapes
    rows = -(-rows // size) * size
    tokens, mask = encode_prompts(prompts, self.config, rows)
    with self._lock:
      params = self._serving
    out = np.asarray(self._score(params, tokens, mask))[: len(prompts)]
    self.counters.predict_calls += 1
    self.counters.predict_s += time.perf_counter() - start
    return out

  def predict_lengths(self, prompts: Sequence, default: float) -> np.ndarray:
    """Predicted output lengths (scores mapped onto the history's quantiles)."""
    with self._lock:
      history = self._lengths.copy()
    return lengths_from_scores(self.scores(prompts), history, default)

  # ---- learning ----------------------------------------------------------------------------
  def observe(self, prompts: Sequence, lengths: Sequence[float]) -> None:
    """Adds realised (prompt, output length) pairs; the oldest beyond `history` are dropped."""
    if len(prompts) != len(lengths):
      raise ValueError(f"{len(prompts)} prompts but {len(lengths)} lengths")
    tokens, mask = encode_prompts(prompts, self.config)
    keep = self.config.history
    with self._lock:
      self._tokens = np.concatenate([self._tokens, tokens])[-keep:]
      self._mask = np.concatenate([self._mask, mask])[-keep:]
      self._lengths = np.concatenate([self._lengths, np.asarray(lengths, np.float32)])[-keep:]
    self.counters.observed += len(prompts)
    self._new_data.set()

  @property
  def history_lengths(self) -> np.ndarray:
    with self._lock:
      return self._lengths.copy()

  def train(self, steps: int | None = None) -> float:
    """Runs `steps` optimizer steps (default `steps_per_round`) on random batches of the history;
    returns the last loss (nan with fewer than two observations)."""
    steps = self.config.steps_per_round if steps is None else steps
    with self._lock:
      tokens, mask, lengths = self._tokens, self._mask, self._lengths
    n, b = len(lengths), self.config.batch_size
    if n < 2:
      return float("nan")
    start, loss = time.perf_counter(), None
    state = self._state
    for _ in range(steps):
      idx = self._rng.choice(n, size=b, replace=n < b)
      valid = np.ones(b, bool)
      state, loss = self._train_step(state, tokens[idx], mask[idx], lengths[idx], valid)
    serving = launch.put(state.params, self._replicated)
    with self._lock:
      self._state, self._serving = state, serving
    self.counters.train_steps += steps
    self.counters.train_s += time.perf_counter() - start
    self.counters.last_loss = float(loss)
    return self.counters.last_loss

  def start(self) -> None:
    """Trains a round in a background thread whenever new observations arrive."""
    if self._thread is not None:
      return
    self._stop.clear()
    self._thread = threading.Thread(target=self._loop, daemon=True, name="ranker")
    self._thread.start()

  def _loop(self) -> None:
    try:
      while not self._stop.is_set():
        if self._new_data.wait(0.05):
          self._new_data.clear()
          self.train()
    except BaseException as err:  # surfaced by stop()
      self.error = err

  def stop(self) -> None:
    if self._thread is not None:
      self._stop.set()
      self._thread.join()
      self._thread = None
    if self.error is not None:
      raise RuntimeError("the ranker's background training failed") from self.error

  # ---- checkpointing -----------------------------------------------------------------------
  def state_arrays(self) -> dict:
    """Everything needed to continue, in fixed shapes: parameters, optimizer state, step, and the
    history padded to `history` rows with its row count."""
    keep = self.config.history
    with self._lock:
      n = len(self._lengths)
      pad = lambda x: np.concatenate([x, np.zeros((keep - n,) + x.shape[1:], x.dtype)])  # noqa: E731
      return dict(state=self._state, tokens=pad(self._tokens), mask=pad(self._mask), lengths=pad(self._lengths),
                  count=np.int32(n))

  def load_state_arrays(self, arrays: dict) -> None:
    n = int(arrays["count"])
    with self._lock:
      self._state = arrays["state"]
      self._serving = launch.put(self._state.params, self._replicated)
      self._tokens = np.asarray(arrays["tokens"], np.int32)[:n]
      self._mask = np.asarray(arrays["mask"], bool)[:n]
      self._lengths = np.asarray(arrays["lengths"], np.float32)[:n]
