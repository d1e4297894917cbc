"""TRL's GRPOTrainer on the equal-work workload streamrl is held against: the baseline `step_profile.py` runs beside
its own modes, in the same sitting.

SmolLM2-135M-Instruct (the same files streamrl loads), 4 prompts of the sums task (`What is 47 + 85? Reply with only
the number.`, as a user message in the model's chat template) x 8 generations x 32 new tokens, temperature 1, no KL
(beta 0), a constant learning rate of 3e-6, one optimizer step per 32 samples, on the CPU, no checkpoints; gradient
checkpointing on (TRL's default) or off, float32 or with bfloat16 autocast (`--bf16`, TRL's `bf16=True`). The step is
the median gap between step ends after the first two, as step_profile reads streamrl's rows; `trl_tokens_per_step` the
real (prompt and completion) tokens TRL's log counts a step, as streamrl's `train_tokens`. Needs the `[bench]` extra
(trl, datasets, accelerate). Prints one JSON object as its last line.

  python benchmarks/trl_grpo.py [--steps 6] [--new-tokens 32] [--gradient-checkpointing on|off] [--bf16]
  python benchmarks/trl_grpo.py --torch-bf16-speedup   # torch's bfloat16 product speed over float32's, this CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# Run as a script, this folder comes first on the path: its `multiprocess.py` would shadow the package datasets uses.
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

PROMPTS, GENERATIONS, SKIP = 4, 8, 2
PRODUCT = 1024  # the torch products timed for --torch-bf16-speedup


def torch_bf16_speedup(n: int = PRODUCT, repeats: int = 5) -> float:
  """torch's bfloat16 n x n product speed over its float32 one on this CPU (best of `repeats` each): above 1 where
  the CPU has bfloat16 matrix units (AMX), far below where it has none."""
  import torch

  best = {}
  for dtype in (torch.float32, torch.bfloat16):
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    times = []
    for _ in range(repeats):
      start = time.perf_counter()
      a @ b
      times.append(time.perf_counter() - start)
    best[dtype] = min(times)
  return best[torch.float32] / best[torch.bfloat16]


def questions(count: int, seed: int = 0) -> list[str]:
  import numpy as np

  from streamrl_jax.tasks.sums import SumsTask

  rng = np.random.default_rng(seed)
  return [SumsTask(digits=2).sample(rng)[0] for _ in range(count)]


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--new-tokens", type=int, default=32)
  parser.add_argument("--gradient-checkpointing", choices=("on", "off"), default="on")
  parser.add_argument("--bf16", action="store_true", help="bfloat16 autocast (TRL's bf16=True)")
  parser.add_argument("--torch-bf16-speedup", action="store_true", help="only time torch's products; print the ratio")
  args = parser.parse_args(argv)
  if args.torch_bf16_speedup:
    return {"torch_bf16_speedup": round(torch_bf16_speedup(), 3)}

  import torch
  from datasets import Dataset
  from transformers import TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  from streamrl_jax.models.catalog import resolve_model
  from streamrl_jax.tasks.sums import sums_reward

  model_dir = str(resolve_model("smollm2-135m-instruct"))
  data = Dataset.from_list([{"prompt": [{"role": "user", "content": q}], "question": q}
                            for q in questions(PROMPTS * args.steps)])

  def correct(completions, question, **_):
    return [sums_reward(q, c[0]["content"]) for q, c in zip(question, completions)]

  ends: list[float] = []
  seen: list[float] = []  # TRL's cumulative `num_tokens` at each logged step

  class StepEnds(TrainerCallback):
    def on_step_end(self, *_, **__):
      ends.append(time.perf_counter())

    def on_log(self, *_, logs=None, **__):
      if logs and "num_tokens" in logs:
        seen.append(float(logs["num_tokens"]))

  with tempfile.TemporaryDirectory(prefix="trl_grpo_") as out:
    config = GRPOConfig(output_dir=out, per_device_train_batch_size=PROMPTS * GENERATIONS,
                        gradient_accumulation_steps=1, num_generations=GENERATIONS,
                        max_completion_length=args.new_tokens, temperature=1.0, beta=0.0, learning_rate=3e-6,
                        lr_scheduler_type="constant", max_steps=args.steps, logging_steps=1, save_strategy="no",
                        report_to=[], use_cpu=True, bf16=args.bf16, seed=0, shuffle_dataset=False,
                        gradient_checkpointing=args.gradient_checkpointing == "on")
    trainer = GRPOTrainer(model=model_dir, reward_funcs=correct, args=config, train_dataset=data,
                          callbacks=[StepEnds()])
    start = time.perf_counter()
    trainer.train()
  gaps = [b - a for a, b in zip([start, *ends], ends)]
  tokens = [b - a for a, b in zip([0.0, *seen], seen)]
  return {"trl_step_s": round(statistics.median(gaps[SKIP:]), 2), "trl_steps": len(gaps),
          "trl_step_gaps_s": [round(g, 2) for g in gaps], "torch_threads": torch.get_num_threads(),
          "trl_tokens_per_step": statistics.median(tokens[SKIP:]) if len(tokens) > SKIP else None,
          "trl_gradient_checkpointing": args.gradient_checkpointing, "trl_bf16": args.bf16}


if __name__ == "__main__":
  print(json.dumps(main()))
