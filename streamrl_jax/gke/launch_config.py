"""`GKEConfig`: where and how a run goes on GKE (gin-bindable, like the run's own configs), with its trainer's
(`GKETrainerConfig`), its samplers' (`GKESamplersConfig`) and its ports (`GKEPortsConfig`)."""

from __future__ import annotations

import dataclasses
import re

from streamrl_jax.gke.platforms import PLATFORMS, Platform, RoleShape, role_shape

NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 24  # pod host names are NAME-trainer-trainer-J-P and must stay within a 63-character DNS label


def _at_least(config: GKETrainerConfig | GKESamplersConfig | GKEConfig, minimum: int, *keys: str) -> None:
  for key in keys:
    if getattr(config, key) < minimum:
      raise ValueError(f"{type(config).__name__}.{key} must be >= {minimum}")


@dataclasses.dataclass(frozen=True)
class GKETrainerConfig:
  """The trainer JobSet: its slice (or node group) and how often it restarts."""

  topology: str = "2x4"  # the trainer's TPU slice (ignored on GPU)
  hosts: int = 0  # 0: from the topology (TPU) or 1 (GPU)
  max_restarts: int = 3  # whole-trainer restarts (it resumes from its last checkpoint)

  def __post_init__(self):
    _at_least(self, 0, "hosts", "max_restarts")


@dataclasses.dataclass(frozen=True)
class GKESamplersConfig:
  """The sampler JobSet: its pool of single-host replicas and their retries."""

  topology: str = "2x2"  # each engine instance's TPU slice: single-host (ignored on GPU)
  replicas: int = 2  # replicas of the sampler JobSet, each one single-host `streamrl sampler`
  max_restarts: int = 10  # whole-sampler-JobSet restarts, after a replica used up its pod retries
  pod_retries: int = 3  # a failed sampler pod is started again this often before its Job fails

  def __post_init__(self):
    _at_least(self, 1, "replicas")
    _at_least(self, 0, "max_restarts", "pod_retries")


@dataclasses.dataclass(frozen=True)
class GKEPortsConfig:
  """The ports the run's pods serve on."""

  flight_port: int = 8470  # the trainer's Arrow Flight server (samples in, weights out)
  coordinator_port: int = 8476  # jax.distributed among the trainer's hosts
  relay_port: int = 0  # samplers serve the weights they hold here to the others (the broadcast tree); 0: none

  def __post_init__(self):
    for key in ("flight_port", "coordinator_port"):
      if not 1 <= getattr(self, key) <= 65535:
        raise ValueError(f"GKEPortsConfig.{key} {getattr(self, key)} is not a port")
    if self.flight_port == self.coordinator_port:
      raise ValueError("GKEPortsConfig.flight_port and GKEPortsConfig.coordinator_port must differ")
    if self.relay_port and not 1 <= self.relay_port <= 65535:
      raise ValueError(f"GKEPortsConfig.relay_port {self.relay_port} is not a port (0: samplers serve no relay)")


