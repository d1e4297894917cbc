"""LoRA: adapters against Hugging Face peft (logits), against the dense merged model (values and gradients), the
PEFT files' refusals, the trainer's frozen base and the adapters-only weight sync of a pipeline run."""

import copy
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from streamrl_jax.config_types import ConfigError
from streamrl_jax.models import Transformer, load_hf, lora
from streamrl_jax.models.lora import LoraConfig
from streamrl_jax.models.merge import merge_adapter
from streamrl_jax.models.peft_io import CONFIG_FILE, WEIGHTS_FILE, load_adapter, save_adapter
from streamrl_jax.meshes import mesh_from_devices
from tests.pipeline_setup import BASE as PIPELINE
from tests.pipeline_setup import MODEL as PIPELINE_MODEL
from tests.pipeline_setup import run
from tests.trainer_setup import CONFIG, MESH_SHAPE, make_batch

TOKENS = np.array([[3, 14, 15, 42, 21, 35, 7, 19], [5, 9, 2, 6, 5, 3, 5, 8]], np.int32)
ALL = LoraConfig(rank=4, alpha=8.0)


def random_arrays(config: LoraConfig, model_config, seed: int = 0) -> dict:
  """Adapters with B non-zero too (fresh ones are the base exactly), large enough to move the logits."""
  rng = np.random.default_rng(seed)
  out = {}
  for key, (a, b) in lora.initial_arrays(config, model_config).items():
    out[key] = (a, rng.normal(0, 0.3, b.shape).astype(np.float32))
  return out


def adapted(model, config=ALL, seed=0):
  return lora.attach(model, config, random_arrays(config, model.config, seed))


