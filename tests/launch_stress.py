"""Two threads launch two different collective programs N times each onto the same 2 CPU devices, through
their launcher or (`bare`) not; prints `done` when every launch has finished. Run as its own process: the
device count is fixed before jax starts. `python -m tests.launch_stress {launcher|bare} N`"""

import os
import sys
import threading

from tests.xla_flags import xla_flags  # noqa: E402  (imports no jax)

os.environ["XLA_FLAGS"] = xla_flags(devices=2)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from streamrl_jax import launch  # noqa: E402


def main(how: str, launches: int) -> None:
  mesh = Mesh(np.asarray(jax.devices()), ("x",))
  rows, whole = NamedSharding(mesh, PartitionSpec("x")), NamedSharding(mesh, PartitionSpec())
  x = jax.device_put(jnp.ones((256, 256)), rows)
  jit = launch.launcher(mesh).jit if how == "launcher" else jax.jit
  programs = (jit(lambda a: a @ a.sum(0, keepdims=True).T, out_shardings=whole),  # an all-reduce inside
              jit(lambda a: jnp.tile(a.mean(), (4, 4)) + a.max(), out_shardings=whole))  # two more

  def launch_all(program):
    for _ in range(launches):
      out = program(x)
    out.block_until_ready()
  threads = [threading.Thread(target=launch_all, args=(p,)) for p in programs]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  print("done", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], int(sys.argv[2]))
