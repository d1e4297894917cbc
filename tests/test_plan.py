"""`streamrl plan`: topologies by name, collectives read off HLO, the roofline's counts by hand, a model's shapes
without weights (shipped ones when the Hub is out of reach), the advice of a plan that does not fit, and whole plans
compiled for a TPU v5e slice by TPU's own compiler (libtpu, no TPU here) and for this CPU's devices, held to a run."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from streamrl_jax.models import ModelConfig
from streamrl_jax.planning.chips import TPUS, parse_topology
from streamrl_jax.planning.compiled import ProgramCost, collective_bytes
from streamrl_jax.planning.model_shapes import config_file, model_shapes, shipped
from streamrl_jax.planning.roofline import Work, decode_step, kv_bytes_per_token, optimizer_step
from streamrl_jax.planning.sides import SidePlan

ROOT = Path(__file__).resolve().parent.parent
TINY = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 128,
        "rope_theta": 1000000, "tie_word_embeddings": True}
TINY_RUN = ("PipelineConfig.prompts_per_step=2", "PipelineConfig.group_size=4", "PipelineConfig.max_new_tokens=192",
            "EngineConfig.max_prompt_length=64", "EngineConfig.num_slots=8", "EngineConfig.kv_layout='paged'",
            "EngineConfig.page_size=16", "TrainerConfig.remat='layer'")


def test_topologies_by_name():
  v5p = parse_topology("v5p:4x4x2")
  assert (v5p.devices, v5p.chip) == (32, TPUS["v5p"])
  assert parse_topology("v6e:16x16").devices == 256 and parse_topology("v5e:4x4").chip.hbm_bytes == 15.75 * 2**30
  assert parse_topology("v4:2x2x2").devices == 16  # libtpu describes v4 by its TensorCores: two a chip
  for bad in ("v5p", "v7x:2x2", "v5p:4x", "tpu:8"):
    with pytest.raises(ValueError, match="--topology"):
      parse_topology(bad)
  assert len(parse_topology("v5e:2x2").device_list()) == 4  # libtpu's description: no TPU needed


def test_each_side_of_a_split_compiles_on_its_devices():
  """A sampler on a slice's first chips and a trainer on the rest each compile a collective: TPU's compiler refuses
  one whose devices include device 0 and an id past their count (libtpu's order on v6e:4x4 starts 0, 1, 4, 5)."""
  import jax
  import numpy as np
  from jax.sharding import Mesh, NamedSharding, PartitionSpec

  devices = parse_topology("v6e:4x4").device_list()
  for side in (devices[:4], devices[4:8], devices[8:]):
    mesh = Mesh(np.array(side), ("x",))
    total = jax.jit(lambda a: a.sum(0), in_shardings=NamedSharding(mesh, PartitionSpec("x")),
                    out_shardings=NamedSharding(mesh, PartitionSpec()))
    total.trace(jax.ShapeDtypeStruct((len(side) * 8, 128), np.float32)).lower().compile()


def test_collectives_are_read_off_the_hlo():
  hlo = "\n".join([
      "%ag = (bf16[4,8]{1,0}, bf16[16,8]{1,0}) all-gather-start(%x), dimensions={0}",
      "%agd = bf16[16,8]{1,0} all-gather-done(%ag)",
      "%ar = f32[128]{0} all-reduce(%y), to_apply=%add",
      "%rs = (f32[2,64]{1,0}, f32[4]{0}) reduce-scatter(%a, %b), dimensions={0}",
      "%fusion = f32[128]{0} fusion(%ar), kind=kLoop, calls=%fused_all-reduce_like",
      "%cp = s32[3]{0} collective-permute-start(%z), source_target_pairs={{0,1}}"])
  assert collective_bytes(hlo) == {"all-gather": 16 * 8 * 2, "all-reduce": 512, "reduce-scatter": 2 * 64 * 4 + 16,
                                   "collective-permute": 12}


def test_the_roofline_counts_by_hand():
  config = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, layer_types=("sliding", "full"), sliding_window=8)
  # a token's keys and values: 2 layers x (k + v) x 2 heads x 16 dims x 2 bytes, the sliding layer over 8 at most
  assert kv_bytes_per_token(config, 20, 2) == 2 * 2 * 16 * 2 * (8 + 20)
  step = decode_step(config, rows=4, context=20, devices=2, weight_bytes=2, cache_bytes=2)
  assert step.flops == 4 * config.flops_per_token(20) / 2
  assert step.hbm_bytes == (config.param_count() * 2 + 4 * kv_bytes_per_token(config, 20, 2)) / 2
  assert step.ici_bytes == 2 * 2 * 2 * 4 * 64 * 2 * (1 / 2)  # two all-reduces a layer of the rows' hidden states
  assert optimizer_step(config, 4).hbm_bytes == 28 * config.param_count() / 4
  chip = TPUS["v5e"]
  work = Work(flops=197e12, hbm_bytes=819e9 * 2, ici_bytes=0.0)  # 1 s of compute, 2 of memory
  assert work.seconds(chip) == pytest.approx(2.0) and work.bound(chip) == "memory"


