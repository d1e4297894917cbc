"""What `streamrl train` runs around the pipeline (`JobConfig`): the model (a catalog name, a GGUF, a Hugging Face
directory or Hub id, or the tiny demo decoder) and its compute dtype, the supervised warm-up, the held-out evaluation,
checkpoints and trackers, with the run's `TaskConfig`; and the model it builds from them."""

from __future__ import annotations

import dataclasses

from flax import nnx

from streamrl_jax.models import CharTokenizer, ModelConfig, Transformer, load_hf, load_tokenizer, read_hf_config
from streamrl_jax.models.catalog import resolve_model
from streamrl_jax.models.config import COMPUTE_DTYPES
from streamrl_jax.models.dtype_probe import DtypeChoice, ProductShapes, choose_compute_dtype
from streamrl_jax.tasks.config import NEEDS_A_PRETRAINED_MODEL, TaskConfig

REPORT_TO = ("tensorboard", "wandb")  # JobConfig.report_to's trackers


@dataclasses.dataclass(frozen=True)
class DemoModelConfig:
  """The tiny demo decoder's shape (`JobConfig` with no `model`): 4 query and 2 KV heads, an MLP 4x the width."""

  hidden_size: int = 64  # width: 4 query and 2 KV heads of hidden_size / 4, an MLP of 4 x hidden_size
  num_layers: int = 2  # decoder layers


