"""`streamrl launch gke --render OUTDIR [--apply]`: the run's manifests from its gin config and GKEConfig."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

APPLY_ORDER = ("configmap.yaml", "trainer.yaml", "samplers.yaml")


def add_gke_parser(where, common) -> None:
  gke = where.add_parser("gke", help="render (and apply) the run's JobSets for a GKE TPU or GPU cluster",
                         description="Writes OUTDIR/configmap.yaml, trainer.yaml and samplers.yaml from the gin "
                                     "config; GKEConfig.* bindings say where (see launchers/README.md).")
  common(gke)
  gke.add_argument("--render", required=True, metavar="OUTDIR", help="where to write the manifests")
  gke.add_argument("--apply", action="store_true", help="then `kubectl apply` them (kubectl must be on PATH)")
  gke.set_defaults(run=cmd_launch_gke)


def run_config_text(config_files: list[str], bindings: list[str]) -> str:
  """The gin text both roles read in the cluster: the files, then the bindings (later ones win, as locally)."""
  parts = []
  for name in config_files:
    path = Path(name)
    if not path.is_file():
      raise FileNotFoundError(f"--config {name}: no such file")
    text = path.read_text()
    if any(line.lstrip().startswith("include ") for line in text.splitlines()):
      raise ValueError(f"--config {name}: `include` is not followed into the cluster; pass each file with --config")
    parts.append(f"# from {path.name}\n{text.rstrip()}\n")
  if bindings:
    parts.append("# --set\n" + "\n".join(bindings) + "\n")
  return "\n".join(parts)


def cmd_launch_gke(args) -> int:
  import yaml

  from streamrl_jax import gin_config
  from streamrl_jax.gke import render, trainer_address

  args.config = gin_config.run_files(args.config)
  gin_config.parse(args.config, args.set)  # the run's own config must build here, before anything is written
  config, _ = gin_config.build_run()
  gin_config.build_flight()
  gke = gin_config.build_gke()
  gke.check_mesh(config.mesh)
  manifests = render(gke, run_config_text(args.config, args.set))
  out = Path(args.render)
  out.mkdir(parents=True, exist_ok=True)
  for name, manifest in manifests.items():
    (out / name).write_text(yaml.safe_dump(manifest, sort_keys=False, width=120))
  trainer, sampler = gke.trainer_shape, gke.sampler_shape
  summary = {"name": gke.name, "namespace": gke.namespace, "platform": gke.platform, "mode": config.mode,
             "trainer": {"hosts": trainer.hosts, "accelerators": trainer.accelerators, "topology": trainer.topology},
             "samplers": {"replicas": gke.samplers.replicas, "accelerators_each": sampler.accelerators,
                          "topology": sampler.topology},
             "trainer_address": trainer_address(gke), "workdir": gke.workdir_url, "tls_secret": gke.tls_secret_name,
             "files": [str(out / n) for n in APPLY_ORDER]}
  (out / "launch.json").write_text(json.dumps(summary, indent=2))
  print(f"streamrl launch gke: wrote {', '.join(APPLY_ORDER)} to {out}: trainer {trainer.hosts} host(s) x "
        f"{trainer.per_host} {gke.platform}, {gke.samplers.replicas} sampler(s) x {sampler.per_host}; "
        f"workdir {gke.workdir_url}")
  if gke.tls_secret_name is None:
    print("streamrl launch gke: warning: GKEConfig.tls_secret='none': samples and weights cross the cluster "
          "network unencrypted and unauthenticated", file=sys.stderr)
  if not args.apply:
    print(f"apply with: kubectl apply -f {out / APPLY_ORDER[0]} -f {out / APPLY_ORDER[1]} -f {out / APPLY_ORDER[2]}")
    return 0
  kubectl = shutil.which("kubectl")
  if kubectl is None:
    print(f"streamrl launch gke: --apply: kubectl is not on PATH, nothing was applied; the manifests are in {out}",
          file=sys.stderr)
    return 2
  for name in APPLY_ORDER:
    code = subprocess.call([kubectl, "apply", "-f", str(out / name)])
    if code:
      print(f"streamrl launch gke: kubectl apply -f {out / name} failed with code {code}", file=sys.stderr)
      return code
  print(f"streamrl launch gke: applied; watch with: kubectl get jobsets -n {gke.namespace} -l "
        f"app.kubernetes.io/instance={gke.name}")
  return 0
