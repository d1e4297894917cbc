"""`streamrl launch gke`: the JobSets of every platform checked field by field against the JobSet and
Kubernetes APIs, mistakes in the launch config named, `--apply` with and without kubectl, and the rendered
containers' commands run here as local processes with the environment JobSet and GKE give them."""

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import gin
import numpy as np
import pytest
import yaml

from streamrl_jax import cli, distributed, gin_config
from streamrl_jax.settings import flat_settings
from streamrl_jax.gke import GKEConfig, GKEPortsConfig, GKESamplersConfig, GKETrainerConfig, render, trainer_address
from streamrl_jax.commands.launch_local import free_port
from tests import jobset_api
from tests.processes import TINY, alive, final_weights
from tests.tls_certs import write_test_certificates
from tests.xla_flags import xla_flags

BASE = dict(image="us-docker.pkg.dev/proj/repo/streamrl:1", bucket="gs://my-bucket/runs")
PLATFORM_CASES = {  # platform: (launch settings, trainer hosts, per host, sampler accelerators)
    "tpu-v5e": (dict(trainer=dict(topology="2x4", hosts=2), samplers=dict(topology="2x2", replicas=2)), 2, 4, 4),
    "tpu-v5p": (dict(trainer=dict(topology="2x2x2"), samplers=dict(topology="2x2x1", replicas=3)), 2, 4, 4),
    "tpu-v6e": (dict(trainer=dict(topology="4x4"), samplers=dict(topology="2x4", replicas=1)), 4, 4, 8),
    "gpu-a3": (dict(trainer=dict(hosts=2), samplers=dict(replicas=1)), 2, 8, 8),
}
RUN_GIN = "PipelineConfig.mode = 'stream'\nPipelineConfig.steps = 3\n"
PARTS = {"trainer": GKETrainerConfig, "samplers": GKESamplersConfig, "ports": GKEPortsConfig}


def gke_config(**settings) -> GKEConfig:
  """A GKEConfig of `settings`, each of its parts (trainer, samplers, ports) given as a dict of that part's fields."""
  return GKEConfig(**{k: PARTS[k](**v) if k in PARTS else v for k, v in settings.items()})


def pod_spec(jobset: dict) -> dict:
  return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