@dataclasses.dataclass(frozen=True)
class JobConfig:
  """What `streamrl train` runs around the pipeline."""

  model: str = ""  # a catalog name ('smollm2-135m-instruct'), a .gguf file, a Hugging Face directory or Hub id
  warmup_steps: int = 300  # demo decoder: supervised steps on worked solutions before RL (0: none)
  warmup_batch: int = 32  # demo decoder's warm-up: worked solutions per supervised step
  warmup_learning_rate: float = 3e-3  # demo decoder's warm-up: peak learning rate (reached after 20 steps)
  eval_prompts: int = 128  # held-out prompts of the greedy accuracy measured before and after RL
  # also every this many RL steps, for the lead and each arm (a row's `heldout_accuracy`; it takes the evaluating
  # policy's own time); 0: before and after only
  eval_every: int = 0
  # evaluation at k (at each of those evaluations): k samples of each held-out prompt, scored as `heldout_avg@K`
  # and `heldout_pass@K` beside the greedy accuracy; 0: greedy only
  eval_k: int = 0
  eval_temperature: float = 1.0  # evaluation at k: the samples' temperature
  eval_top_p: float = 1.0  # evaluation at k: the samples' nucleus (1: off)
  # RL steps between checkpoints (the last step's, and a stopped run's, always saved); a killed run resumes from
  # the latest and trains the steps after it again
  checkpoint_every: int = 1
  demo: DemoModelConfig = DemoModelConfig()  # the demo decoder's shape, when there is no `model`
  # activations and matmuls of the trainer and the sampler: 'auto' (bfloat16 on a GPU or TPU; on a CPU the faster
  # of the two for this model's products, measured once per machine: models/dtype_probe.py), 'float32' or
  # 'bfloat16'; weights and optimizer state stay float32 ('streamrl info' and settings.json name the choice)
  compute_dtype: str = "auto"
  seed: int = 0  # seeds the demo decoder, the warm-up, the evaluation prompts and the preflight checks
  # where metrics rows go besides metrics.jsonl: 'tensorboard' (WORKDIR/tensorboard), 'wandb' (Weights & Biases,
  # the [wandb] extra; its WANDB_* environment honoured)
  report_to: tuple[str, ...] = ("tensorboard",)
  task: TaskConfig = TaskConfig()  # what the run trains on (TaskConfig.* keys)

  def __post_init__(self):
    object.__setattr__(self, "report_to", (self.report_to,) if isinstance(self.report_to, str) else
                       tuple(self.report_to))
    if unknown := [r for r in self.report_to if r not in REPORT_TO]:
      raise ValueError(f"JobConfig.report_to: {unknown[0]!r} is not a tracker; known: {list(REPORT_TO)}")
    if self.task.name in NEEDS_A_PRETRAINED_MODEL and not self.model:
      raise ValueError(f"TaskConfig.name={self.task.name!r} needs a pretrained model (JobConfig.model: a catalog name, "
                       "a .gguf file, a Hugging Face directory or Hub id) whose tokenizer can encode the prompts")
    if self.task.chat and not self.model:
      raise ValueError("TaskConfig.chat needs a pretrained model with a chat template (JobConfig.model)")
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"JobConfig.compute_dtype={self.compute_dtype!r}; known: {list(COMPUTE_DTYPES)}")
    if self.eval_every < 0:
      raise ValueError(f"JobConfig.eval_every must be >= 0 (0: before and after RL only), got {self.eval_every}")
    if self.eval_k < 0 or self.eval_temperature <= 0 or not 0 < self.eval_top_p <= 1:
      raise ValueError(f"JobConfig.eval_k must be >= 0 (0: greedy only), eval_temperature > 0 and eval_top_p in "
                       f"(0, 1]; got {self.eval_k}, {self.eval_temperature} and {self.eval_top_p}")
    if self.checkpoint_every < 1:
      raise ValueError(f"JobConfig.checkpoint_every must be >= 1 (RL steps between checkpoints), got "
                       f"{self.checkpoint_every}")
    if self.warmup_steps < 0 or self.eval_prompts < 1:
      raise ValueError("JobConfig.warmup_steps must be >= 0 and eval_prompts >= 1")

  def model_path(self):
    """The pretrained model's Hugging Face directory (fetched and converted on first use)."""
    return resolve_model(self.model)

  def make_task(self, tokenizer=None, split: str = "train"):
    """The task's prompts and rewards (`TaskConfig.make_task`)."""
    return self.task.make_task(tokenizer, split, self.model)

  def load_model(self):
    """(model, tokenizer, needs warm-up): the pretrained model, else the tiny demo decoder."""
    if self.model:
      path = self.model_path()
      return load_hf(path, compute_dtype=self.dtype()), load_tokenizer(path), False
    tokenizer = CharTokenizer()
    return Transformer(self.model_config(tokenizer), rngs=nnx.Rngs(self.seed)), tokenizer, self.warmup_steps > 0

  def model_spec(self):
    """(ModelConfig, tokenizer) without the weights: what a sampler needs before the trainer's arrive."""
    if self.model:
      path = self.model_path()
      return read_hf_config(path, dtype=self.dtype(), param_dtype="float32"), load_tokenizer(path)
    tokenizer = CharTokenizer()
    return self.model_config(tokenizer), tokenizer

  def model_config(self, tokenizer, dtype: str | None = None) -> ModelConfig:
    """The demo decoder's config (computing in `dtype`, default this job's)."""
    demo = self.demo
    return ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=demo.hidden_size,
                       intermediate_size=4 * demo.hidden_size, num_layers=demo.num_layers, num_heads=4,
                       num_kv_heads=2, eos_token_id=tokenizer.eos_id, dtype=dtype or self.dtype())

  def dtype(self) -> str:
    """The dtype this process computes in (`compute_choice`)."""
    return self.compute_choice().dtype

  def compute_choice(self) -> DtypeChoice:
    """What `compute_dtype` means for this job's model on this process's backend, and why: 'auto' is bfloat16 on
    an accelerator and on a CPU the faster at the model's product shapes (`models.dtype_probe`, cached per machine)."""
    if self.compute_dtype != "auto":
      return choose_compute_dtype(self.compute_dtype, None)
    shapes = read_hf_config(self.model_path()) if self.model else self.model_config(CharTokenizer(), "float32")
    return choose_compute_dtype("auto", ProductShapes.of(shapes))