@pytest.mark.parametrize("targets", [ALL.targets, ("q", "v")])
def test_peft_loads_our_adapter_with_equal_logits(hf_dirs, tmp_path, targets):
  import torch
  from peft import PeftModel

  directory, hf_model = hf_dirs["llama"]
  config = dataclasses.replace(ALL, targets=targets)
  ours = adapted(load_hf(directory), config)
  arrays = lora.adapter_arrays(lora.split(ours)[1])
  save_adapter(tmp_path / "adapter", arrays, config, str(directory))
  saved = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
  assert saved["r"] == 4 and saved["lora_alpha"] == 8.0 and len(saved["target_modules"]) == len(targets)
  with torch.no_grad():
    base_logits = hf_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
    theirs_model = PeftModel.from_pretrained(copy.deepcopy(hf_model), tmp_path / "adapter").eval()  # a shared fixture
    theirs = theirs_model(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  mine = np.asarray(ours(jnp.asarray(TOKENS)))
  assert np.abs(theirs - base_logits).max() > 1e-2  # the adapter does change the model
  np.testing.assert_allclose(mine, theirs, atol=1e-4, rtol=1e-4)


def test_merge_equals_adapted_model_and_round_trips(hf_dirs, tmp_path):
  import torch
  import transformers

  directory, _ = hf_dirs["llama"]
  ours = adapted(load_hf(directory))
  graphdef, adapters, base = lora.split(ours)
  plain_graphdef, _ = nnx.split(load_hf(directory))
  dense = nnx.merge(plain_graphdef, lora.merge(base, adapters, ALL.scale))
  np.testing.assert_allclose(np.asarray(dense(jnp.asarray(TOKENS))), np.asarray(ours(jnp.asarray(TOKENS))),
                             atol=1e-5, rtol=1e-5)
  save_adapter(tmp_path / "adapter", lora.adapter_arrays(adapters), ALL, "")
  config, arrays = load_adapter(tmp_path / "adapter", ours.config)
  assert (config.rank, config.alpha, config.targets) == (ALL.rank, ALL.alpha, ALL.targets)
  for key, (a, b) in lora.adapter_arrays(adapters).items():
    np.testing.assert_array_equal(arrays[key][0], np.asarray(a))
    np.testing.assert_array_equal(arrays[key][1], np.asarray(b))
  out = merge_adapter(str(directory), str(tmp_path / "adapter"), str(tmp_path / "merged"))
  reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  with torch.no_grad():
    theirs = reloaded(torch.tensor(TOKENS, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(np.asarray(ours(jnp.asarray(TOKENS))), theirs, atol=1e-4, rtol=1e-4)


def _write_adapter(tmp_path, model_config, **changes):
  save_adapter(tmp_path, random_arrays(ALL, model_config), ALL, "HuggingFaceTB/SmolLM2-135M-Instruct")
  meta = json.loads((tmp_path / CONFIG_FILE).read_text())
  meta.update(changes)
  (tmp_path / CONFIG_FILE).write_text(json.dumps(meta))
  return tmp_path


@pytest.mark.parametrize("change, words", [
    (dict(use_dora=True), "use_dora = True is not supported"),
    (dict(use_rslora=True), "use_rslora"),
    (dict(layers_to_transform=[0]), "layers_to_transform"),
    (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
    (dict(r=8), "has shape"),
])
def test_peft_options_we_cannot_honour_are_one_line_errors(tmp_path, change, words):
  with pytest.raises(ConfigError, match=words) as err:
    load_adapter(_write_adapter(tmp_path, CONFIG, **change), CONFIG)
  assert "\n" not in str(err.value) and CONFIG_FILE in str(err.value) or WEIGHTS_FILE in str(err.value)


def test_adapter_for_another_base_is_refused(tmp_path):
  directory = _write_adapter(tmp_path, CONFIG)
  load_adapter(directory, CONFIG, "/cache/SmolLM2-135M-Instruct")  # the same model by its last path part
  with pytest.raises(ConfigError, match="is for base 'HuggingFaceTB/SmolLM2-135M-Instruct'"):
    load_adapter(directory, CONFIG, "Qwen/Qwen2.5-0.5B")
  other = dataclasses.replace(CONFIG, hidden_size=16, num_heads=2, num_kv_heads=1)
  with pytest.raises(ConfigError, match="another base"):
    load_adapter(directory, other)
  load_adapter(directory, CONFIG, str(tmp_path))  # a local path's name says nothing: the shapes decide
  with pytest.raises(ConfigError, match="adapter_config.json is missing"):
    load_adapter(tmp_path / "nowhere", CONFIG)


def test_init_from_gives_its_rank_unless_one_is_set(tmp_path):
  from streamrl_jax.models.peft_io import resolve

  directory = _write_adapter(tmp_path, CONFIG)
  taken = resolve(LoraConfig(init_from=str(directory)), CONFIG)
  assert (taken.rank, taken.alpha, taken.targets, taken.init_from) == (ALL.rank, ALL.alpha, ALL.targets, str(directory))
  assert resolve(dataclasses.replace(ALL, init_from=str(directory)), CONFIG).rank == ALL.rank
  with pytest.raises(ConfigError, match="holds rank 4, alpha 8.0.*LoraConfig says rank 8"):
    resolve(LoraConfig(rank=8, alpha=8.0, init_from=str(directory)), CONFIG)
  remote = LoraConfig(rank=8, init_from=str(tmp_path / "elsewhere"))  # a sampler never reads it
  assert resolve(remote, CONFIG, read=False) == remote


def test_config_refusals_are_one_line():
  with pytest.raises(ConfigError, match="unknown 'qkv'; known: q, k, v, o, gate, up, down"):
    LoraConfig(rank=4, targets=("qkv",))
  with pytest.raises(ConfigError, match="only 0 is supported"):
    LoraConfig(rank=4, dropout=0.1)
  with pytest.raises(ConfigError, match="larger than projection 'k'"):  # k: 32 x 16 (2 kv heads of 8)
    lora.check(LoraConfig(rank=17), CONFIG)
  lora.check(LoraConfig(rank=16), CONFIG)


def lora_trainer(graphdef, base, objective, remat: str = "none"):
  from streamrl_jax.training import OptimizerConfig, Scoring, Trainer, TrainerConfig

  mesh = mesh_from_devices(jax.devices()[4:8], MESH_SHAPE)
  return Trainer(graphdef, OptimizerConfig(learning_rate=1e-2), objective, mesh, scoring=Scoring(base_params=base),
                 config=TrainerConfig(remat=remat))


def _dense_loss(plain_graphdef, base, adapters, batch):
  """The trainer's loss numerator on the dense merged model: an independent path to the adapters' gradient."""
  from streamrl_jax.training.logprobs import token_logprobs

  model = nnx.merge(plain_graphdef, lora.merge(base, adapters, ALL.scale))
  logp, _ = token_logprobs(model(batch["tokens"], batch["valid"]), batch["tokens"])
  return -jnp.sum(jnp.where(batch["loss_mask"], batch["advantages"][:, None] * logp, 0.0))  # reinforce


def test_trainer_gradient_is_the_dense_models_and_the_base_stays_frozen():
  from streamrl_jax.training import ObjectiveConfig

  model = Transformer(CONFIG, rngs=nnx.Rngs(0))
  plain_graphdef, plain = nnx.split(model)
  graphdef, adapters, base = lora.split(adapted(Transformer(CONFIG, rngs=nnx.Rngs(0))))
  trainer = lora_trainer(graphdef, base, ObjectiveConfig(objective="reinforce", correction="none"))
  state = trainer.init_state(adapters)
  batch = make_batch(8, seed=3)
  batch.pop("old_logprobs")
  state = trainer.accumulate(state, batch)
  got = jax.tree.map(np.asarray, state.grad_sum)
  want = jax.grad(_dense_loss, argnums=2)(plain_graphdef, plain, adapters, jax.tree.map(jnp.asarray, batch))
  for (path, g), (_, w) in zip(nnx.to_flat_state(got), nnx.to_flat_state(want)):
    np.testing.assert_allclose(g[...], w[...], atol=2e-4, rtol=2e-3, err_msg=str(path))
  before = jax.tree.map(np.asarray, trainer.base_params)
  state, metrics = trainer.apply(state)
  assert metrics["grad_norm"] > 0
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, trainer.base_params))
  changed = [not np.array_equal(np.asarray(a[...]), np.asarray(b[...]))
             for (_, a), (_, b) in zip(nnx.to_flat_state(state.params), nnx.to_flat_state(adapters))]
  assert all(changed)
  adapter_size = sum(x.size for x in jax.tree.leaves(adapters))
  assert sum(x.size for x in jax.tree.leaves(state.opt_state)) <= 2 * adapter_size + 8  # Adam's moments: adapters'
  assert sum(x.size for x in jax.tree.leaves(state.grad_sum)) == adapter_size


@pytest.mark.parametrize("remat", ["layer", "dots"])
def test_adapters_train_under_rematerialisation_with_the_same_gradient(remat):
  """LoRA with `TrainerConfig.remat` on: the layers rematerialized over the frozen base inside the trainer's jit (flax
  raised TraceContextError writing the layer's state back, found by `streamrl plan`), the gradient remat 'none''s."""
  from streamrl_jax.training import ObjectiveConfig

  graphdef, adapters, base = lora.split(adapted(Transformer(CONFIG, rngs=nnx.Rngs(0))))
  objective = ObjectiveConfig(objective="reinforce", correction="none")
  batch = make_batch(8, seed=4)
  grads = {}
  for policy in ("none", remat):
    trainer = lora_trainer(graphdef, base, objective, remat=policy)
    grads[policy] = jax.tree.map(np.asarray, trainer.accumulate(trainer.init_state(adapters), batch).grad_sum)
  for a, b in zip(jax.tree.leaves(grads["none"]), jax.tree.leaves(grads[remat])):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)
  assert any(np.abs(g).max() > 0 for g in jax.tree.leaves(grads[remat]))


def test_kl_reference_is_the_base():
  from streamrl_jax.training import ObjectiveConfig

  graphdef, adapters, base = lora.split(lora.attach(Transformer(CONFIG, rngs=nnx.Rngs(0)), ALL))  # B = 0
  objective = ObjectiveConfig(kl_coef=0.1)
  trainer = lora_trainer(graphdef, base, objective)
  state = trainer.init_state(adapters)
  state, first = trainer.apply(trainer.accumulate(state, make_batch(8, seed=1)))
  assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # fresh adapters: the policy is the base
  state, _ = trainer.apply(trainer.accumulate(state, make_batch(8, seed=2)))
  state, later = trainer.apply(trainer.accumulate(state, make_batch(8, seed=2)))
  assert later["kl"] > 1e-6


def test_pipeline_trains_adapters_and_syncs_them_alone():
  """An async run with LoRA, an int8 sampler (it quantizes the merged weights) and a KL penalty (the reference is
  the base): the adapters train, the versions are adapter-sized, the result is the base with them merged."""
  from streamrl_jax.training import ObjectiveConfig

  config = LoraConfig(rank=4, alpha=8.0, seed=1)
  int8 = dataclasses.replace(PIPELINE.sampler, precision="int8")
  full = run("async", steps=1, sampler=int8)
  trainer = dataclasses.replace(PIPELINE.trainer, lora=config, objective=ObjectiveConfig(kl_coef=0.05),
                                optimizer=dataclasses.replace(PIPELINE.trainer.optimizer, learning_rate=1e-2))
  result = run("async", steps=2, sampler=int8, trainer=trainer)
  initial = nnx.split(Transformer(PIPELINE_MODEL, rngs=nnx.Rngs(0)))[1]
  assert result.adapters is not None and len(result.metrics) == 2
  adapter_bytes = lora.adapter_bytes(result.adapters)
  assert result.counters["weight_version_bytes"] == adapter_bytes < full.counters["weight_version_bytes"]
  assert result.metrics[0]["kl"] == pytest.approx(0.0, abs=1e-6) and result.metrics[1]["kl"] > 0
  b_moved = [np.abs(np.asarray(b)).max() for _, b in lora.adapter_arrays(result.adapters).values()]
  assert min(b_moved) > 0  # every adapter trained (B starts at zero)
  merged = lora.merge(initial, result.adapters, config.scale)
  for (path, got), (_, want) in zip(nnx.to_flat_state(result.params), nnx.to_flat_state(merged)):
    np.testing.assert_allclose(np.asarray(got[...]), np.asarray(want[...]), atol=1e-6, err_msg=str(path))
  assert result.counters["unique_samples_trained"] == result.counters["samples_planned"]


@pytest.mark.slow
def test_separate_programs_sync_adapters_over_flight(tmp_path):
  """`streamrl launch local` with LoRA, started from a PEFT adapter (`LoraConfig.init_from`): the sampler program
  loads the base itself, every version over Flight is the adapters' bytes, and the run leaves a PEFT adapter (the
  initial one moved by at most Adam's steps) whose merge into the base is its final model."""
  from streamrl_jax.job.config import DemoModelConfig, JobConfig

  from tests.processes import finish, launch, write_config

  base_model = JobConfig(demo=DemoModelConfig(hidden_size=32), warmup_steps=0).load_model()[0]
  start = LoraConfig(rank=4)
  initial = random_arrays(start, base_model.config, seed=5)
  save_adapter(tmp_path / "initial", initial, start, "")
  workdir, lr = tmp_path / "run", 0.01
  code, out = finish(launch(workdir, "--config", write_config(tmp_path / "tiny.gin"), "--set", "LoraConfig.rank=4",
                            "--set", f"LoraConfig.init_from='{tmp_path / 'initial'}'",
                            "--set", f"OptimizerConfig.learning_rate={lr}"), workdir)
  assert code == 0, out
  counters = json.loads((workdir / "summary.json").read_text())["counters"]
  config, arrays = load_adapter(workdir / "final_adapter", base_model.config)
  assert (config.rank, config.alpha) == (4, start.alpha)
  adapter_bytes = sum(a.nbytes + b.nbytes for a, b in arrays.values())
  assert counters["weight_version_bytes"] == adapter_bytes
  # versions 0 and 1 went out, each at least once (the last step's weights go to no sampler)
  assert counters["flight_weight_bytes"] >= 2 * adapter_bytes and counters["flight_weight_bytes"] % adapter_bytes == 0
  for key, (a, b) in arrays.items():  # two Adam steps move a weight by at most about 2 x lr
    assert np.abs(a - initial[key][0]).max() <= 2.05 * lr and np.abs(b - initial[key][1]).max() <= 2.05 * lr
  assert max(np.abs(b).max() for _, b in arrays.values()) > 0.1  # the initial adapter's B, not a fresh zero
  graphdef, base = nnx.split(base_model)
  merged = nnx.merge(graphdef, lora.merge(base, arrays, config.scale))
  final = load_hf(workdir / "final_model")
  np.testing.assert_allclose(np.asarray(final(jnp.asarray(TOKENS))), np.asarray(merged(jnp.asarray(TOKENS))),
                             atol=1e-5)


def test_lora_across_processes_refuses_a_warmed_demo_base():
  from streamrl_jax.commands.roles import check_lora_base
  from streamrl_jax.job.config import JobConfig

  with pytest.raises(ConfigError, match="set JobConfig.warmup_steps = 0"):
    check_lora_base(dataclasses.replace(PIPELINE, trainer=dataclasses.replace(PIPELINE.trainer, lora=ALL)),
                    JobConfig(warmup_steps=10))
  check_lora_base(dataclasses.replace(PIPELINE, trainer=dataclasses.replace(PIPELINE.trainer, lora=ALL)),
                  JobConfig(warmup_steps=0))


def test_streamrl_merge_refuses_a_dora_adapter_in_one_line(hf_dirs, tmp_path, capsys):
  from streamrl_jax import cli

  directory, _ = hf_dirs["llama"]
  model = load_hf(directory)
  save_adapter(tmp_path / "adapter", random_arrays(ALL, model.config), ALL, "")
  meta = json.loads((tmp_path / "adapter" / CONFIG_FILE).read_text())
  (tmp_path / "adapter" / CONFIG_FILE).write_text(json.dumps(dict(meta, use_dora=True)))
  assert cli.main(["--host-devices", "0", "merge", str(directory), str(tmp_path / "adapter"), str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err.strip()
  assert "use_dora = True is not supported" in err and len(err.splitlines()) == 1
  assert not (tmp_path / "o").exists()


def test_the_shipped_lora_config_is_the_smollm2_run_with_adapters():
  from pathlib import Path

  from streamrl_jax import gin_config

  configs = Path(__file__).resolve().parent.parent / "configs"
  gin_config.parse([str(configs / "smollm2_lora_cpu.gin")])  # `include 'smollm2_cpu.gin'`, found beside it
  config, job = gin_config.build_run()
  gin_config.parse([str(configs / "smollm2_cpu.gin")])
  full, full_job = gin_config.build_run()
  assert (config.trainer.lora.rank, config.trainer.lora.targets) == (16, ALL.targets) and job == full_job
  assert config.trainer.optimizer.learning_rate == pytest.approx(full.trainer.optimizer.learning_rate * 100 / 3)
  assert dataclasses.replace(config, trainer=dataclasses.replace(config.trainer, lora=full.trainer.lora,
                                                                 optimizer=full.trainer.optimizer)) == full


def test_an_include_found_nowhere_is_one_line(tmp_path, caplog):
  from streamrl_jax import gin_config

  (tmp_path / "run.gin").write_text("include 'nowhere.gin'\nLoraConfig.rank = 4\n")
  with pytest.raises(ConfigError, match="nowhere.gin") as err:
    gin_config.parse([str(tmp_path / "run.gin")])
  assert "\n" not in str(err.value)
  (tmp_path / "base.gin").write_text("LoraConfig.alpha = 8.0\n")
  (tmp_path / "run.gin").write_text("include 'base.gin'\nLoraConfig.rank = 4\n")
  gin_config.parse([str(tmp_path / "run.gin")])  # found beside the including file, whatever the working directory
  assert (gin_config.build(LoraConfig).rank, gin_config.build(LoraConfig).alpha) == (4, 8.0)
  assert "Path not found" not in caplog.text


def test_several_updates_score_old_logprobs_under_the_adapters_a_step_started_with():
  """LoRA with 2 mini-batches a step: the second mini-batch's old log-probabilities are the dense merged model's at
  the step's starting adapters (the copy kept is the adapters', the base frozen), and both updates move the adapters."""
  from streamrl_jax.pipeline.trainer.updates import StepUpdates
  from streamrl_jax.training import MicroBatcher, ObjectiveConfig, TrainerConfig
  from streamrl_jax.training.logprobs import token_logprobs

  plain_graphdef, plain = nnx.split(Transformer(CONFIG, rngs=nnx.Rngs(0)))
  graphdef, adapters, base = lora.split(adapted(Transformer(CONFIG, rngs=nnx.Rngs(0)), seed=3))
  objective = ObjectiveConfig(correction="none")
  trainer = lora_trainer(graphdef, base, objective)
  batch = make_batch(8, seed=5)
  batch.pop("old_logprobs")
  updates = StepUpdates(trainer, MicroBatcher(trainer), TrainerConfig(mini_batches=2, objective=objective), 4)
  state = trainer.init_state(adapters)
  updates.begin(state, lambda: 0.0)
  state, record = updates.end(updates.add(state, batch, np.repeat(np.arange(4), 2)))
  dense = nnx.merge(plain_graphdef, lora.merge(plain, adapters, ALL.scale))
  want = np.asarray(token_logprobs(dense(batch["tokens"], batch["valid"]), batch["tokens"])[0])[4:]
  second = updates.kept[1][0]
  np.testing.assert_allclose(np.where(second["loss_mask"], second["old_logprobs"], 0),
                             np.where(second["loss_mask"], want, 0), atol=2e-5)
  assert "old_logprobs" not in updates.kept[0][0] and int(state.step) == 2 and record.row()["optimizer_updates"] == 2
  assert not np.array_equal(np.asarray(jax.tree.leaves(state.params)[0]), np.asarray(jax.tree.leaves(adapters)[0]))
