"""What `streamrl train` runs around the pipeline (`JobConfig`): the task, the model (a catalog name, a GGUF, a
Hugging Face directory or Hub id, or the tiny demo decoder), the supervised warm-up and the held-out evaluation;
and the model and task it builds from them."""

from __future__ import annotations

import dataclasses

from flax import nnx

from streamrl_jax.models import CharTokenizer, ModelConfig, Transformer, load_hf, load_tokenizer, read_hf_config
from streamrl_jax.models.config import COMPUTE_DTYPES, resolve_compute_dtype
from streamrl_jax.tasks import ArithmeticTask, ChatTask, CountdownTask, FileTask, MultiplyTask, PromptFile, SumsTask

TASKS = ("arithmetic", "countdown", "file", "sums", "multiply", "multiply_no_tool")
REPORT_TO = ("tensorboard", "wandb")  # JobConfig.report_to's trackers


@dataclasses.dataclass(frozen=True)
class JobConfig:
  """What `streamrl train` runs around the pipeline."""

  # arithmetic, countdown, sums, multiply, multiply_no_tool (built-in tasks), or "file": your JSONL/Parquet rows;
  # "file" and "sums" need a pretrained model
  task: str = "arithmetic"
  # task "file": a .jsonl or .parquet file, a directory of .parquet shards, or a Hub dataset's file or folder of
  # shards (hf://datasets/org/name[@revision]/path, fetched into the Hugging Face cache)
  prompt_file: str = ""
  prompt_key: str = "question"  # the column holding the prompt; the others go to the rewards as fields
  answer_key: str = "answer"  # the column the built-in numeric verifier reads (when RewardConfig names no function)
  eval_file: str = ""  # task "file": held-out rows for the greedy accuracy before and after; "": eval_fraction
  # task "file" without eval_file: share of the prompts held out by a stable hash (0: evaluate on the training rows)
  eval_fraction: float = 0.0
  model: str = ""  # a catalog name ('smollm2-135m-instruct'), a .gguf file, a Hugging Face directory or Hub id
  chat: bool = False  # put each prompt into the model's chat template (a user turn, then the assistant's)
  system_prompt: str = ""  # chat: the system message; "": the template's own default
  max_digits: int = 4  # task "arithmetic": most digits of each operand (long-tailed draw)
  sum_digits: int = 2  # task "sums": digits of each term
  sum_terms: int = 2  # task "sums": terms per problem (at least 2)
  multiply_digits: int = 3  # task "multiply" (worked solutions call the calculator) and "multiply_no_tool"
  warmup_steps: int = 300  # demo decoder: supervised steps on worked solutions before RL (0: none)
  warmup_batch: int = 32  # demo decoder's warm-up: worked solutions per supervised step
  warmup_learning_rate: float = 3e-3  # demo decoder's warm-up: peak learning rate (reached after 20 steps)
  eval_prompts: int = 128  # held-out prompts of the greedy accuracy measured before and after RL
  # also every this many RL steps, for the lead and each arm (a row's `heldout_accuracy`; it takes the evaluating
  # policy's own time); 0: before and after only
  eval_every: int = 0
  # RL steps between checkpoints (the last step's, and a stopped run's, always saved); a killed run resumes from
  # the latest and trains the steps after it again
  checkpoint_every: int = 1
  hidden_size: int = 64  # demo decoder (no `model`): width (its MLP is 4x); 4 query and 2 KV heads
  num_layers: int = 2  # demo decoder (no `model`): decoder layers
  # activations and matmuls of the trainer and the sampler: 'auto' (bfloat16 on a GPU or TPU, float32 on a CPU),
  # 'float32' or 'bfloat16'; weights and optimizer state stay float32 ('streamrl info' names the choice)
  compute_dtype: str = "auto"
  seed: int = 0  # seeds the demo decoder, the warm-up, the evaluation prompts and the preflight checks
  # where metrics rows go besides metrics.jsonl: 'tensorboard' (WORKDIR/tensorboard), 'wandb' (Weights & Biases,
  # the [wandb] extra; its WANDB_* environment honoured)
  report_to: tuple[str, ...] = ("tensorboard",)

  def __post_init__(self):
    object.__setattr__(self, "report_to", (self.report_to,) if isinstance(self.report_to, str) else
                       tuple(self.report_to))
    if unknown := [r for r in self.report_to if r not in REPORT_TO]:
      raise ValueError(f"JobConfig.report_to: {unknown[0]!r} is not a tracker; known: {list(REPORT_TO)}")
    if self.task not in TASKS:
      raise ValueError(f"JobConfig.task={self.task!r}; known: {list(TASKS)}")
    if self.compute_dtype not in COMPUTE_DTYPES:
      raise ValueError(f"JobConfig.compute_dtype={self.compute_dtype!r}; known: {list(COMPUTE_DTYPES)}")
    if self.task == "file" and not self.prompt_file:
      raise ValueError("JobConfig.task='file' needs JobConfig.prompt_file")
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(f"JobConfig.eval_fraction must lie in [0, 1), got {self.eval_fraction}")
    if self.eval_file and self.eval_fraction:
      raise ValueError("set JobConfig.eval_file or JobConfig.eval_fraction, not both")
    if self.task in ("file", "sums") and not self.model:
      raise ValueError(f"JobConfig.task={self.task!r} needs a pretrained model (JobConfig.model: a catalog name, "
                       "a .gguf file, a Hugging Face directory or Hub id) whose tokenizer can encode the prompts")
    if self.chat and not self.model:
      raise ValueError("JobConfig.chat needs a pretrained model with a chat template (JobConfig.model)")
    if self.eval_every < 0:
      raise ValueError(f"JobConfig.eval_every must be >= 0 (0: before and after RL only), got {self.eval_every}")
    if self.checkpoint_every < 1:
      raise ValueError(f"JobConfig.checkpoint_every must be >= 1 (RL steps between checkpoints), got "
                       f"{self.checkpoint_every}")
    if self.warmup_steps < 0 or self.eval_prompts < 1:
      raise ValueError("JobConfig.warmup_steps must be >= 0 and eval_prompts >= 1")

  def model_path(self):
    """The pretrained model's Hugging Face directory (fetched and converted on first use)."""
    from streamrl_jax.models.catalog import resolve_model

    return resolve_model(self.model)

  def make_task(self, tokenizer=None, split: str = "train"):
    """The task's prompts and rewards; `split="eval"` draws held-out prompts where the task has a split.
    With `chat`, prompts go into the tokenizer's chat template."""
    if self.task == "file":
      from streamrl_jax.models.hub import prompt_source

      if split == "eval" and self.eval_file:
        source = PromptFile(prompt_source(self.eval_file), self.prompt_key)
      else:
        held = ("heldout" if split == "eval" else "train") if self.eval_fraction else "all"
        source = PromptFile(prompt_source(self.prompt_file), self.prompt_key, split=held,
                            heldout_fraction=self.eval_fraction)
      task = FileTask(source, self.answer_key)
    elif self.task == "sums":
      task = SumsTask(self.sum_digits, self.sum_terms, "heldout" if split == "eval" else "train")
    elif self.task in ("multiply", "multiply_no_tool"):
      task = MultiplyTask(self.multiply_digits, tool=self.task == "multiply")
    else:
      task = ArithmeticTask(max_digits=self.max_digits) if self.task == "arithmetic" else CountdownTask()
    if not self.chat:
      return task
    if not tokenizer.chat_template:
      raise ValueError(f"JobConfig.chat is set but the model {self.model!r} has no chat template "
                       "(tokenizer_config.json: chat_template)")
    return ChatTask(task, tokenizer.chat_format(self.system_prompt or None))

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

  def model_config(self, tokenizer) -> ModelConfig:
    return ModelConfig(vocab_size=tokenizer.vocab_size, hidden_size=self.hidden_size,
                       intermediate_size=4 * self.hidden_size, num_layers=self.num_layers, num_heads=4,
                       num_kv_heads=2, eos_token_id=tokenizer.eos_id, dtype=self.dtype())

  def dtype(self) -> str:
    """The dtype this process computes in (`compute_dtype` resolved on its backend)."""
    return resolve_compute_dtype(self.compute_dtype)