def test_a_models_shapes_without_weights(tmp_path, monkeypatch):
  monkeypatch.setenv("HF_HUB_OFFLINE", "1")
  monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
  (tmp_path / "config.json").write_text(json.dumps(TINY))
  assert config_file(str(tmp_path / "config.json"))[1] == "file" and config_file(str(tmp_path))[1] == "directory"
  config, source = model_shapes("Qwen/Qwen3-8B", "bfloat16")  # not cached, offline: the shipped shapes
  assert source == "shipped" and config.num_layers == 36 and config.dtype == "bfloat16"
  assert round(config.param_count() / 1e9, 2) == 8.19
  assert {"Qwen/Qwen3-8B", "Qwen/Qwen3-30B-A3B", "meta-llama/Llama-3.1-8B"} <= set(shipped())
  with pytest.raises(OSError, match="shapes shipped for"):
    model_shapes("someone/unknown-model", "bfloat16")


def _side(role, peak, held, notes, mesh):
  program = ProgramCost(f"{role}.x", peak, 0, 0, 0, 0, 0.0, 0.0, {}, 0.0)
  return SidePlan(role, mesh, (program,), held, {"x": peak}, Work(1.0, 1.0), notes)


def test_a_plan_that_does_not_fit_names_what_would():
  from streamrl_jax.planning.plan import Plan, PlanRequest, advice
  gb = 1e9
  topology = parse_topology("v5e:4x4")
  trainer = _side("trainer", 30 * gb, {"weights": 6 * gb, "optimizer": 12 * gb, "gradient": 6 * gb, "frozen": 0,
                                       "published": 0}, {"remat": "none", "lora": False, "call_rows": 16,
                                                         "call_length": 4096}, {"data": 1, "fsdp": 8, "tensor": 1})
  sampler = _side("sampler", 20 * gb, {"weights": 16 * gb, "decode_state": 4 * gb}, {"slots": 64},
                  {"data": 1, "fsdp": 1, "tensor": 1})
  plan = Plan(PlanRequest("m", "v5e:4x4"), topology, ModelConfig(64, 64, 64, 1, 1, 1), "file",
              dict(sampler=8, trainer=8, instances=8, chosen_by="asked"), trainer, sampler, {}, 1.0, {}, 1.0)
  assert not plan.fits and plan.trainer_hbm_frac == pytest.approx(30e9 / (15.75 * 2**30))
  said = advice(plan)
  assert said.startswith(f"does not fit: the trainer needs {30e9 / 2**30:.1f} GiB a chip of 15.75: ")
  for option in ("TrainerConfig.remat='layer'", "LoRA (LoraConfig.rank=16)", "TrainerConfig.chunk_tokens=32768",
                 "MeshConfig.sampler_tensor_parallel=2", "EngineConfig.num_slots=32"):
    assert option in said, option
  # 24 GB of state over 8 chips leaves 6 GB of the rest: (0.9 x 15.75 GiB - 6 GB) a chip holds 24 x 8 / 9.2 -> 21,
  # and the first count from there whose FSDP axis divides the hidden size (64) is 32
  assert "32 or more trainer chips: a larger topology" in said


