"""Weights to many samplers: the relay tree against a star, on links shaped by `tc tbf` in network
namespaces, and the trainer's weight stream against memcpy on loopback.

- Loopback, one sampler: a ~100M-parameter float32 version fetched by DoGet from a weights-only server in
  another process (`multiprocess.weight_transfer`, 2 and 4 parallel streams), against a host copy of the same
  bytes into a fresh buffer, in the same run: `loopback_vs_memcpy` (`FlightConfig.weight_streams`) and the best.
- Shaped star: a trainer node and 4 sampler nodes on one site, every link shaped to LINK_MBIT both ways, a
  MODEL_MB version: seconds from publish until every sampler holds it, relays on (the tree of
  `scheduling.broadcast`, fan-out `ControllerConfig.weight_fanout`) and off (every sampler pulls from the
  trainer); `tree_vs_star` is their ratio (median over the versions of each run).
- Two sites: a trainer and 2 samplers on site a, 2 samplers on site b, the sites joined by LINK_MBIT / 10:
  `inter_site_copies` is the bytes sent across (the interface counter of the inter-site veth, all traffic
  included) per version in model copies; `sim_error` compares the time measured with the time `streamrl
  simulate`'s `cross-datacenter` preset predicts (`sim.pipeline.sync_seconds`) for these links, sites and
  bytes.

The nodes are real processes (tests/weight_nodes.py: the trainer's Flight server, controller and weight store;
the samplers' weight receiver and relay), each in its own namespace. Needs root for the namespaces; without,
the shaped figures are reported as skipped with the reason. Prints one JSON object as its last line.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from sizing import size  # noqa: E402

LINK_MBIT = 400  # R: the trainer's link and every sampler's
STAR_MODEL_MB, SITES_MODEL_MB, TENSORS, VERSIONS = size(40, 20), 8, 8, size(3, 2)
TWO_SITE_RELAYS = size((True, False), (True,))  # quick: no two-site star (its figures, *_star, have no goal)


def loopback() -> dict:
  from multiprocess import weight_transfer
  out = {}
  for streams in (2, 4):
    got = weight_transfer(streams)
    out[f"weight_transfer_gbps_{streams}_streams"] = got["weight_transfer_gbps"]
    out.update(memcpy_gbps=got["memcpy_gbps"], weight_bytes=got["weight_bytes"])
  from streamrl_jax.streaming.flight_config import FlightConfig
  default = out[f"weight_transfer_gbps_{FlightConfig().weight_streams}_streams"]
  best = max(out[f"weight_transfer_gbps_{s}_streams"] for s in (2, 4))
  out.update(loopback_vs_memcpy=round(default / out["memcpy_gbps"], 3),
             loopback_vs_memcpy_best=round(best / out["memcpy_gbps"], 3))
  return out


def shaped_run(nodes: dict, samplers: list, relays: bool, mb: float, inter_site: float | None = None) -> dict:
  from shaped_links import Topology
  from weight_nodes import run_broadcast
  with Topology(nodes, inter_site_mbit=inter_site) as topo:
    remote = [site for site in topo.sites[1:]]
    marks = {}

    def mark(version: int) -> None:
      marks[version] = sum(topo.link_bytes(site) for site in remote)
    result = run_broadcast(topo.popen, topo.ip, [(n, nodes[n][0], relays) for n in samplers], versions=VERSIONS,
                           mb=mb, tensors=TENSORS, trainer_site=nodes["trainer"][0], on_version=mark)
    mark(VERSIONS + 1)
  seconds = [max(v["held"].values()) - v["published"] for v in result["versions"]]
  copies = [(marks[v + 1] - marks[v]) / (mb * 2**20) for v in range(1, VERSIONS + 1)] if remote else []
  if not all(v["crc_ok"] for v in result["versions"]):
    raise RuntimeError("a sampler holds a version whose bytes differ from the trainer's")
  trees = result["versions"][-1]["trees"]
  return dict(seconds=round(statistics.median(seconds), 3), all_seconds=[round(s, 3) for s in seconds],
              copies=round(statistics.median(copies), 4) if copies else None,
              tree=trees[0]["drawing"] if trees else "star",
              relay_fallbacks=sum(s["relay_fallbacks"] for s in result["stats"].values()))


def simulated_seconds(mb: float, sampler_sites: tuple, broadcast: str) -> float:
  from streamrl_jax.sim.pipeline import sync_seconds
  from streamrl_jax.sim.presets import preset
  from streamrl_jax.streaming.weight_chunks import DEFAULT_CHUNK_BYTES
  config = preset("cross-datacenter")
  gbs = LINK_MBIT / 8 / 1000
  chunk = min(DEFAULT_CHUNK_BYTES, mb * 2**20 / TENSORS)  # a chunk is at most a tensor
  sync = dataclasses.replace(config.sync, bytes_per_param=4.0, bandwidth_gbs=gbs, sampler_link_gbs=gbs,
                             inter_site_gbs=gbs / 10, sampler_sites=sampler_sites, broadcast=broadcast,
                             chunk_mb=chunk / 2**20)
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, params_b=mb * 2**20 / 4 / 1e9),
                               sync=sync)
  return sync_seconds(config)


def shaped() -> dict:
  from shaped_links import unavailable
  why = unavailable()
  if why:
    print(f"shaped links skipped: {why}", file=sys.stderr)
    return {"shaped": f"skipped: {why}"}
  out = {"link_mbit": LINK_MBIT, "star_model_mb": STAR_MODEL_MB, "sites_model_mb": SITES_MODEL_MB}
  one_site = {"trainer": ("a", LINK_MBIT), **{f"s{i}": ("a", LINK_MBIT) for i in range(4)}}
  samplers = [f"s{i}" for i in range(4)]
  for relays in (True, False):
    run = shaped_run(one_site, samplers, relays, STAR_MODEL_MB)
    out["tree_s" if relays else "star_s"] = run["seconds"]
    out["tree_all_s" if relays else "star_all_s"] = run["all_seconds"]
    if relays:
      out["tree_drawing"], out["tree_relay_fallbacks"] = run["tree"], run["relay_fallbacks"]
    print("one site", "tree" if relays else "star", run, file=sys.stderr, flush=True)
  out["tree_vs_star"] = round(out["tree_s"] / out["star_s"], 3)
  out["sim_one_site_tree_s"] = round(simulated_seconds(STAR_MODEL_MB, (4,), "tree"), 3)
  out["sim_one_site_star_s"] = round(simulated_seconds(STAR_MODEL_MB, (4,), "star"), 3)
  two_sites = {"trainer": ("a", LINK_MBIT), "s0": ("a", LINK_MBIT), "s1": ("a", LINK_MBIT), "s2": ("b", LINK_MBIT),
               "s3": ("b", LINK_MBIT)}
  for relays in TWO_SITE_RELAYS:
    run = shaped_run(two_sites, samplers, relays, SITES_MODEL_MB, inter_site=LINK_MBIT / 10)
    key = "" if relays else "_star"
    out[f"inter_site_copies{key}"], out[f"two_site_s{key}"] = run["copies"], run["seconds"]
    out[f"sim_two_site_s{key}"] = round(simulated_seconds(SITES_MODEL_MB, (2, 2), "tree" if relays else "star"), 3)
    out[f"sim_error{key}"] = round(abs(out[f"sim_two_site_s{key}"] - run["seconds"]) / run["seconds"], 3)
    if relays:
      out["two_site_drawing"] = run["tree"]
    print("two sites", "tree" if relays else "star", run, file=sys.stderr, flush=True)
  return out


def main() -> dict:
  start = time.time()
  out = loopback()
  print("loopback", out, file=sys.stderr, flush=True)
  out.update(shaped())
  out["wall_s"] = round(time.time() - start, 1)
  return out


if __name__ == "__main__":
  print(json.dumps(main()))
