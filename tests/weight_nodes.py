"""Weights-only programs for broadcast tests and benchmarks: a trainer node (the trainer's Flight server, the
real controller and weight store, no model) and sampler nodes (the real weight receiver and relay, no engine).

  python tests/weight_nodes.py trainer --listen HOST:0 --mb 8 --tensors 8 [--site a] [--fanout 1]
      prints {"listening": address}; then reads commands from stdin, one a line: `publish V` (prints
      {"published": V, "t": epoch seconds}), `stop`.
  python tests/weight_nodes.py sampler --connect ADDR --name s0 [--site b] [--relay-listen HOST:0]
      prints {"held": V, "t": epoch seconds, "crc": ..., **stats} each time a version lands, and with a relay
      {"serving": V} while it sends a child chunks of version V it does not hold whole yet; exits when stdin closes.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def params_of(mb: float, tensors: int, version: int) -> dict:
  import numpy as np
  per = max(1, int(mb * 2**20 / 4 / tensors))
  return {f"w{i:02d}": np.full(per, version * 1000 + i, np.float32) for i in range(tensors)}


def checksum(flat: dict) -> int:
  import numpy as np
  crc = 0
  for name in sorted(flat):
    crc = zlib.crc32(np.ascontiguousarray(flat[name]).tobytes(), crc)
  return crc


def say(**fields) -> None:
  print(json.dumps(fields), flush=True)


def trainer(args) -> None:
  from streamrl_jax.pipeline.config import PipelineConfig
  from streamrl_jax.pipeline.controller import Controller, ControllerSetup, JoinTerms
  from streamrl_jax.pipeline.controller.config import ControllerConfig
  from streamrl_jax.streaming.flight_config import parse_address
  from streamrl_jax.streaming.flight_server import HostWeightStore, ServerLimits, TrainerFlightServer
  from streamrl_jax.streaming.queue import SampleQueue
  events = []
  config = PipelineConfig(controller=ControllerConfig(weight_fanout=args.fanout))
  setup = ControllerSetup(config.shape, config.controller, config.scheduling, config.sampler.engine.num_slots)
  controller = Controller(setup, None, None, start_step=0, terms=JoinTerms(site=args.site), on_event=events.append)
  store = HostWeightStore(keep=2)
  server = TrainerFlightServer(*parse_address(args.listen, "--listen"), controller=controller, samples=SampleQueue(1),
                               weights=store, limits=ServerLimits(1))
  say(listening=server.address)
  for line in sys.stdin:
    command = line.split()
    if command[:1] == ["publish"]:
      version = int(command[1])
      params = params_of(args.mb, args.tensors, version)
      start = time.time()
      store.publish(params, version)
      store.wait()
      say(published=version, t=start, crc=checksum({f"['{k}']": v for k, v in params.items()}))
    elif command[:1] == ["trees"]:  # asked once every sampler holds the version: its tree was made by then
      version = int(command[1])
      say(trees=[{"version": e["version"], "parents": e["parents"], "drawing": e["drawing"]} for e in events
                 if e["event"] == "broadcast_tree" and e["version"] == version])
    elif command[:1] == ["stop"]:
      break
  say(counters=server.counters)
  server.shutdown()


def sampler(args) -> None:
  import numpy as np
  from streamrl_jax.messages import Register
  from streamrl_jax.streaming.flight_client import FlightConnection, FlightControl, FlightWeightReceiver, RelayLinks
  from streamrl_jax.streaming.flight_config import parse_address
  from streamrl_jax.streaming.weight_relay import RelayServer, RelayStore
  relay = None
  if args.relay_listen:
    relay = RelayServer(*parse_address(args.relay_listen, "--relay-listen"), RelayStore())
  connection = FlightConnection(args.connect, timeout_s=120, retry_s=60)
  sampler_id = FlightControl(connection).register(Register(args.name, {}, site=args.site,
                                                           relay=relay.address if relay else "")).sampler_id
  template = {k: np.zeros_like(v) for k, v in params_of(args.mb, args.tensors, 0).items()}
  receiver = FlightWeightReceiver(connection, template, None, poll_s=1.0, sampler_id=sampler_id,
                                  relays=RelayLinks(relay.store if relay else None), streams=args.streams)
  say(registered=args.name, relay=relay.address if relay else "")
  done = threading.Event()
  threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
  have, served = -1, 0
  while not done.wait(0.005):
    if relay is not None and relay.store.served_bytes > served:  # a child takes chunks of the version on its way
      served = relay.store.served_bytes
      say(serving=have + 1)
    update = receiver.latest()
    if update is not None and update.version > have:
      have = update.version
      flat = {f"['{k}']": np.asarray(v) for k, v in update.params.items()}
      say(held=have, t=receiver.held_at[have], crc=checksum(flat), **receiver.stats,
          **(relay.counters if relay else {}))
  receiver.close()
  if relay is not None:
    relay.shutdown()


class Lines:
  """A process's JSON stdout lines, read on a thread; `next(key, timeout)` waits for one holding `key`."""

  def __init__(self, proc):
    import queue
    self.proc, self._queue = proc, queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      if line.startswith("{"):
        self._queue.put(json.loads(line))

  def next(self, key: str, timeout: float) -> dict:
    import queue
    deadline = time.monotonic() + timeout
    while True:
      try:
        row = self._queue.get(timeout=max(0.01, deadline - time.monotonic()))
      except queue.Empty:
        raise TimeoutError(f"no {key!r} line from process {self.proc.pid} within {timeout} s "
                           f"(exit code {self.proc.poll()})") from None
      if key in row:
        return row


