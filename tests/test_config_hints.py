"""What a TRL user gets wrong in a run's configuration, each answered in one line naming the key or action."""

import re
from pathlib import Path

import pytest

from streamrl_jax import cli, gin_config
from streamrl_jax.trl_names import TRL_NAMES, table

ROOT = Path(__file__).resolve().parent.parent

# (what the user typed, what the one line must say)
MISTAKES = [
    (["--set", "num_generations=4"], "here it is PipelineConfig.group_size"),
    (["--set", "PipelineConfig.num_generations=4"], "here it is PipelineConfig.group_size"),
    (["--set", "GRPOConfig.num_generations=4"], "here it is PipelineConfig.group_size"),
    (["--set", "OptimizerConfig.lr=1e-5"], "here it is OptimizerConfig.learning_rate"),
    (["--set", "Optimizer.learning_rate=1e-5"], "did you mean OptimizerConfig.learning_rate"),
    (["--set", "learning_rate=1e-5"], "did you mean OptimizerConfig.learning_rate"),
    (["--set", "ObjectiveConfig.beta=0.04"], "here it is ObjectiveConfig.kl_coef"),
    (["--set", "PipelineConfig.max_completion_length=64"], "here it is PipelineConfig.max_new_tokens"),
    (["--set", "TrainerConfig.per_device_train_batch_size=4"], "here it is PipelineConfig.prompts_per_step"),
    (["--set", "ObjectiveConfig.epsilon=0.2"], "here it is ObjectiveConfig.clip_low"),
    (["--set", "ObjectiveConfig.loss_type='dr_grpo'"], "here it is ObjectiveConfig.aggregation"),
    (["--set", "ObjectiveConfig.num_iterations=2"], "TRL's name; here it is TrainerConfig.epochs"),
    (["--set", "ppo_mini_batch_size=64"], "verl's name; here it is TrainerConfig.mini_batches (a count here"),
    (["--set", "GRPOConfig.use_vllm=True"], "it has no key here"),
    (["--set", "OptimizerConfig.learning_rate=abc"], "which takes float (e.g. --set OptimizerConfig.learning_rate="),
    (["--set", "OptimizerConfig.learning_rate='1e-4'"], "without its quotes: --set OptimizerConfig.learning_rate=1e-4"),
    (["--set", "TrainerConfig.packing=yes"], "which takes bool (True or False)"),
    (["--config", "configs/smollm2_cpux.gin"], "did you mean smollm2_cpu (a shipped config)?"),
]


@pytest.mark.parametrize("argv, says", MISTAKES, ids=[" ".join(a) for a, _ in MISTAKES])
def test_each_mistake_is_one_line_naming_the_key(capsys, argv, says):
  assert cli.main(["config", *argv]) == 2
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("streamrl config: error: "), err
  assert says in err, err
  gin_config.parse()


def test_a_gin_macro_that_nothing_reads_is_refused_and_one_that_is_read_is_kept(tmp_path):
  unused = tmp_path / "unused.gin"
  unused.write_text("PipelineConfig.steps = 3\nnum_generations = 4\n")
  with pytest.raises(gin_config.ConfigError, match=rf"num_generations: a binding names its config class.*{unused}"):
    gin_config.parse([unused])
  used = tmp_path / "used.gin"
  used.write_text("STEPS = 3\nPipelineConfig.steps = %STEPS\n")
  gin_config.parse([used])
  assert gin_config.build_run()[0].steps == 3
  gin_config.parse()


def test_every_trl_name_points_at_a_key_that_exists():
  known = set(gin_config.KNOWN_KEYS)
  for name, (key, note, _) in TRL_NAMES.items():
    assert key is None or key in known, (name, key)
    assert key is not None or note, name  # no key: the note says why
    for named in re.findall(r"\b[A-Z][A-Za-z]+Config\.[a-z_]+", note):
      assert named in known, (name, named)


def test_the_docs_table_of_trl_names_is_the_one_the_hints_use():
  assert table() in (ROOT / "docs" / "configuration.md").read_text()


def test_a_shipped_config_path_resolves_from_any_folder_and_names_its_short_form(tmp_path, monkeypatch, caplog):
  monkeypatch.chdir(tmp_path)
  with caplog.at_level("INFO", logger="streamrl_jax"):
    found = gin_config.run_files(["configs/smollm2_cpu.gin"])
  assert Path(found[0]) == ROOT / "configs" / "smollm2_cpu.gin"
  assert "short form: --config smollm2_cpu" in caplog.text
  assert gin_config.run_files(["smollm2_cpu"]) == found


def test_a_trl_reward_function_is_told_the_form_a_reward_takes_here(tmp_path):
  from streamrl_jax.rewards.functions import RewardFunctionError, check_signature, checked_value

  path = tmp_path / "trl_rewards.py"
  path.write_text("def reward_len(completions, **kwargs):\n  return [-abs(20 - len(c)) for c in completions]\n\n"
                  "def both(prompts, completions, **kwargs):\n  return [0.0 for _ in completions]\n")
  for name, param in (("reward_len", "completions"), ("both", "prompts")):
    with pytest.raises(RewardFunctionError, match=rf"takes '{param}': TRL's batched form .* fn\(prompt, "
                                                  r"completion, \*\*fields\) -> float, called once per sample"):
      check_signature(f"{path}:{name}", "q", {"answer": "3"})
  value, problem = checked_value([1.0, 0.0])
  assert value is None and "not a batch as TRL's do" in problem


@pytest.mark.parametrize("row, says", [
    ({"prompt": "What is 2+2?", "answer": "4"}, "for the prompt in 'prompt': TaskConfig.prompt_key='prompt'"),
    ({"text": "What is 2+2?"}, "its columns: ['text']"),
    ({"question": [{"role": "user", "content": "What is 2+2?"}]}, "is a conversation (TRL's conversational form)"),
])
def test_a_trl_dataset_row_is_told_which_key_reads_its_prompt(tmp_path, row, says):
  import json

  from streamrl_jax.tasks import PromptFile

  path = tmp_path / "rows.jsonl"
  path.write_text(json.dumps(row) + "\n")
  with pytest.raises(ValueError, match=re.escape(says)) as err:
    PromptFile(path, "question")
  assert "rows.jsonl, row 1" in str(err.value) and "\n" not in str(err.value)


def test_a_macro_defined_in_a_file_and_read_in_the_file_it_includes_is_kept(tmp_path):
  (tmp_path / "inner.gin").write_text("PipelineConfig.steps = %STEPS\n")
  outer = tmp_path / "outer.gin"
  outer.write_text("STEPS = 5\ninclude 'inner.gin'\n")
  gin_config.parse([outer])
  assert gin_config.build_run()[0].steps == 5
  gin_config.parse()


def test_an_arm_file_is_found_by_the_short_name_its_hint_gives(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  arm = sorted((ROOT / "configs" / "arms").glob("*.gin"))[0]
  short = f"arms/{arm.stem}"
  with pytest.raises(gin_config.ConfigError, match=rf"--arms {short}x: no such file; did you mean {short} \("):
    gin_config.parse([], [], late_files=[gin_config._found(f"{short}x")])
  gin_config.parse(gin_config.run_files([]))
  config, job = gin_config.build_run()
  with_arm = gin_config.with_arms(config, job, [short], gin_config.run_files([]), [])
  assert [a.name for a in with_arm.arms.followers] == [arm.stem]
  gin_config.parse()
