"""A validator of rendered manifests against the APIs the cluster would apply them to (a test helper).

The JobSet `jobset.x-k8s.io/v1alpha2` types are written out here from the API reference (field names,
types, which are required, enums); the Job and Pod templates they embed, and the ConfigMap, are checked by
the Kubernetes client's own models (pydantic: unknown fields forbidden, types strict). A manifest passes
only if it parses and dumps back to itself, so a snake_case or misplaced key fails too: the API server
would drop such a field silently.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from kubernetes.client import models as k8s
from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel


class _Api(BaseModel):
  model_config = ConfigDict(extra="forbid", strict=True, alias_generator=to_camel, populate_by_name=False)


class Coordinator(_Api):
  replicated_job: str
  job_index: int
  pod_index: int


class DependsOn(_Api):
  name: str
  status: Literal["Ready", "Complete"]


class ReplicatedJob(_Api):
  name: str
  group_name: Optional[str] = None
  template: k8s.V1JobTemplateSpec
  replicas: int = 1
  depends_on: Optional[list[DependsOn]] = None


class Network(_Api):
  enable_dns_hostnames: Optional[bool] = Field(default=None, alias="enableDNSHostnames")
  subdomain: Optional[str] = None
  publish_not_ready_addresses: Optional[bool] = None


class SuccessPolicy(_Api):
  operator: Literal["All", "Any"]
  target_replicated_jobs: Optional[list[str]] = None


class FailurePolicyRule(_Api):
  name: str
  action: Literal["FailJobSet", "RestartJobSet", "RestartJobSetAndIgnoreMaxRestarts"]
  on_job_failure_reasons: Optional[list[str]] = None
  target_replicated_jobs: Optional[list[str]] = None


class FailurePolicy(_Api):
  max_restarts: Optional[int] = None
  restart_strategy: Optional[Literal["Recreate", "BlockingRecreate"]] = None
  rules: Optional[list[FailurePolicyRule]] = None


class StartupPolicy(_Api):
  startup_policy_order: Literal["AnyOrder", "InOrder"]


class JobSetSpec(_Api):
  replicated_jobs: list[ReplicatedJob]
  network: Optional[Network] = None
  success_policy: Optional[SuccessPolicy] = None
  failure_policy: Optional[FailurePolicy] = None
  startup_policy: Optional[StartupPolicy] = None
  suspend: Optional[bool] = None
  coordinator: Optional[Coordinator] = None
  managed_by: Optional[str] = None
  ttl_seconds_after_finished: Optional[int] = None


class JobSet(_Api):
  api_version: Literal["jobset.x-k8s.io/v1alpha2"]
  kind: Literal["JobSet"]
  metadata: k8s.V1ObjectMeta
  spec: JobSetSpec


DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
QUANTITY = re.compile(r"\d+(\.\d+)?([KMGTPE]i?|[mkMGTPE])?")
FIELD_PATH = re.compile(r"metadata\.(name|namespace|uid|labels\['[-./a-z0-9]+'\]|annotations\['[-./a-z0-9]+'\])"
                        r"|spec\.(nodeName|serviceAccountName)|status\.(hostIP|podIP|podIPs)")


def validate(manifest: dict) -> None:
  """Raises (pydantic.ValidationError or AssertionError, naming the field) unless the cluster would keep
  every field of `manifest` as written."""
  if manifest.get("kind") == "JobSet":
    model = JobSet.model_validate(manifest)
    _same(model.model_dump(by_alias=True, exclude_none=True), manifest, "")
    names = [rj.name for rj in model.spec.replicated_jobs]
    assert len(set(names)) == len(names), f"replicated job names repeat: {names}"
    for rj in model.spec.replicated_jobs:
      assert DNS_LABEL.fullmatch(rj.name), rj.name
      _job(rj.template.spec, f"replicatedJobs[{rj.name}]")
    assert len(model.metadata.name) <= 63 and DNS_LABEL.fullmatch(model.metadata.name), model.metadata.name
  elif manifest.get("kind") == "ConfigMap":
    assert manifest.get("apiVersion") == "v1"
    model = k8s.V1ConfigMap.model_validate(manifest)
    _same(model.model_dump(by_alias=True, exclude_none=True), manifest, "")
  else:
    raise AssertionError(f"unexpected kind {manifest.get('kind')!r}")


def _job(spec: k8s.V1JobSpec, where: str) -> None:
  assert spec.completion_mode in (None, "Indexed", "NonIndexed"), f"{where}.completionMode {spec.completion_mode}"
  pod = spec.template.spec
  assert pod.restart_policy in ("Never", "OnFailure"), f"{where}: a Job's pods restart Never or OnFailure"
  for container in pod.containers:
    for env in container.env or ():
      assert ENV_NAME.fullmatch(env.name), f"{where}: env name {env.name!r}"
      assert (env.value is None) != (env.value_from is None), f"{where}: env {env.name} needs value xor valueFrom"
      if env.value_from is not None:
        assert FIELD_PATH.fullmatch(env.value_from.field_ref.field_path), env.value_from.field_ref.field_path
    resources = container.resources
    for quantities in (resources.requests or {}, resources.limits or {}):
      for name, value in quantities.items():
        assert QUANTITY.fullmatch(value), f"{where}: {name} quantity {value!r}"
    for port in container.ports or ():
      assert 1 <= port.container_port <= 65535 and len(port.name or "") <= 15
    mounts = {m.name for m in container.volume_mounts or ()}
    volumes = {v.name for v in pod.volumes or ()}
    assert mounts <= volumes, f"{where}: mounts without a volume: {sorted(mounts - volumes)}"


def _same(dumped, given, path: str) -> None:
  """The manifest equals what the API types keep of it (no field renamed, dropped or coerced)."""
  if isinstance(given, dict):
    assert isinstance(dumped, dict) and dumped.keys() == given.keys(), (
        f"at {path or '/'}: the API keeps {sorted(dumped) if isinstance(dumped, dict) else dumped!r}, "
        f"the manifest has {sorted(given)}")
    for key in given:
      _same(dumped[key], given[key], f"{path}/{key}")
  elif isinstance(given, list):
    assert isinstance(dumped, list) and len(dumped) == len(given), f"at {path}"
    for i, (d, g) in enumerate(zip(dumped, given)):
      _same(d, g, f"{path}[{i}]")
  else:
    assert dumped == given and type(dumped) is type(given), f"at {path}: {given!r} became {dumped!r}"
