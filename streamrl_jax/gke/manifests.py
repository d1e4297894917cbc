"""The manifests of a GKE run: a ConfigMap with the run's gin config, and one JobSet per role.

One JobSet per role because a JobSet's failure policy restarts all of it: a sampler that fails must not
restart the trainer. The trainer JobSet is one Indexed Job whose pods are the hosts of one slice (or one
node group) and form one `jax.distributed` cluster: process 0 is pod 0, reached by its stable DNS name
NAME-trainer-trainer-0-0.NAME-trainer, which is also where samplers find the Flight server. Any trainer
pod failing fails its Job (`backoffLimit: 0`) and the JobSet restarts the whole trainer, which resumes from
its last checkpoint (`--auto-resume`); samplers reconnect on their own. The sampler JobSet has one Job per
replica (one host, one process); a failed sampler pod is retried by its Job.

`render` is pure: the same GKEConfig and config text give the same dicts.
"""

from __future__ import annotations

from streamrl_jax.gke.launch_config import GKEConfig
from streamrl_jax.gke.platforms import RoleShape

API_VERSION = "jobset.x-k8s.io/v1alpha2"
CONFIG_DIR = "/etc/streamrl/config"
TLS_DIR = "/etc/streamrl/tls"
RUN_GIN = "run.gin"
JOBSET_LABELS = {  # what JobSet and Kubernetes put on each pod, passed to the program by the downward API
    "JOBSET_NAME": "metadata.labels['jobset.sigs.k8s.io/jobset-name']",
    "REPLICATED_JOB_NAME": "metadata.labels['jobset.sigs.k8s.io/replicatedjob-name']",
    "JOB_INDEX": "metadata.labels['jobset.sigs.k8s.io/job-index']",
    "JOB_COMPLETION_INDEX": "metadata.annotations['batch.kubernetes.io/job-completion-index']",
}


def trainer_address(gke: GKEConfig) -> str:
  """HOST:PORT of the trainer's Flight server: pod 0 of the trainer JobSet, by its stable DNS name."""
  return f"{gke.name}-trainer-trainer-0-0.{gke.name}-trainer:{gke.ports.flight_port}"


def render(gke: GKEConfig, run_config: str) -> dict[str, dict]:
  """{file name: manifest} for the ConfigMap holding `run_config` (gin text) and the two JobSets."""
  config_map = {"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": _metadata(gke, f"{gke.name}-config", "config"), "data": {RUN_GIN: run_config}}
  return {"configmap.yaml": config_map, "trainer.yaml": _trainer(gke), "samplers.yaml": _samplers(gke)}


