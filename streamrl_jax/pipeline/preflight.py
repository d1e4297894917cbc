"""Mistakes found before any model is built or compiled: the workdir, a resume, the devices, the prompts, the
reward functions.

`streamrl train`, `streamrl trainer` and `streamrl sampler` run these first, so a wrong setting costs
seconds, not a warm-up: each error names the key, file or row to change. A run records its settings in
WORKDIR/settings.json; a resume that changes one the checkpoint depends on is refused.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from streamrl_jax.envs.catalog import make_environment
from streamrl_jax.envs.tools import stop_token_ids
from streamrl_jax.meshes import role_mesh_shape
from streamrl_jax.models import lora
from streamrl_jax.models.config import ModelConfig
from streamrl_jax.models.kv_cache import kv_cache_bytes
from streamrl_jax.models.peft_io import resolve
from streamrl_jax.pipeline.config import PipelineConfig
from streamrl_jax.records.run_files import read_settings
from streamrl_jax.rewards import RewardConfig, check_signature
from streamrl_jax.settings import renamed
from streamrl_jax.tasks import FileTask, draw, prompt_tokens, question
from streamrl_jax.training.corrections import CORRECTIONS
from streamrl_jax.training.packing import auto_budget, chunk_tokens_for

# Settings a resumed run may change: how long it runs, how it is evaluated, where it runs, how fast it learns, and
# what the machine it runs on makes of 'auto' ("resolved.": the weights are float32 whatever the compute dtype).
CHANGEABLE_ON_RESUME = ("PipelineConfig.steps", "WaitConfig.",
                        "JobConfig.eval_prompts", "JobConfig.eval_every", "JobConfig.warmup_", "MeshConfig.",
                        "EngineConfig.", "OptimizerConfig.learning_rate", "RewardConfig.workers", "RewardConfig.timeout_s",
                        "RewardConfig.on_error", "TrainerConfig.",
                        "resolved.")
URL_SCHEMES = ("gs://", "s3://", "hdfs://", "http://", "https://")
PROMPT_SAMPLES = 256  # prompts drawn from a generated task to check their length


def check_workdir(workdir) -> Path:
  text = str(workdir)
  if text.startswith(URL_SCHEMES):
    raise ValueError(f"--workdir {text}: the job writes its workdir with file APIs; mount the bucket (Cloud Storage "
                     "FUSE; `streamrl launch gke` does) and pass the mounted path")
  path = Path(workdir)
  if path.exists() and not path.is_dir():
    raise ValueError(f"--workdir {text} is a file, not a directory")
  return path


def check_resume(workdir: Path, settings: dict[str, str], resume: bool | str, latest_step: int | None) -> bool:
  """Whether the run resumes (`resume` "auto": when there is a checkpoint); raises on a resume without a
  checkpoint, a fresh start over checkpoints, or a resume whose settings the checkpoint cannot take."""
  if resume == "auto":
    resume = latest_step is not None
  checkpoints = workdir / "checkpoints"
  if resume and latest_step is None:
    raise FileNotFoundError(f"--resume: there is no checkpoint in {checkpoints} to resume from")
  if not resume and latest_step is not None:
    raise ValueError(f"{workdir} holds checkpoints up to step {latest_step}: continue them with --resume, or start "
                     f"afresh in another --workdir (or delete {checkpoints} yourself)")
  saved = read_settings(workdir) if resume else None
  if saved is not None:
    saved = renamed(saved)
    changed = sorted(k for k in saved.keys() | settings.keys()
                     if saved.get(k) != settings.get(k) and not k.startswith(CHANGEABLE_ON_RESUME))
    if changed:
      listed = "; ".join(f"{k}: {saved.get(k, '(unset)')} -> {settings.get(k, '(unset)')}" for k in changed)
      raise ValueError(f"--resume: the checkpoint in {checkpoints} was made with other settings ({listed}); put them "
                       "back, or start afresh in another --workdir")
  return bool(resume)


def check_devices(config: PipelineConfig, role: str, num_devices: int) -> None:
  """The meshes of `role` ("train": both in one program; "trainer"; "sampler") fit `num_devices`."""
  if role == "trainer" and config.spec.shared_mesh:
    raise ValueError(f"PipelineConfig.mode={config.mode!r} time-shares one mesh in one program: run `streamrl train`")
  if role == "train":
    sampler_devices = num_devices if config.spec.shared_mesh else config.mesh.split(num_devices)[0].size
  elif role == "trainer":
    role_mesh_shape(config.mesh, "trainer", num_devices)
    return
  else:
    sampler_devices = role_mesh_shape(config.mesh, "sampler", num_devices).size
  instances = config.scheduling.instance_limit
  if instances > 1 and sampler_devices % instances:
    raise ValueError(f"SchedulingConfig.max_instances={instances} does not divide the {sampler_devices} sampler "
                     "devices")


def check_prompts(task, tokenizer, max_prompt_length: int, seed: int = 0) -> None:
  """Every prompt of a file task (a sample of a generated one) fits `EngineConfig.max_prompt_length`."""
  source = getattr(task, "source", None)
  if source is not None:
    prompts = ((i, source[i]["prompt"]) for i in range(len(source)))
    where = lambda i: f"{source.path}, row {i}"  # noqa: E731
  else:
    rng = np.random.default_rng(seed)
    prompts = ((i, task.sample(rng)[0]) for i in range(PROMPT_SAMPLES))
    where = lambda i: f"a prompt of the {type(task).__name__}"  # noqa: E731
  for i, prompt in prompts:
    length = len(prompt_tokens(task, tokenizer, prompt))
    if length > max_prompt_length:
      raise ValueError(f"{where(i)}: {length} prompt tokens exceed EngineConfig.max_prompt_length={max_prompt_length}")
    if length == 0:
      raise ValueError(f"{where(i)}: the prompt encodes to no tokens")


def check_stops(config: PipelineConfig, tokenizer) -> None:
  """The ids that end a turn (the model's eos ids, its template's end of turn, the environment's stop) fit
  `EngineConfig.max_stop_tokens`."""
  stops = set(tokenizer.stop_ids)
  if config.sampler.env.environment:
    stops |= set(stop_token_ids(tokenizer, make_environment(config.sampler.env.environment,
                                                            max_turns=config.sampler.env.max_turns).stop))
  if len(stops) > config.sampler.engine.max_stop_tokens:
    raise ValueError(f"a turn ends on any of {len(stops)} tokens {sorted(stops)} (the model's eos ids, its end of "
                     f"turn, the environment's stop), more than EngineConfig.max_stop_tokens="
                     f"{config.sampler.engine.max_stop_tokens}: set it to {len(stops)}")


def check_activation_budget(config: PipelineConfig, model_config: ModelConfig) -> None:
  """An explicit `TrainerConfig.activation_budget_mb` holds at least one packed row of activations (the
  automatic one is checked against the device when the trainer starts)."""
  if config.trainer.packing and config.trainer.activation_budget_mb:
    chunk_tokens_for(model_config, config.packed_length, config.packed_length,
                     config.trainer.activation_budget_mb << 20, config.trainer, reference=config.trainer.objective.kl_coef > 0)


RUNTIME_BYTES = 1 << 30  # a JAX process's own resident memory (libraries, compiled programs, host buffers)
# A sampler's weights as it computes with them: int8 moves as int8 but is dequantized to float32 (models.precision).
PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "int8": 4}


def host_memory_parts(config: PipelineConfig, model_config: ModelConfig, role: str) -> dict[str, int]:
  """The host memory a CPU run of `role` ("train": both sides in one program; "trainer"; "sampler") holds, in
  bytes by part: the trainer's state (parameters, summed float32 gradient, two Adam moments; a frozen reference
  with a KL penalty; with LoRA the frozen base and the adapters' state), one trainer call's temporaries (its
  activation budget), the sampler's weights at their precision (with LoRA beside its float32 base) and its KV
  cache, and the runtime. What `check_host_memory` compares with the machine."""
  params = model_config.param_count()
  weight = np.dtype(model_config.weight_dtype).itemsize
  parts = {"runtime": RUNTIME_BYTES}
  lora_params = lora.adapter_param_count(config.trainer.lora, model_config) if config.trainer.lora.rank else 0
  if role in ("train", "trainer"):
    reference = config.trainer.objective.kl_coef > 0
    if lora_params:  # the frozen base (the reference too), and the adapters' values, gradient and two moments
      parts["trainer state"] = params * weight + lora_params * 16
    else:
      parts["trainer state"] = params * (3 * weight + 4 + (weight if reference else 0))
    parts["trainer call"] = (config.trainer.activation_budget_mb << 20 or
                             auto_budget(model_config, config.packed_length, config.trainer, "cpu", reference))
  if role in ("train", "sampler"):
    instances = config.scheduling.instance_limit
    parts["sampler weights"] = params * (PRECISION_BYTES[config.sampler.precision] + (4 if lora_params else 0))
    parts["sampler KV cache"] = instances * kv_cache_bytes(model_config, config.sampler.engine.num_slots,
                                                           config.sampler.engine.cache_length)
  return parts


def available_host_bytes() -> int:
  """Memory the machine can still give (MemAvailable of /proc/meminfo; 0 where that cannot be read)."""
  try:
    for line in Path("/proc/meminfo").read_text().splitlines():
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  except (OSError, ValueError, IndexError):
    pass
  return 0


def check_host_memory(config: PipelineConfig, model_config: ModelConfig, role: str, available: int) -> None:
  """A CPU run whose estimate (`host_memory_parts`) exceeds the `available` bytes is refused before anything is
  built, with the estimate by part: said at start, not an out-of-memory kill an hour in. 0: not known, no check."""
  parts = host_memory_parts(config, model_config, role)
  need = sum(parts.values())
  if available and need > available:
    gib = lambda n: f"{n / 2**30:.1f} GiB"  # noqa: E731
    said = ", ".join(f"{name} {gib(n)}" for name, n in parts.items())
    raise ValueError(f"this run needs about {gib(need)} of memory ({said}; {model_config.param_count():,} "
                     f"parameters) but the machine has {gib(available)} available: use a smaller model, or lower "
                     "TrainerConfig.activation_budget_mb, EngineConfig.num_slots or "
                     "SamplerConfig.precision='bfloat16'")


def check_lora(config: PipelineConfig, model_config: ModelConfig, base_name: str,
               read_adapter: bool = True) -> PipelineConfig:
  """`config` with LoRA resolved (`peft_io.resolve`: an `init_from` adapter checked against the base, its rank,
  alpha and targets taken where LoraConfig.rank is unset), and the rank checked against the model's projections:
  one-line errors before anything is built. `read_adapter=False`: a sampler, which never reads the adapter."""
  if not config.trainer.lora.enabled:
    return config
  resolved = resolve(config.trainer.lora, model_config, base_name, read=read_adapter or not config.trainer.lora.rank)
  lora.check(resolved, model_config)
  return dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, lora=resolved))


def check_rewards(reward: RewardConfig, task, seed: int = 0) -> None:
  """Every configured reward function imports and can take the first prompt's row, before anything compiles;
  with none, the task's own verifier finds what it reads (a file task: its answer column in every row)."""
  prompt, row = draw(task, np.random.default_rng(seed))
  for spec in reward.functions:
    check_signature(spec, question(task, prompt), row.fields)
  files = getattr(task, "task", task)  # a file task, or one in a chat template
  if not reward.functions and isinstance(files, FileTask) and (missing := files.missing_answer()) is not None:
    raise ValueError(f"{missing}: no {files.answer_key!r} column, which the built-in numeric verifier reads "
                     "(set TaskConfig.answer_key, or name your reward functions in RewardConfig.functions)")




def correction_advice(config: PipelineConfig) -> str | None:
  """One line for a run whose tokens come from another policy (async staleness, in-flight updates, a sampler in
  lower precision) under an objective that does not correct for it; None when nothing to say."""
  objective = config.trainer.objective
  sources = ([f"PipelineConfig.mode={config.mode!r} (staleness {config.spec.max_lag})"] if config.spec.max_lag else [])
  sources += ["SamplerConfig.in_flight"] if config.sampler.in_flight else []
  sources += [f"SamplerConfig.precision={config.sampler.precision!r}"] if config.sampler.precision != "float32" else []
  if not sources or objective.corrected:
    return None
  return (f"{' and '.join(sources)}: tokens another policy sampled are trained on uncorrected (ObjectiveConfig."
          f"correction='none', old_logprobs={objective.old_logprobs!r}); the default correction 'token_tis' or "
          f"another of {CORRECTIONS.names()} weighs each token by it")