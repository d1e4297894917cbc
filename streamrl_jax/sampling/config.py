"""The sampler side's configuration: its engine (slots, lengths, KV layout, the buckets every engine compiles for)
and what a run's sampler adds around it (weight precision, in-flight updates, rewards, environments)."""

from __future__ import annotations

import dataclasses

from streamrl_jax.envs.config import EnvConfig
from streamrl_jax.models.fused_attention import DECODE_ATTENTION
from streamrl_jax.models.precision import PRECISIONS, QUANTIZE_ON
from streamrl_jax.rewards.config import RewardConfig

IN_FLIGHT_CACHE = ("keep", "recompute")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Slots and lengths of one engine instance."""

  num_slots: int = 8  # sequences decoded at once by one engine instance (its decode batch)
  max_prompt_length: int = 64  # prompt tokens an engine accepts; a longer prompt is refused
  max_new_tokens: int = 64  # tokens generated per sample; a run sets it from PipelineConfig.max_new_tokens
  min_prefill_bucket: int = 16  # smallest prompt-length bucket; buckets double up to max_prompt_length
  prefill_batch: int = 8  # most prompts prefilled (and inserted) per call; a power of two
  steps_per_sync: int = 1  # most decode steps per host round trip (the sampler's policy may take fewer)
  max_stop_tokens: int = 4  # most token ids that end a turn (eos ids, end of turn, the environment's stop)
  # bytes per device for the weights and KV cache (checked at build); 0: the device's limit (CPU: a RAM share)
  memory_budget_bytes: int = 0
  # shorter cache prefixes a decode step attends over when every slot fits (one more compile each);
  # on CPU one short window: XLA copies mid-size cache slices, which costs more than it saves
  short_attention_windows: tuple[int, ...] = (64,)
  # "contiguous": a cache_length KV cache per slot; "paged": a pool of pages rows take as they grow,
  # a group's prompt prefilled once and its full pages shared (`paged_engine`)
  kv_layout: str = "contiguous"
  page_size: int = 16  # tokens per page (paged); divides every attention window
  kv_pages: int = 0  # pages in the pool (paged); 0: as many as num_slots contiguous rows would hold
  share_prompts: bool = True  # requests of one prompt in a prefill call share its prefill (paged: and its full pages)
  prefix_cache_rows: int = 8  # paged: prompts whose pages and last logits stay cached for later calls
  # paged: a decode step's attention: "auto" (Pallas paged attention on a TPU, XLA's gather elsewhere), "xla", or
  # "paged" (the kernel on every backend: off a TPU in Pallas' interpret mode, slow; for tests)
  attention: str = "auto"

  def __post_init__(self):
    if self.kv_layout not in KV_LAYOUTS:
      raise ValueError(f"EngineConfig.kv_layout={self.kv_layout!r}; known: {list(KV_LAYOUTS)}")
    if self.attention not in DECODE_ATTENTION:
      raise ValueError(f"EngineConfig.attention={self.attention!r}; known: {list(DECODE_ATTENTION)}")
    if self.attention == "paged" and self.kv_layout != "paged":
      raise ValueError("EngineConfig.attention='paged' is the paged cache's kernel: set EngineConfig.kv_layout='paged' "
                       "(or attention 'auto' or 'xla')")
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if isinstance(value, (bool, str)):
        continue
      if field.name == "short_attention_windows":
        if any(w < 1 for w in value):
          raise ValueError(f"EngineConfig.short_attention_windows={value} must be positive")
      elif value < (0 if field.name in ("memory_budget_bytes", "kv_pages", "prefix_cache_rows") else 1):
        raise ValueError(f"EngineConfig.{field.name}={value} is out of range")
    if self.prefill_batch & (self.prefill_batch - 1):
      raise ValueError(f"EngineConfig.prefill_batch={self.prefill_batch} must be a power of two")
    if self.kv_layout == "paged":
      bad = [w for w in self.attention_windows if w % self.page_size]
      if bad:
        raise ValueError(f"EngineConfig.page_size={self.page_size} does not divide the attention windows {bad} "
                         f"(max_prompt_length + max_new_tokens and short_attention_windows)")

  @property
  def cache_length(self) -> int:
    return self.max_prompt_length + self.max_new_tokens

  @property
  def prefill_buckets(self) -> tuple[int, ...]:
    buckets, size = [], self.min_prefill_bucket
    while size < self.max_prompt_length:
      buckets.append(size)
      size *= 2
    return tuple(buckets) + (self.max_prompt_length,)

  @property
  def row_buckets(self) -> tuple[int, ...]:
    """Prompts per prefill call: the powers of two up to `prefill_batch`."""
    return tuple(1 << k for k in range(self.prefill_batch.bit_length()))

  def row_bucket_for(self, rows: int) -> int:
    """The row bucket a call of `rows` requests (1..prefill_batch) is padded to."""
    return next(r for r in self.row_buckets if r >= max(1, rows))

  @property
  def step_options(self) -> tuple[int, ...]:
    """Steps a decode call may take (the sampler's decode-steps policy picks one): the powers of two below
    `steps_per_sync`, and it."""
    return tuple(1 << k for k in range(self.steps_per_sync.bit_length()) if 1 << k < self.steps_per_sync) + (
        self.steps_per_sync,)

  @property
  def attention_windows(self) -> tuple[int, ...]:
    """Cache prefixes that decode steps attend over, ascending, the whole cache last. A step reads
    only the smallest one that covers its longest slot."""
    return tuple(sorted({w for w in self.short_attention_windows if w < self.cache_length})) + (self.cache_length,)

  def window_for(self, cache_end: int) -> int:
    """The smallest attention window that covers cache entries [0, cache_end)."""
    return next((w for w in self.attention_windows if w >= cache_end), self.cache_length)

  def bucket_for(self, length: int) -> int:
    if length < 1:
      raise ValueError("empty prompt: a request needs at least one prompt token")
    if length > self.max_prompt_length:
      raise ValueError(f"prompt of {length} tokens exceeds EngineConfig.max_prompt_length={self.max_prompt_length}")
    return next(b for b in self.prefill_buckets if b >= length)

  @property
  def extend_buckets(self) -> tuple[int, ...]:
    """Lengths an `extend` call pads its tokens to: powers of two from 8, and the whole cache."""
    out, size = [], 8
    while size < self.cache_length:
      out.append(size)
      size *= 2
    return (*out, self.cache_length)

  @property
  def resume_buckets(self) -> tuple[int, ...]:
    """Length buckets past max_prompt_length that only resumed requests use: powers of two, the cache last."""
    buckets, size = [], 1 << self.max_prompt_length.bit_length()
    while size < self.cache_length:
      buckets.append(size)
      size *= 2
    return tuple(buckets) + (self.cache_length,)

  def resume_bucket_for(self, length: int) -> int:
    """The length bucket of a resumed request's prefill (its prompt + tokens so far but the last), which may
    exceed max_prompt_length (then one of `resume_buckets`)."""
    if length <= self.max_prompt_length:
      return self.bucket_for(length)
    if length >= self.cache_length:
      raise ValueError(f"a resumed request of {length} tokens does not fit the cache of {self.cache_length} "
                       f"(max_prompt_length + max_new_tokens)")
    return next(b for b in self.resume_buckets if b >= length)


KV_LAYOUTS = ("contiguous", "paged")


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
  """A run's sampler side: its engine, the precision of the weights it samples with, how it takes an update while
  rows run, and the rewards and environments its samples meet."""

  # the sampler's weights: 'auto' (the dtype the model computes in: JobConfig.compute_dtype as this machine resolves
  # it), float32, bfloat16 or int8 (see models.precision)
  precision: str = "auto"
  quantize_on: str = "trainer"  # where weights are reduced: "trainer" (fewer bytes move) or "sampler"
  # async: a sampler takes its next lease while the last one's rows still run, applying each new version
  # between decode calls; every token records the version that sampled it
  in_flight: bool = False
  in_flight_cache: str = "keep"  # in_flight: rows running at an update "keep" their KV cache, or "recompute" it
  # truncated sampling of a run's samples; the trainer scores each token over the same support, renormalised
  top_k: int = 0  # sample from the k most likely tokens (0: off)
  top_p: float = 1.0  # ... from the fewest most likely tokens holding this share of the mass (1: off)
  min_p: float = 0.0  # ... from the tokens at least min_p times as likely as the most likely (0: off)
  engine: EngineConfig = EngineConfig()
  reward: RewardConfig = RewardConfig()
  env: EnvConfig = EnvConfig()  # multi-turn: the environment or agent program the samples play

  def __post_init__(self):
    if self.precision not in ("auto", *PRECISIONS):
      raise ValueError(f"SamplerConfig.precision={self.precision!r}; known: {['auto', *PRECISIONS]}")
    if self.quantize_on not in QUANTIZE_ON:
      raise ValueError(f"SamplerConfig.quantize_on={self.quantize_on!r}; known: {list(QUANTIZE_ON)}")
    if self.top_k < 0 or not 0 < self.top_p <= 1 or not 0 <= self.min_p <= 1:
      raise ValueError(f"SamplerConfig: top_k must be >= 0 (0: off), top_p in (0, 1] (1: off), min_p in [0, 1] (0: "
                       f"off); got {self.top_k}, {self.top_p}, {self.min_p}")
    if self.in_flight_cache not in IN_FLIGHT_CACHE:
      raise ValueError(f"SamplerConfig.in_flight_cache={self.in_flight_cache!r}; known: {list(IN_FLIGHT_CACHE)}")