@pytest.mark.parametrize("platform", sorted(PLATFORM_CASES))
def test_every_platform_renders_valid_jobsets(platform):
  settings, hosts, per_host, sampler_each = PLATFORM_CASES[platform]
  gke = gke_config(name="rl", platform=platform, **BASE, **settings)
  manifests = render(gke, RUN_GIN)
  assert sorted(manifests) == ["configmap.yaml", "samplers.yaml", "trainer.yaml"]
  for name, manifest in manifests.items():
    jobset_api.validate(yaml.safe_load(yaml.safe_dump(manifest)))  # as kubectl would read the file
  trainer, samplers = manifests["trainer.yaml"], manifests["samplers.yaml"]
  job = trainer["spec"]["replicatedJobs"][0]["template"]["spec"]
  assert job["parallelism"] == job["completions"] == hosts and job["completionMode"] == "Indexed"
  assert job["backoffLimit"] == 0  # one lost host fails the Job; the JobSet restarts the whole trainer
  assert trainer["spec"]["network"]["enableDNSHostnames"] and trainer["spec"]["failurePolicy"]["maxRestarts"] == 3
  resource = "nvidia.com/gpu" if platform == "gpu-a3" else "google.com/tpu"
  for jobset, each in ((trainer, per_host), (samplers, sampler_each)):
    pod = pod_spec(jobset)
    (container,) = pod["containers"]
    assert container["resources"]["limits"] == container["resources"]["requests"] == {resource: str(each)}
    selector = pod["nodeSelector"]
    if platform == "gpu-a3":
      assert selector == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    else:
      assert selector["cloud.google.com/gke-tpu-accelerator"] == gke.spec.accelerator
      assert selector["cloud.google.com/gke-tpu-topology"] in (gke.trainer.topology, gke.samplers.topology)
  assert samplers["spec"]["replicatedJobs"][0]["replicas"] == gke.samplers.replicas
  assert samplers["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] == 1

  # The sampler connects where process 0 of the trainer serves, and the trainer's processes find their
  # coordinator there too: what `distributed.detect` makes of the environment pod 0 gets.
  env = PodEnv(trainer, job_index=0, pod_index=0).env()
  cluster = distributed.detect(env=env)
  assert cluster.num_processes == hosts and cluster.process_id == 0
  host = trainer_address(gke).rpartition(":")[0]
  assert cluster.coordinator == f"{host}:{gke.ports.coordinator_port}"
  sampler_args = pod_spec(samplers)["containers"][0]["args"]
  assert sampler_args[sampler_args.index("--connect") + 1] == f"{host}:{gke.ports.flight_port}"
  assert host == f"{trainer['metadata']['name']}-trainer-0-0.{trainer['metadata']['name']}"
  assert distributed.detect(env=PodEnv(samplers, 0, 0).env()) is None  # a sampler is one process


def test_a_misspelled_or_misplaced_field_fails_validation():
  trainer = render(GKEConfig(name="rl", **BASE), RUN_GIN)["trainer.yaml"]
  jobset_api.validate(trainer)

  def broken(change):
    manifest = copy.deepcopy(trainer)
    change(manifest)
    return manifest
  pod = lambda m: pod_spec(m)  # noqa: E731
  job = lambda m: m["spec"]["replicatedJobs"][0]["template"]["spec"]  # noqa: E731
  mistakes = {
      "misspelled pod field": lambda m: pod(m).update(nodeSelecter=pod(m).pop("nodeSelector")),
      "Job field in the pod": lambda m: pod(m).update(backoffLimit=job(m).pop("backoffLimit")),
      "snake_case": lambda m: job(m).update(completion_mode=job(m).pop("completionMode")),
      "JobSet casing": lambda m: m["spec"]["network"].update(enableDnsHostnames=True),
      "unknown JobSet field": lambda m: m["spec"].update(restartPolicy="Never"),
      "bad enum": lambda m: m["spec"]["successPolicy"].update(operator="Every"),
      "number as string": lambda m: m["spec"]["failurePolicy"].update(maxRestarts="3"),
      "container field in the pod": lambda m: pod(m).update(image="x"),
      "bad quantity": lambda m: pod(m)["containers"][0]["resources"]["limits"].update({"google.com/tpu": "four"}),
      "mount without volume": lambda m: pod(m)["containers"][0]["volumeMounts"].append({"name": "x", "mountPath": "/x"}),
      "wrong apiVersion": lambda m: m.update(apiVersion="jobset.x-k8s.io/v1"),
      "bad field path": lambda m: pod(m)["containers"][0]["env"][2]["valueFrom"]["fieldRef"].update(fieldPath="x"),
  }
  for what, change in mistakes.items():
    with pytest.raises(Exception) as caught:
      jobset_api.validate(broken(change))
    assert caught.type is not TypeError, f"{what}: {caught.value}"  # a real finding, not a bug in the check


def test_samplers_of_a_site_relay_weights_at_their_pod_ip():
  gke = gke_config(name="rl", **BASE, site="dc2", ports=dict(relay_port=8480))
  manifests = render(gke, RUN_GIN)
  for manifest in manifests.values():
    jobset_api.validate(yaml.safe_load(yaml.safe_dump(manifest)))
  trainer, samplers = manifests["trainer.yaml"], manifests["samplers.yaml"]
  (container,) = pod_spec(samplers)["containers"]
  args = container["args"]
  assert args[args.index("--site") + 1] == "dc2" and args[args.index("--relay-listen") + 1] == "0.0.0.0:8480"
  assert args[args.index("--relay-host") + 1] == "$(POD_IP)"
  assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in container["env"]
  assert {"name": "relay", "containerPort": 8480} in container["ports"]
  trainer_args = pod_spec(trainer)["containers"][0]["args"]
  assert trainer_args[trainer_args.index("--site") + 1] == "dc2"
  assert samplers["metadata"]["labels"]["streamrl/site"] == trainer["metadata"]["labels"]["streamrl/site"] == "dc2"
  plain = pod_spec(render(GKEConfig(name="rl", **BASE), RUN_GIN)["samplers.yaml"])["containers"][0]["args"]
  assert "--relay-listen" not in plain and "--site" not in plain


@pytest.mark.parametrize("settings, message", [
    (dict(image=""), "GKEConfig.image is required"),
    (dict(bucket="my-bucket"), "GKEConfig.bucket"),
    (dict(platform="tpu-v4"), "GKEConfig.platform"),
    (dict(name="RL_run"), "GKEConfig.name"),
    (dict(trainer=dict(topology="2x4x1")), "GKETrainerConfig.topology '2x4x1': tpu-v5e topologies have 2 dimensions"),
    (dict(trainer=dict(topology="3x3")), "power of two"),
    (dict(trainer=dict(topology="2x4", hosts=3)), "not 3"),
    (dict(samplers=dict(topology="4x4")), "GKESamplersConfig.topology '4x4' spans 4 hosts"),
    (dict(platform="gpu-a3", accelerators_per_host=3), "not 3"),
    (dict(ports=dict(flight_port=8476)), "must differ"),
    (dict(ports=dict(relay_port=70000)), "GKEPortsConfig.relay_port 70000 is not a port"),
    (dict(site="DC_1"), "GKEConfig.site 'DC_1'"),
])
def test_launch_config_mistakes_name_the_key(settings, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    gke_config(**{"name": "rl", **BASE, **settings})


def run_cli(args, capsys):
  code = cli.main(args)
  out = capsys.readouterr()
  return code, out.out + out.err


def test_render_and_apply_with_or_without_kubectl(tmp_path, capsys, monkeypatch):
  config = tmp_path / "run.gin"
  config.write_text(RUN_GIN)
  common = ["launch", "gke", "--config", str(config), "--set", f"GKEConfig.image='{BASE['image']}'",
            "--set", f"GKEConfig.bucket='{BASE['bucket']}'", "--set", "GKEConfig.name='rl'"]
  code, out = run_cli([*common, "--set", "GKEConfig.imgae='x'", "--render", str(tmp_path / "bad")], capsys)
  assert code == 2 and "GKEConfig has no field 'imgae'; did you mean GKEConfig.image?" in out and not (tmp_path / "bad").exists()
  code, out = run_cli([*common, "--set", "PipelineConfig.mode='sideways'", "--render", str(tmp_path / "bad")], capsys)
  assert code == 2 and "sideways" in out and not (tmp_path / "bad").exists()  # the run's config is checked first

  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  code, out = run_cli([*common, "--render", str(tmp_path / "out"), "--apply"], capsys)
  assert code == 2 and "kubectl is not on PATH, nothing was applied" in out
  assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["configmap.yaml", "launch.json", "samplers.yaml",
                                                                 "trainer.yaml"]
  gin_text = yaml.safe_load((tmp_path / "out" / "configmap.yaml").read_text())["data"]["run.gin"]
  gin_config.parse([], [gin_text])  # what the pods read builds the same run as here
  rendered = flat_settings(*gin_config.build_run())
  gin_config.parse([str(config)], [])
  assert rendered == flat_settings(*gin_config.build_run()) and rendered["PipelineConfig.mode"] == "'stream'"

  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "kubectl").write_text(f"#!/bin/sh\necho \"$@\" >> {tmp_path / 'kubectl.log'}\n")
  (bin_dir / "kubectl").chmod(0o755)
  monkeypatch.setenv("PATH", str(bin_dir))
  code, out = run_cli([*common, "--render", str(tmp_path / "out"), "--apply"], capsys)
  assert code == 0, out
  applied = [line.split()[-1] for line in (tmp_path / "kubectl.log").read_text().splitlines()]
  assert [Path(p).name for p in applied] == ["configmap.yaml", "trainer.yaml", "samplers.yaml"]
  gin.clear_config()


class PodEnv:
  """What JobSet, the Job controller and GKE give pod (`job_index`, `pod_index`) of a JobSet's first
  replicated job: labels and annotations read through the downward API, and GKE's TPU worker variables."""

  def __init__(self, jobset: dict, job_index: int, pod_index: int):
    self.jobset, self.job_index, self.pod_index = jobset, job_index, pod_index
    self.name = jobset["metadata"]["name"]
    self.rjob = jobset["spec"]["replicatedJobs"][0]
    self.hosts = self.rjob["template"]["spec"]["parallelism"]

  def hostname(self, pod_index: int | None = None) -> str:
    index = self.pod_index if pod_index is None else pod_index
    return f"{self.name}-{self.rjob['name']}-{self.job_index}-{index}.{self.name}"

  def env(self, extra: dict | None = None) -> dict:
    fields = {
        "metadata.name": f"{self.name}-{self.rjob['name']}-{self.job_index}-{self.pod_index}-x7k2p",
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']": self.name,
        "metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']": self.rjob["name"],
        "metadata.labels['jobset.sigs.k8s.io/job-index']": str(self.job_index),
        "metadata.labels['jobset.sigs.k8s.io/restart-attempt']": "0",
        "metadata.annotations['batch.kubernetes.io/job-completion-index']": str(self.pod_index),
    }
    env = {"TPU_WORKER_ID": str(self.pod_index),
           "TPU_WORKER_HOSTNAMES": ",".join(self.hostname(i) for i in range(self.hosts))}
    for var in pod_spec(self.jobset)["containers"][0]["env"]:
      env[var["name"]] = var["value"] if "value" in var else fields[var["valueFrom"]["fieldRef"]["fieldPath"]]
    return {**env, **(extra or {})}


def volume_dirs(jobset: dict, root: Path, secret_files: dict[str, Path]) -> dict[str, Path]:
  """A local directory for each volume mount of the pod, holding what the volume would."""
  pod = pod_spec(jobset)
  volumes = {v["name"]: v for v in pod["volumes"]}
  dirs = {}
  for mount in pod["containers"][0]["volumeMounts"]:
    volume = volumes[mount["name"]]
    local = root / jobset["metadata"]["name"] / mount["name"]
    local.mkdir(parents=True, exist_ok=True)
    if "secret" in volume:
      for name, source in secret_files.items():
        shutil.copy(source, local / name)
    elif "csi" in volume:
      local = root / "bucket"  # one bucket for every pod
      local.mkdir(exist_ok=True)
    dirs[mount["mountPath"]] = local
  return dirs


def container_argv(jobset: dict, env: dict, mounts: dict[str, Path], config_map: dict) -> list[str]:
  container = pod_spec(jobset)["containers"][0]
  for mount_path, local in mounts.items():
    if mount_path == "/etc/streamrl/config":
      for name, text in config_map["data"].items():
        (local / name).write_text(text)
  argv = []
  for word in container["command"] + container["args"]:
    word = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], word)  # Kubernetes expands $(VAR) in args
    for mount_path, local in mounts.items():
      if word == mount_path or word.startswith(mount_path + "/"):
        word = str(local) + word[len(mount_path):]
    argv.append(word)
  streamrl = Path(sys.executable).parent / "streamrl"
  return [str(streamrl) if argv[0] == "streamrl" and streamrl.exists() else argv[0], *argv[1:]]