@dataclasses.dataclass(frozen=True)
class GKEConfig:
  """One run on one GKE cluster: a trainer JobSet (one slice or node group, its hosts one jax.distributed
  cluster) and a sampler JobSet (`GKESamplersConfig.replicas` single-host replicas, each one `streamrl sampler`)."""

  name: str = "streamrl"  # the run: JobSets NAME-trainer and NAME-samplers, ConfigMap NAME-config
  namespace: str = "default"  # the Kubernetes namespace the run's JobSets and ConfigMap go in
  platform: str = "tpu-v5e"  # tpu-v5e, tpu-v5p, tpu-v6e or gpu-a3 (H100 80GB)
  image: str = ""  # the container image built from launchers/gke/Dockerfile (required)
  bucket: str = ""  # gs://BUCKET[/PREFIX]: the workdir is PREFIX/NAME in it, mounted by Cloud Storage FUSE
  mount_path: str = "/gcs"  # where the bucket is mounted in the containers
  service_account: str = "streamrl"  # Kubernetes service account with access to the bucket (Workload Identity)
  tls_secret: str = ""  # Secret with ca.crt, tls.crt, tls.key for mutual TLS ("": NAME-flight-tls); "none": off
  site: str = ""  # this cluster's datacenter label (`--site` of both roles, label streamrl/site)
  accelerators_per_host: int = 0  # 0: the platform's default for the topology (GPU: 8)
  trainer: GKETrainerConfig = GKETrainerConfig()  # the trainer JobSet: its slice and restarts
  samplers: GKESamplersConfig = GKESamplersConfig()  # the sampler JobSet: its replicas and their retries
  ports: GKEPortsConfig = GKEPortsConfig()  # the trainer's Flight and coordinator ports, the samplers' relay port

  def __post_init__(self):
    if not NAME.fullmatch(self.name) or len(self.name) > MAX_NAME:
      raise ValueError(f"GKEConfig.name {self.name!r}: lower-case letters, digits and '-', starting with a letter, "
                       f"at most {MAX_NAME} characters")
    if not NAME.fullmatch(self.namespace):
      raise ValueError(f"GKEConfig.namespace {self.namespace!r} is not a valid Kubernetes namespace")
    if self.platform not in PLATFORMS:
      raise ValueError(f"GKEConfig.platform {self.platform!r}: one of {sorted(PLATFORMS)}")
    if not self.image:
      raise ValueError("GKEConfig.image is required: the image built from launchers/gke/Dockerfile, e.g. "
                       "--set GKEConfig.image='us-docker.pkg.dev/PROJECT/REPO/streamrl:TAG'")
    if not re.fullmatch(r"gs://[a-z0-9][-_.a-z0-9]{1,220}[a-z0-9](/[^/]+)*/?", self.bucket):
      raise ValueError(f"GKEConfig.bucket {self.bucket!r}: expected gs://BUCKET or gs://BUCKET/PREFIX")
    if not re.fullmatch(r"([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?", self.site):
      raise ValueError(f"GKEConfig.site {self.site!r}: lower-case letters, digits and '-' (a label value)")
    _at_least(self, 0, "accelerators_per_host")
    if not self.mount_path.startswith("/"):
      raise ValueError(f"GKEConfig.mount_path {self.mount_path!r} must be absolute")
    sampler = self.sampler_shape  # raises on a bad topology
    self.trainer_shape  # noqa: B018 (validates)
    if sampler.hosts != 1:
      raise ValueError(f"GKESamplersConfig.topology {self.samplers.topology!r} spans {sampler.hosts} hosts; a sampler "
                       "replica is one process: use a single-host topology and more GKESamplersConfig.replicas")

  def check_mesh(self, mesh) -> None:
    """Raises unless the run's `MeshConfig` fits the roles' accelerators (0 devices: all of them)."""
    for role, shape, key in (("trainer", self.trainer_shape, "GKETrainerConfig"),
                             ("sampler", self.sampler_shape, "GKESamplersConfig")):
      wanted = getattr(mesh, f"{role}_devices") or shape.accelerators
      tensor = getattr(mesh, f"{role}_tensor_parallel")
      if wanted > shape.accelerators:
        raise ValueError(f"MeshConfig.{role}_devices={wanted}, but a {role} on GKE gets {shape.accelerators} "
                         f"{self.spec.resource} ({key}.topology / hosts); set it to 0 (all of them)")
      if wanted % tensor:
        raise ValueError(f"MeshConfig.{role}_tensor_parallel={tensor} does not divide the {role}'s {wanted} devices")

  @property
  def spec(self) -> Platform:
    return PLATFORMS[self.platform]

  @property
  def trainer_shape(self) -> RoleShape:
    return role_shape(self.spec, "GKETrainerConfig.topology", self.trainer.topology, self.trainer.hosts,
                      self.accelerators_per_host)

  @property
  def sampler_shape(self) -> RoleShape:
    return role_shape(self.spec, "GKESamplersConfig.topology", self.samplers.topology,
                      1 if self.spec.kind == "gpu" else 0, self.accelerators_per_host if self.spec.kind == "gpu" else 0)

  @property
  def bucket_name(self) -> str:
    return self.bucket[len("gs://"):].split("/", 1)[0]

  @property
  def workdir(self) -> str:
    """The run's workdir inside the containers (the bucket's PREFIX/NAME under the mount)."""
    prefix = self.bucket[len("gs://"):].rstrip("/").partition("/")[2]
    return "/".join(p for p in (self.mount_path.rstrip("/"), prefix, self.name) if p)

  @property
  def workdir_url(self) -> str:
    return f"{self.bucket.rstrip('/')}/{self.name}"

  @property
  def tls_secret_name(self) -> str | None:
    return None if self.tls_secret == "none" else self.tls_secret or f"{self.name}-flight-tls"
