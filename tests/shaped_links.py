"""Shaped links for tests and benchmarks: network namespaces joined by veth pairs and bridges, rate-limited
by `tc tbf`, with processes run inside them.

A `Topology` has one namespace per node (the trainer, each sampler) and one hub namespace per site holding
a bridge; every node's veth pair joins its namespace to its site's bridge, and the sites' bridges are joined
by one veth pair (the inter-site link). All nodes share one subnet. Each link is shaped in both directions
(`tbf` on both ends of its veth pair). Needs root and iproute2; `unavailable()` says why not, for a skip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess


def _run(*args: str) -> str:
  out = subprocess.run(args, capture_output=True, text=True, timeout=30)
  if out.returncode != 0:
    raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip()}")
  return out.stdout


def unavailable() -> str | None:
  """Why namespaces with shaped links cannot be built here, or None."""
  if os.geteuid() != 0:
    return "needs root to create network namespaces"
  if shutil.which("ip") is None or shutil.which("tc") is None:
    return "needs iproute2 (ip, tc)"
  name = f"srlprobe{os.getpid()}"
  try:
    _run("ip", "netns", "add", name)
    _run("ip", "-n", name, "link", "add", "b0", "type", "bridge")
    _run("ip", "-n", name, "link", "add", "p0", "type", "veth", "peer", "name", "p1")
    _run("tc", "-n", name, "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit", "burst", "64kb",
         "latency", "100ms")
  except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
    return f"cannot build a shaped namespace: {err}"
  finally:
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
  return None


def _shape(ns: str, dev: str, mbit: float) -> None:
  burst = max(256 << 10, int(mbit * 1e6 / 8 / 100))  # at least 10 ms of the rate, and several GSO packets
  _run("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst),
       "latency", "200ms")


class Topology:
  """Nodes {name: (site, link mbit)} on bridged sites; `inter_site_mbit` shapes the link between each site
  and the first one. `ip(name)` is a node's address, `popen(name, argv)` runs a process in its namespace,
  `link_bytes(site)` reads the bytes sent across from the first site to `site`. Use as a context manager:
  everything it made is deleted on exit."""

  def __init__(self, nodes: dict[str, tuple[str, float]], inter_site_mbit: float | None = None):
    self.nodes, self.inter_site_mbit = nodes, inter_site_mbit
    self.tag = f"srl{os.getpid() % 100000}"
    self.sites = list(dict.fromkeys(site for site, _ in nodes.values()))
    self._made: list[str] = []
    self._procs: list[subprocess.Popen] = []

  def ns(self, name: str) -> str:
    return f"{self.tag}-{name}"

  def hub(self, site: str) -> str:
    return f"{self.tag}-hub-{site}"

  def ip(self, name: str) -> str:
    return f"10.77.{list(self.nodes).index(name) // 200}.{list(self.nodes).index(name) % 200 + 10}"

  def __enter__(self) -> Topology:
    try:
      for site in self.sites:
        hub = self._netns(self.hub(site))
        _run("ip", "-n", hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", hub, "link", "set", "br0", "up")
      for i, (name, (site, mbit)) in enumerate(self.nodes.items()):
        ns, hub = self._netns(self.ns(name)), self.hub(site)
        _run("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"n{i}", "netns", hub)
        _run("ip", "-n", ns, "addr", "add", f"{self.ip(name)}/16", "dev", "eth0")
        for where, dev in ((ns, "eth0"), (hub, f"n{i}")):
          _run("ip", "-n", where, "link", "set", dev, "up")
          _shape(where, dev, mbit)
        _run("ip", "-n", hub, "link", "set", f"n{i}", "master", "br0")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
      first = self.sites[0]
      for j, site in enumerate(self.sites[1:]):
        _run("ip", "-n", self.hub(first), "link", "add", f"x{j}", "type", "veth", "peer", "name", "x", "netns",
             self.hub(site))
        for where, dev in ((self.hub(first), f"x{j}"), (self.hub(site), "x")):
          _run("ip", "-n", where, "link", "set", dev, "up", "master", "br0")
          if self.inter_site_mbit:
            _shape(where, dev, self.inter_site_mbit)
    except BaseException:
      self.__exit__(None, None, None)
      raise
    return self

  def _netns(self, name: str) -> str:
    _run("ip", "netns", "add", name)
    self._made.append(name)
    return name

  def popen(self, name: str, argv: list[str], **kwargs) -> subprocess.Popen:
    proc = subprocess.Popen(["ip", "netns", "exec", self.ns(name), *argv], **kwargs)
    self._procs.append(proc)
    return proc

  def link_bytes(self, site: str) -> int:
    """Bytes sent so far from the first site's bridge towards `site` over the inter-site link."""
    j = self.sites.index(site) - 1
    stats = json.loads(_run("ip", "-j", "-s", "-n", self.hub(self.sites[0]), "link", "show", "dev", f"x{j}"))
    return int(stats[0]["stats64"]["tx"]["bytes"])

  def __exit__(self, *exc) -> None:
    for proc in self._procs:
      if proc.poll() is None:
        proc.kill()
      try:
        proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        pass
    for name in reversed(self._made):
      subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    self._made.clear()