def test_a_chosen_split_whose_trainer_compiles_too_large_moves_to_the_next_best_with_more_trainer_chips(
    tmp_path, monkeypatch):
  """The simulator's split is chosen on estimates; when the trainer then compiles over the chip there, the plan
  compiles it at the next best split with more trainer chips (the trainer's peak here: 64 GB over its chips)."""
  from streamrl_jax.commands.plan_inputs import planned_run
  from streamrl_jax.planning import plan as planning

  (tmp_path / "config.json").write_text(json.dumps(TINY))
  setup, model, source, spec = planned_run([], list(TINY_RUN), str(tmp_path / "config.json"), "tpu")
  compiled = []

  def trainer(setup, model, devices, chip, new_tokens):
    compiled.append(len(devices))
    return _side("trainer", 64e9 / len(devices), {"weights": 1e9}, {}, {"fsdp": len(devices)})

  monkeypatch.setattr(planning, "choose_split", lambda *a: (12, 9.0, {12: 9.0, 8: 8.0, 4: 7.0, 14: 1.0}))
  monkeypatch.setattr(planning, "plan_trainer", trainer)
  monkeypatch.setattr(planning, "plan_sampler", lambda *a: _side("sampler", 1e9, {"weights": 1e9}, {}, {}))
  monkeypatch.setattr(planning, "attention_temporaries", lambda *a: {})
  monkeypatch.setattr(planning, "samples_per_s", lambda *a: 8.0)
  plan = planning.make_plan(planning.PlanRequest(spec, "v5e:4x4"), setup, model, source)
  # 64 GB over 4 chips is 16 GB (over 0.9 of 15.75 GiB: 15.2 GB), over 8 chips 8 GB: 4 sampler chips never tried
  assert compiled == [4, 8] and plan.fits
  assert plan.split == dict(sampler=8, trainer=8, instances=8, chosen_by="the simulator's best whose trainer compiled "
                                                                                   "to fit")


def _plan_cli(tmp_path, topology, *extra):
  (tmp_path / "config.json").write_text(json.dumps(TINY))
  sets = [arg for s in TINY_RUN for arg in ("--set", s)]
  return subprocess.run([sys.executable, "-m", "streamrl_jax.cli", "plan", "--model", str(tmp_path / "config.json"),
                         "--topology", topology, "--json", *sets, *extra], capture_output=True, text=True, timeout=900,
                        cwd=ROOT)


@pytest.mark.slow
def test_a_plan_compiled_for_a_tpu_slice_with_its_kernels(tmp_path):
  """The tiny Qwen3 planned for v5e:2x2: TPU's compiler builds the trainer's call (splash attention), its optimizer
  step, and the engine's prefill and decode (paged attention); the JSON's keys; the trainer's attention temporaries
  with the kernel against XLA's."""
  done = _plan_cli(tmp_path, "v5e:2x2")
  assert done.returncode == 0, done.stderr[-3000:]
  plan = json.loads(done.stdout.strip().splitlines()[-1])
  assert plan["fits"] is True and plan["chip"]["name"] == "TPU v5 lite"
  assert plan["split"]["sampler"] + plan["split"]["trainer"] == 4 and plan["split"]["chosen_by"].startswith("the sim")
  # the split's samples/s as the simulator scored it when choosing (both with the TPU's cache and compute dtypes)
  assert plan["samples_per_s"] == pytest.approx(plan["split_scores"][str(plan["split"]["sampler"])], abs=1e-3)
  for key in ("trainer_hbm_frac", "sampler_hbm_frac", "trainer_step_s", "decode_step_s", "samples_per_s"):
    assert isinstance(plan[key], float) and plan[key] > 0, key
  programs = {p["name"]: p for side in ("trainer", "sampler") for p in plan[side]["programs"]}
  assert set(programs) == {"trainer.accumulate", "trainer.apply", "sampler.prefill", "sampler.decode"}
  assert programs["trainer.accumulate"]["kernels"] > 0 and programs["sampler.decode"]["kernels"] > 0
  assert programs["trainer.apply"]["kernels"] == 0
  trainer = plan["trainer"]
  assert trainer["peak_bytes"] >= sum(trainer["held"].values())  # the state is there while the call runs
  assert trainer["peak_bytes"] / plan["chip"]["hbm_bytes"] == pytest.approx(plan["trainer_hbm_frac"], abs=1e-4)
  assert plan["chip"]["hbm_bytes"] == 15.75 * 2**30  # what TPU's compiler lets a v5e program hold
  assert trainer["notes"]["calls_per_step"] == math.ceil(trainer["notes"]["rows_per_step"] / trainer["notes"]
                                                         ["call_rows"])
  attention = plan["attention"]  # at these tiny rows XLA fuses its scores away; docs/plans.md has a 5,120-token row's
  assert attention["length"] == trainer["notes"]["call_length"] and attention["kernel"] > 0 <= attention["xla"]
  assert plan["split_scores"][str(plan["split"]["sampler"])] == max(plan["split_scores"].values())
  assert "fits" in done.stdout.splitlines()[-2]