def _trainer(gke: GKEConfig) -> dict:
  shape = gke.trainer_shape
  args = ["trainer", "--config", f"{CONFIG_DIR}/{RUN_GIN}", "--workdir", gke.workdir,
          "--listen", f"0.0.0.0:{gke.ports.flight_port}", "--auto-resume", *_tls_args(gke), *_site_args(gke)]
  env = [_env("STREAMRL_NUM_PROCESSES", str(shape.hosts)),
         _env("STREAMRL_COORDINATOR_PORT", str(gke.ports.coordinator_port)),
         *(_field_env(name, path) for name, path in JOBSET_LABELS.items())]
  ports = [{"name": "flight", "containerPort": gke.ports.flight_port},
           {"name": "coordinator", "containerPort": gke.ports.coordinator_port}]
  pod = _pod(gke, "trainer", shape, args, env, ports)
  job = _job(shape.hosts, backoff_limit=0, pod=pod)
  spec = {"replicatedJobs": [{"name": "trainer", "replicas": 1, "template": job}],
          "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
          "successPolicy": {"operator": "All", "targetReplicatedJobs": ["trainer"]},
          "failurePolicy": {"maxRestarts": gke.trainer.max_restarts}}
  metadata = _metadata(gke, f"{gke.name}-trainer", "trainer")
  if gke.spec.kind == "tpu":  # the slice's hosts come from one node pool, used by this Job alone
    metadata["annotations"] = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
  return {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": metadata, "spec": spec}


def _samplers(gke: GKEConfig) -> dict:
  shape = gke.sampler_shape
  args = ["sampler", "--config", f"{CONFIG_DIR}/{RUN_GIN}", "--connect", trainer_address(gke), "--name", "$(POD_NAME)",
          *_tls_args(gke), *_site_args(gke)]
  env, ports = [_field_env("POD_NAME", "metadata.name")], []
  if gke.ports.relay_port:  # serves the versions it holds to the samplers below it, dialled at the pod's IP
    args += ["--relay-listen", f"0.0.0.0:{gke.ports.relay_port}", "--relay-host", "$(POD_IP)"]
    if gke.tls_secret_name:  # every pod has the secret's one certificate, which names the trainer's host
      args += ["--relay-tls-name", trainer_address(gke).rpartition(":")[0]]
    env.append(_field_env("POD_IP", "status.podIP"))
    ports.append({"name": "relay", "containerPort": gke.ports.relay_port})
  pod = _pod(gke, "sampler", shape, args, env, ports, read_only=True)
  job = _job(1, backoff_limit=gke.samplers.pod_retries, pod=pod)
  spec = {"replicatedJobs": [{"name": "sampler", "replicas": gke.samplers.replicas, "template": job}],
          "successPolicy": {"operator": "All", "targetReplicatedJobs": ["sampler"]},
          "failurePolicy": {"maxRestarts": gke.samplers.max_restarts}}
  return {"apiVersion": API_VERSION, "kind": "JobSet", "metadata": _metadata(gke, f"{gke.name}-samplers", "sampler"),
          "spec": spec}


def _job(hosts: int, *, backoff_limit: int, pod: dict) -> dict:
  """An Indexed Job of `hosts` pods started together (the completion index is the process id)."""
  return {"spec": {"parallelism": hosts, "completions": hosts, "completionMode": "Indexed",
                   "backoffLimit": backoff_limit, "template": pod}}


def _pod(gke: GKEConfig, role: str, shape: RoleShape, args: list[str], env: list[dict], ports: list[dict],
         read_only: bool = False) -> dict:
  """A pod template: the bucket (Cloud Storage FUSE; the trainer writes its workdir there, samplers read
  model files), the run's config, the TLS secret, the accelerators of one host."""
  platform = gke.spec
  count = str(shape.per_host)
  bucket = {"name": "bucket", "mountPath": gke.mount_path}
  mounts = [{**bucket, "readOnly": True} if read_only else bucket,
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True}]
  fuse = {"bucketName": gke.bucket_name, "mountOptions": "implicit-dirs"}
  volumes = [{"name": "bucket", "csi": {"driver": "gcsfuse.csi.storage.gke.io", "readOnly": read_only,
                                        "volumeAttributes": fuse}},
             {"name": "config", "configMap": {"name": f"{gke.name}-config"}}]
  if gke.tls_secret_name:
    mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
    volumes.append({"name": "tls", "secret": {"secretName": gke.tls_secret_name, "defaultMode": 0o400}})
  if platform.kind == "gpu":  # NCCL and the host-side queues want a large /dev/shm
    mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
  container = {"name": role, "image": gke.image, "command": ["streamrl"], "args": args,
               "env": [*env, *(_env(k, v) for k, v in platform.env), _env("PYTHONUNBUFFERED", "1")],
               "resources": {"requests": {platform.resource: count}, "limits": {platform.resource: count}},
               "volumeMounts": mounts}
  if ports:
    container["ports"] = ports
  spec = {"restartPolicy": "Never", "serviceAccountName": gke.service_account,
          "terminationGracePeriodSeconds": 60,  # SIGTERM: the trainer stops after its step, samplers hand leases back
          "nodeSelector": platform.selector(shape.topology),
          "tolerations": [{"key": platform.resource, "operator": "Exists", "effect": "NoSchedule"}],
          "containers": [container], "volumes": volumes}
  metadata = {"labels": _labels(gke, role), "annotations": {"gke-gcsfuse/volumes": "true"}}  # the FUSE sidecar
  return {"metadata": metadata, "spec": spec}


def _tls_args(gke: GKEConfig) -> list[str]:
  if not gke.tls_secret_name:
    return []
  return ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key", "--tls-ca", f"{TLS_DIR}/ca.crt"]


def _site_args(gke: GKEConfig) -> list[str]:
  return ["--site", gke.site] if gke.site else []


def _labels(gke: GKEConfig, component: str) -> dict[str, str]:
  labels = {"app.kubernetes.io/name": "streamrl", "app.kubernetes.io/instance": gke.name,
            "app.kubernetes.io/component": component}
  return {**labels, "streamrl/site": gke.site} if gke.site else labels


def _metadata(gke: GKEConfig, name: str, component: str) -> dict:
  return {"name": name, "namespace": gke.namespace, "labels": _labels(gke, component)}


def _env(name: str, value: str) -> dict:
  return {"name": name, "value": value}


def _field_env(name: str, path: str) -> dict:
  return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
