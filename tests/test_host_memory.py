"""The host allocator's settings: taken through mallopt at start, and left alone when the environment says."""

import json
import os
import subprocess
import sys

CODE = "import json; from streamrl_jax.host_memory import limit_fragmentation; print(json.dumps(limit_fragmentation()))"


def _run(**env):
  clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  done = subprocess.run([sys.executable, "-c", CODE], env={**clean, **env}, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout)


def test_glibc_takes_both_settings_unless_the_environment_says():
  if not sys.platform.startswith("linux"):
    return
  assert _run() == {"MALLOC_MMAP_THRESHOLD_": True, "MALLOC_ARENA_MAX": True}
  assert _run(MALLOC_ARENA_MAX="8") == {"MALLOC_MMAP_THRESHOLD_": True}
