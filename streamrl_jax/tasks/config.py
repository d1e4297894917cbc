"""What a run trains on (`TaskConfig`): a built-in task or your own prompt rows, their held-out part, and the chat
template they go into; and the task it builds."""

from __future__ import annotations

import dataclasses

from streamrl_jax.models.hub import prompt_source
from streamrl_jax.tasks.arithmetic import ArithmeticTask
from streamrl_jax.tasks.chat import ChatTask
from streamrl_jax.tasks.countdown import CountdownTask
from streamrl_jax.tasks.files import FileTask, PromptFile
from streamrl_jax.tasks.multiply import MultiplyTask
from streamrl_jax.tasks.sums import SumsTask

TASKS = ("arithmetic", "countdown", "file", "sums", "multiply", "multiply_no_tool")
NEEDS_A_PRETRAINED_MODEL = ("file", "sums")  # tasks whose prompts a tokenizer of the demo's characters cannot encode


@dataclasses.dataclass(frozen=True)
class TaskConfig:
  """What a run trains on."""

  # arithmetic, countdown, sums, multiply, multiply_no_tool (built-in tasks: `streamrl tasks` shows their prompts
  # and row fields), or "file": your JSONL/Parquet rows; "file" and "sums" need a pretrained model
  name: str = "arithmetic"
  # task "file": a .jsonl or .parquet file, a directory of .parquet shards, or a Hub dataset's file or folder of
  # shards (hf://datasets/org/name[@revision]/path, fetched into the Hugging Face cache)
  prompt_file: str = ""
  prompt_key: str = "question"  # the column holding the prompt; the others go to the rewards as fields
  answer_key: str = "answer"  # the column the built-in numeric verifier reads (when RewardConfig names no function)
  eval_file: str = ""  # task "file": held-out rows for the evaluations (greedy, at k); "": eval_fraction
  # task "file" without eval_file: share of the prompts held out by a stable hash (0: evaluate on the training rows)
  eval_fraction: float = 0.0
  chat: bool = False  # put each prompt into the model's chat template (a user turn, then the assistant's)
  system_prompt: str = ""  # chat: the system message; "": the template's own default
  # chat: the template's thinking mode (Qwen3's enable_thinking); False renders it off (Qwen3: an empty think block)
  thinking: bool = True
  max_digits: int = 4  # task "arithmetic": most digits of each operand (long-tailed draw)
  sum_digits: int = 2  # task "sums": digits of each term
  sum_terms: int = 2  # task "sums": terms per problem (at least 2)
  multiply_digits: int = 3  # task "multiply" (worked solutions call the calculator) and "multiply_no_tool"

  def __post_init__(self):
    if self.name not in TASKS:
      raise ValueError(f"TaskConfig.name={self.name!r}; known: {list(TASKS)}")
    if self.name == "file" and not self.prompt_file:
      raise ValueError("TaskConfig.name='file' needs TaskConfig.prompt_file")
    if not 0.0 <= self.eval_fraction < 1.0:
      raise ValueError(f"TaskConfig.eval_fraction must lie in [0, 1), got {self.eval_fraction}")
    if self.eval_file and self.eval_fraction:
      raise ValueError("set TaskConfig.eval_file or TaskConfig.eval_fraction, not both")

  def make_task(self, tokenizer=None, split: str = "train", model: str = ""):
    """The task's prompts and rewards; `split="eval"` draws held-out prompts where the task has a split.
    With `chat`, prompts go into `tokenizer`'s chat template (that of `model`, named in an error)."""
    if self.name == "file":
      if split == "eval" and self.eval_file:
        source = PromptFile(prompt_source(self.eval_file), self.prompt_key)
      else:
        held = ("heldout" if split == "eval" else "train") if self.eval_fraction else "all"
        source = PromptFile(prompt_source(self.prompt_file), self.prompt_key, split=held,
                            heldout_fraction=self.eval_fraction)
      task = FileTask(source, self.answer_key)
    elif self.name == "sums":
      task = SumsTask(self.sum_digits, self.sum_terms, "heldout" if split == "eval" else "train")
    elif self.name in ("multiply", "multiply_no_tool"):
      task = MultiplyTask(self.multiply_digits, tool=self.name == "multiply")
    else:
      task = ArithmeticTask(max_digits=self.max_digits) if self.name == "arithmetic" else CountdownTask()
    if not self.chat:
      return task
    if not tokenizer.chat_template:
      raise ValueError(f"TaskConfig.chat is set but the model {model!r} has no chat template "
                       "(tokenizer_config.json: chat_template)")
    return ChatTask(task, tokenizer.chat_format(self.system_prompt or None,
                                                None if self.thinking else {"enable_thinking": False}))