def test_every_shipped_plan_config_builds_a_run():
  from streamrl_jax import gin_config
  from streamrl_jax.pipeline.parts import plan_setup
  files = sorted((ROOT / "launchers" / "plans").glob("*.gin"))
  assert files
  for path in files:
    gin_config.parse(gin_config.run_files([str(path)]), [])
    config, job = gin_config.build_run()
    assert job.model in shipped(), f"{path.name}: {job.model} has no shipped shapes"
    setup = plan_setup(config.resolved("bfloat16"))
    assert setup.engine.kv_layout == "paged" and setup.precision.precision == "bfloat16"
    assert "streamrl plan --config launchers/plans/" + path.name in path.read_text()


def test_the_plan_request_is_checked(capsys):
  from streamrl_jax.cli import main
  from streamrl_jax.planning.plan import PlanRequest
  assert main(["plan", "--model", "m", "--topology", "v5e:2x2", "--check"]) == 2
  assert "plan --check: it runs each side on this machine: only with --topology cpu:N" in capsys.readouterr().err
  with pytest.raises(ValueError, match="--efficiency"):
    PlanRequest("m", "v5e:2x2", efficiency=0)
  assert dataclasses.replace(PlanRequest("m", "v5e:2x2"), sampler_chips=2).sampler_chips == 2


def test_the_same_plan_for_this_cpus_devices(tmp_path):
  """`--topology cpu:8`: the run's programs compiled by XLA:CPU for 8 host devices the command forces, the chip this
  machine's CPU measured, XLA's attention (no kernel off a TPU by default); `--check` then runs each side as planned
here and holds the plan to it."""
  done = _plan_cli(tmp_path, "cpu:8", "--split", "4", "--check")
  assert done.returncode == 0, done.stderr[-3000:]
  plan = json.loads(done.stdout.strip().splitlines()[-1])
  check = plan["check"]  # each side then run as planned in a process of its own
  for side, step in (("trainer", "trainer_step"), ("sampler", "decode_step")):
    planned, measured = check[f"planned_{side}"], check[f"measured_{side}"]
    assert planned["peak_bytes"] == plan[side]["peak_bytes"] and measured["peak_bytes"] > 0 and measured["step_s"] > 0
    assert check[f"{step}_ratio"] == pytest.approx(planned["step_s"] / measured["step_s"], rel=1e-2)
    assert check[f"{side}_peak_error"] == pytest.approx(abs(check[f"{side}_peak_ratio"] - 1), abs=2e-3)
  assert check["measured_trainer"]["call_s"] > 0 and "check, trainer: peak" in done.stdout
  assert plan["chip"]["platform"] == "cpu" and plan["split"] == dict(sampler=4, trainer=4, instances=4,
                                                                      chosen_by="asked for (--split)")
  assert plan["trainer"]["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1} and plan["attention"] == {}
  assert all(p["kernels"] == 0 for side in ("trainer", "sampler") for p in plan[side]["programs"])
  assert plan["chip"]["peak_flops"] > 0 and plan["decode_step_s"] > 0 and plan["fits"]
