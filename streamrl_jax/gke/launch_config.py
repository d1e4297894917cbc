"""`GKEConfig`: where and how a run goes on GKE (gin-bindable, like the run's own configs)."""

from __future__ import annotations

import dataclasses
import re

from streamrl_jax.gke.platforms import PLATFORMS, Platform, RoleShape, role_shape

NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
MAX_NAME = 24  # pod host names are NAME-trainer-trainer-J-P and must stay within a 63-character DNS label


@dataclasses.dataclass(frozen=True)
class GKEConfig:
  """One run on one GKE cluster: a trainer JobSet (one slice or node group, its hosts one jax.distributed
  cluster) and a sampler JobSet (`sampler_replicas` single-host replicas, each one `streamrl sampler`)."""

  name: str = "streamrl"  # the run: JobSets NAME-trainer and NAME-samplers, ConfigMap NAME-config
  namespace: str = "default"  # the Kubernetes namespace the run's JobSets and ConfigMap go in
  platform: str = "tpu-v5e"  # tpu-v5e, tpu-v5p, tpu-v6e or gpu-a3 (H100 80GB)
  image: str = ""  # the container image built from launchers/gke/Dockerfile (required)
  bucket: str = ""  # gs://BUCKET[/PREFIX]: the workdir is PREFIX/NAME in it, mounted by Cloud Storage FUSE
  trainer_topology: str = "2x4"  # the trainer's TPU slice (ignored on GPU)
  trainer_hosts: int = 0  # 0: from the topology (TPU) or 1 (GPU)
  sampler_topology: str = "2x2"  # each engine instance's TPU slice: single-host (ignored on GPU)
  sampler_replicas: int = 2  # replicas of the sampler JobSet, each one single-host `streamrl sampler`
  accelerators_per_host: int = 0  # 0: the platform's default for the topology (GPU: 8)
  flight_port: int = 8470  # the trainer's Arrow Flight server (samples in, weights out)
  coordinator_port: int = 8476  # jax.distributed among the trainer's hosts
  service_account: str = "streamrl"  # Kubernetes service account with access to the bucket (Workload Identity)
  tls_secret: str = ""  # Secret with ca.crt, tls.crt, tls.key for mutual TLS ("": NAME-flight-tls); "none": off
  trainer_max_restarts: int = 3  # whole-trainer restarts (it resumes from its last checkpoint)
  sampler_max_restarts: int = 10  # whole-sampler-JobSet restarts, after a replica used up its pod retries
  sampler_pod_retries: int = 3  # a failed sampler pod is started again this often before its Job fails
  mount_path: str = "/gcs"  # where the bucket is mounted in the containers
  site: str = ""  # this cluster's datacenter label (`--site` of both roles, label streamrl/site)
  relay_port: int = 0  # samplers serve the weights they hold here to the others (the broadcast tree); 0: none

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
    for key in ("flight_port", "coordinator_port"):
      if not 1 <= getattr(self, key) <= 65535:
        raise ValueError(f"GKEConfig.{key} {getattr(self, key)} is not a port")
    if self.flight_port == self.coordinator_port:
      raise ValueError("GKEConfig.flight_port and GKEConfig.coordinator_port must differ")
    if self.relay_port and not 1 <= self.relay_port <= 65535:
      raise ValueError(f"GKEConfig.relay_port {self.relay_port} is not a port (0: samplers serve no relay)")
    if not re.fullmatch(r"([a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)?", self.site):
      raise ValueError(f"GKEConfig.site {self.site!r}: lower-case letters, digits and '-' (a label value)")
    for key in ("sampler_replicas",):
      if getattr(self, key) < 1:
        raise ValueError(f"GKEConfig.{key} must be >= 1")
    for key in ("trainer_hosts", "accelerators_per_host", "trainer_max_restarts", "sampler_max_restarts",
                "sampler_pod_retries"):
      if getattr(self, key) < 0:
        raise ValueError(f"GKEConfig.{key} must be >= 0")
    if not self.mount_path.startswith("/"):
      raise ValueError(f"GKEConfig.mount_path {self.mount_path!r} must be absolute")
    sampler = self.sampler_shape  # raises on a bad topology
    self.trainer_shape  # noqa: B018 (validates)
    if sampler.hosts != 1:
      raise ValueError(f"GKEConfig.sampler_topology {self.sampler_topology!r} spans {sampler.hosts} hosts; a sampler "
                       "replica is one process: use a single-host topology and more GKEConfig.sampler_replicas")

  def check_mesh(self, mesh) -> None:
    """Raises unless the run's `MeshConfig` fits the roles' accelerators (0 devices: all of them)."""
    for role, shape in (("trainer", self.trainer_shape), ("sampler", self.sampler_shape)):
      wanted = getattr(mesh, f"{role}_devices") or shape.accelerators
      tensor = getattr(mesh, f"{role}_tensor_parallel")
      if wanted > shape.accelerators:
        raise ValueError(f"MeshConfig.{role}_devices={wanted}, but a {role} on GKE gets {shape.accelerators} "
                         f"{self.spec.resource} (GKEConfig.{role}_topology / hosts); set it to 0 (all of them)")
      if wanted % tensor:
        raise ValueError(f"MeshConfig.{role}_tensor_parallel={tensor} does not divide the {role}'s {wanted} devices")

  @property
  def spec(self) -> Platform:
    return PLATFORMS[self.platform]

  @property
  def trainer_shape(self) -> RoleShape:
    return role_shape(self.spec, "trainer_topology", self.trainer_topology, self.trainer_hosts,
                      self.accelerators_per_host)

  @property
  def sampler_shape(self) -> RoleShape:
    return role_shape(self.spec, "sampler_topology", self.sampler_topology, 1 if self.spec.kind == "gpu" else 0,
                      self.accelerators_per_host if self.spec.kind == "gpu" else 0)

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