def hosts_namespace() -> list[str] | None:
  """A command prefix that runs a program with its own /etc/hosts (a private mount namespace), or None."""
  probe = ["sh", "-c", 'mount --bind /etc/hosts /etc/hosts && exec "$@"', "probe", "true"]
  for prefix in (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"]):
    if shutil.which("unshare") and subprocess.run(prefix + probe, capture_output=True, timeout=30).returncode == 0:
      return prefix
  return None


@pytest.mark.slow
def test_the_rendered_containers_run_here(tmp_path, single_process_run):
  """The TPU v5e manifests of a run with a trainer of 2 hosts and 2 engine instances: each pod's command,
  with its environment and volumes, runs as a local process on the CPU (JAX_PLATFORMS is the one thing
  changed), host names resolve to 127.0.0.1 through a private /etc/hosts; the run completes as on the
  cluster. Its two trainer processes form one 2-device mesh, each taking its own groups' samples at its own
  door, and train what a single-process run trains (stream is on-policy and samples depend on (seed, group,
  index) only)."""
  prefix = hosts_namespace()
  if prefix is None:
    pytest.skip("no mount namespace here (unshare) to give the pods their host names")
  run_gin = TINY.format(steps=2, trainer_devices=2, mode="stream")
  gke = gke_config(name="rl", platform="tpu-v5e", trainer=dict(topology="2x4", hosts=2),
                   samplers=dict(topology="2x2", replicas=2),
                   ports=dict(flight_port=free_port(), coordinator_port=free_port()), **BASE)
  manifests = render(gke, run_gin)
  trainer, samplers = manifests["trainer.yaml"], manifests["samplers.yaml"]
  # The certificate names the trainer's host exactly: gRPC refuses a wildcard over a one-label domain.
  certs = write_test_certificates(tmp_path, dns_names=(trainer_address(gke).rpartition(":")[0],))
  secret = {"tls.crt": certs["server_cert"], "tls.key": certs["server_key"], "ca.crt": certs["ca"]}
  pods = [PodEnv(trainer, 0, i) for i in range(2)] + [PodEnv(samplers, j, 0) for j in range(2)]
  hosts = tmp_path / "hosts"
  hosts.write_text(Path("/etc/hosts").read_text() + "".join(f"127.0.0.1 {p.hostname()}\n" for p in pods))
  local = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags(), "PATH": os.environ["PATH"]}
  procs = []
  try:
    for pod in pods:
      env = pod.env(local)
      argv = container_argv(pod.jobset, env, volume_dirs(pod.jobset, tmp_path, secret), manifests["configmap.yaml"])
      bind = ["sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "pod"]
      log = (tmp_path / f"{pod.hostname()}.log").open("w")
      procs.append(subprocess.Popen(prefix + bind + argv, env=env, stdout=log, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
      if any(p.poll() for p in procs):  # one failed: the others would wait for it
        break
      time.sleep(0.5)
    logs = {p.hostname(): (tmp_path / f"{p.hostname()}.log").read_text() for p in pods}
    assert [proc.returncode for proc in procs] == [0, 0, 0, 0], json.dumps(logs, indent=1)[-6000:]
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
  workdir = tmp_path / "bucket" / "runs" / "rl"  # gs://my-bucket/runs/rl through the FUSE mount
  rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == [1, 2]
  counters = json.loads((workdir / "summary.json").read_text())["counters"]
  assert counters["samples_trained"] == counters["intake_samples"] == 16 and counters["registered"] == 2
  # each trainer process took its own groups' samples at its own door (half the groups each); process 0 the rows'
  # descriptions of the others, never their tokens
  assert counters["flight_accepted_samples"] == counters["intake_local_samples"] == 8
  assert counters["intake_door_kib/1"] > 0 and counters["refused_samples"] == 0
  assert counters["intake_weight_kib/1"] > 0 and counters["intake_weight_kib/0"] > 0  # each serves its own pieces
  assert counters["duplicate_samples"] == 0 and counters["prompts_submitted"] == 8
  leader = logs[pods[0].hostname()]
  assert "trainer mesh {'data': 1, 'fsdp': 2, 'tensor': 1} over 2 process(es)" in leader
  assert "no checkpoint yet, starting afresh" in leader
  assert all("the run is over" in logs[p.hostname()] for p in pods[2:])
  assert (workdir / "checkpoints").is_dir() and not any(alive(p.pid) for p in procs)
  ours, theirs = final_weights(workdir), final_weights(single_process_run[0])
  assert ours.keys() == theirs.keys()
  for name in ours:
    np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("launch", ["tpu_v5e_16.gin", "a3_2nodes.gin"])
def test_the_shipped_launch_configs_render_valid_jobsets(launch, tmp_path, capsys):
  folder = Path(__file__).resolve().parent.parent / "launchers" / "gke"
  code, out = run_cli(["launch", "gke", "--config", str(folder / "grpo_file.gin"), "--config", str(folder / launch),
                       "--set", f"GKEConfig.image='{BASE['image']}'", "--set", f"GKEConfig.bucket='{BASE['bucket']}'",
                       "--render", str(tmp_path)], capsys)
  assert code == 0, out
  for name in ("configmap.yaml", "trainer.yaml", "samplers.yaml"):
    jobset_api.validate(yaml.safe_load((tmp_path / name).read_text()))
  summary = json.loads((tmp_path / "launch.json").read_text())
  assert summary["trainer"]["accelerators"] == 8 and summary["samplers"]["accelerators_each"] * summary["samplers"][
      "replicas"] == 8
  gin.clear_config()


def test_the_run_mesh_must_fit_the_roles_accelerators():
  from streamrl_jax.meshes import MeshConfig
  gke = GKEConfig(name="rl", **BASE)  # trainer 2x4 (8 chips), samplers 2x2 (4 chips)
  gke.check_mesh(MeshConfig())
  gke.check_mesh(MeshConfig(sampler_devices=4, trainer_devices=8, trainer_tensor_parallel=4))
  with pytest.raises(ValueError, match="MeshConfig.sampler_devices=8, but a sampler on GKE gets 4 google.com/tpu"):
    gke.check_mesh(MeshConfig(sampler_devices=8))
  with pytest.raises(ValueError, match="MeshConfig.trainer_tensor_parallel=3 does not divide the trainer's 8"):
    gke.check_mesh(MeshConfig(trainer_tensor_parallel=3))


def test_the_dockerfile_copies_what_the_image_needs():
  root = Path(__file__).resolve().parent.parent
  text = (root / "launchers" / "gke" / "Dockerfile").read_text()
  copied = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
  for sources in copied:
    for source in sources:
      assert (root / source).exists(), f"the Dockerfile copies {source}, which is not in the repository"
  assert {"streamrl_jax", "pyproject.toml", "configs"} <= {s for sources in copied for s in sources}
  extras = re.search(r"tpu\|cuda\) pip install \"\.\[\$ACCELERATOR\]\"", text)
  assert extras, "the Dockerfile installs the tpu or cuda extra"
  import tomllib
  optional = tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"]
  assert {"tpu", "cuda"} <= set(optional)