def run_broadcast(spawn, ip, samplers: list[tuple[str, str, bool]], *, versions: int = 1, trainer_site: str = "",
                  fanout: int = 1, mb: float = 8.0, tensors: int = 8, kill=None,
                  timeout: float = 120.0, on_version=None) -> dict:
  """Starts a trainer node and `samplers` [(name, site, serves a relay)] with `spawn(name, argv) -> Popen`
  (stdin and stdout pipes, text), `ip(name)` the host each listens on; publishes `versions` versions one after
  another, each once every live sampler holds the last. `kill(previous version's record) -> name`: a sampler
  killed once it relays the last version to its child (its first `serving` line of it). Returns {"versions": [{version, published, held: {name: t}, crc_ok, trees}],
  "stats": {name: the sampler's last line}}. `on_version(version)` runs before each publish."""
  import subprocess
  node = [sys.executable, str(Path(__file__).resolve())]
  size = ["--mb", str(mb), "--tensors", str(tensors)]
  pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  trainer_proc = spawn("trainer", [*node, "trainer", "--listen", f"{ip('trainer')}:0", "--site", trainer_site,
                                   "--fanout", str(fanout), *size], **pipes)
  trainer_lines = Lines(trainer_proc)
  address = trainer_lines.next("listening", timeout)["listening"]
  procs, lines = {}, {}
  for name, site, relays in samplers:
    relay = ["--relay-listen", f"{ip(name)}:0"] if relays else []
    procs[name] = spawn(name, [*node, "sampler", "--connect", address, "--name", name, "--site", site, *relay, *size],
                        **pipes)
    lines[name] = Lines(procs[name])
  for name in procs:  # registered in this order: the tree follows it
    lines[name].next("registered", timeout)
  out, stats = [], {}
  for version in range(1, versions + 1):
    if on_version is not None:
      on_version(version)
    trainer_proc.stdin.write(f"publish {version}\n")
    trainer_proc.stdin.flush()
    published = trainer_lines.next("published", timeout)
    killed = None
    if kill is not None and version == versions:  # killed while it relays the version to its child: mid-transfer
      killed = kill(out[-1])
      while lines[killed].next("serving", timeout)["serving"] != version:
        pass
      procs[killed].kill()
    held, crc_ok = {}, True
    for name in procs:
      if name == killed:
        continue
      row = lines[name].next("held", timeout)
      if row["held"] != version:
        raise RuntimeError(f"{name} holds version {row['held']}, expected {version}")
      held[name], crc_ok, stats[name] = row["t"], crc_ok and row["crc"] == published["crc"], row
    trainer_proc.stdin.write(f"trees {version}\n")
    trainer_proc.stdin.flush()
    trees = trainer_lines.next("trees", timeout)["trees"]
    out.append(dict(version=version, published=published["t"], held=held, crc_ok=crc_ok, killed=killed, trees=trees))
  for proc in [trainer_proc, *procs.values()]:
    if proc.poll() is None:
      proc.stdin.close()
  trainer_proc.wait(timeout=30)
  return {"versions": out, "stats": stats}


def main() -> None:
  from streamrl_jax.streaming.flight_config import FlightConfig
  parser = argparse.ArgumentParser()
  parser.add_argument("role", choices=["trainer", "sampler"])
  parser.add_argument("--listen", default="127.0.0.1:0")
  parser.add_argument("--connect")
  parser.add_argument("--name", default="s")
  parser.add_argument("--site", default="")
  parser.add_argument("--fanout", type=int, default=1)
  parser.add_argument("--streams", type=int, default=FlightConfig().weight_streams)
  parser.add_argument("--relay-listen")
  parser.add_argument("--mb", type=float, default=8.0)
  parser.add_argument("--tensors", type=int, default=8)
  args = parser.parse_args()
  (trainer if args.role == "trainer" else sampler)(args)


if __name__ == "__main__":
  main()
