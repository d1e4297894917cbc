"""Generation on the sampler mesh: the decode engine and the continuous-batching driver."""

from streamrl_jax.sampling.admission import AdmissionPolicy
from streamrl_jax.sampling.config import SamplerConfig
from streamrl_jax.sampling.streaming_sampler import StreamingSampler
from streamrl_jax.sampling.engine import DecodeEngine, DecodeState, Engine, EngineConfig, Prefix, StepOutput
from streamrl_jax.sampling.engines import ENGINES, kv_tokens, make_engine
from streamrl_jax.sampling.paged_engine import PagedDecodeEngine
from streamrl_jax.sampling.profile import measure_ptl_curve
from streamrl_jax.sampling.token_sampling import filter_logits, sample_tokens

__all__ = ["AdmissionPolicy", "DecodeEngine", "DecodeState", "ENGINES", "Engine", "EngineConfig", "PagedDecodeEngine",
           "Prefix", "SamplerConfig", "StepOutput", "StreamingSampler", "filter_logits", "kv_tokens", "make_engine",
           "measure_ptl_curve", "sample_tokens"]
