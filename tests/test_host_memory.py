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


def test_glibc_takes_the_settings_unless_the_environment_says():
  if not sys.platform.startswith("linux"):
    return
  assert _run() == {"MALLOC_MMAP_THRESHOLD_": True, "MALLOC_TRIM_THRESHOLD_": True, "MALLOC_ARENA_MAX": True}
  assert _run(MALLOC_ARENA_MAX="8") == {"MALLOC_MMAP_THRESHOLD_": True, "MALLOC_TRIM_THRESHOLD_": True}


TRIM_CODE = """
import ctypes, json
from streamrl_jax.host_memory import release_free_memory
from streamrl_jax.resources import resident_mb
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(8192) for _ in range(20000)]  # 160 MB of heap blocks under the mmap threshold
for b in blocks:
  ctypes.memset(b, 1, 8192)
for b in blocks[:-1]:  # the last one pins the top of the heap: glibc's own trim cannot give the rest back
  libc.free(b)
before = resident_mb()
done = release_free_memory()
print(json.dumps({"done": done, "before": before, "after": resident_mb()}))
"""


def test_free_heap_pages_go_back_to_the_system():
  if not sys.platform.startswith("linux"):
    return
  clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  done = subprocess.run([sys.executable, "-c", TRIM_CODE], env=clean, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  out = json.loads(done.stdout)
  assert out["done"] and out["before"] - out["after"] > 100, out


MAPPED_CODE = """
import ctypes, json
from streamrl_jax.host_memory import limit_fragmentation
limit_fragmentation()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
def mapped(size):  # glibc marks a chunk it mapped on its own (IS_MMAPPED, bit 1 of the size word before it)
  block = libc.malloc(size)
  return bool(ctypes.c_size_t.from_address(block - ctypes.sizeof(ctypes.c_size_t)).value & 2)
class Info(ctypes.Structure):
  _fields_ = [(n, ctypes.c_size_t) for n in
              "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc.mallinfo2.restype = Info
libc.free.argtypes = [ctypes.c_void_p]
decode = mapped(20 << 20)
libc.free(libc.malloc(30 << 20))  # freed at the top of the heap: kept for the next call, not handed back
print(json.dumps({"decode_buffer": decode, "embedding": mapped(113 << 20),
                  "top_kept": libc.mallinfo2().keepcost >= 30 << 20}))
"""


def test_a_decode_steps_temporary_buffer_is_reused_from_the_heap_and_a_weight_array_is_mapped():
  """A decode call's ~20 MB temporaries come from the heap and stay there between calls (no page faults each
  call); a weight version's largest arrays are mapped, so a freed version leaves no fragments."""
  if not sys.platform.startswith("linux"):
    return
  clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
  done = subprocess.run([sys.executable, "-c", MAPPED_CODE], env=clean, capture_output=True, text=True, timeout=60)
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout) == {"decode_buffer": False, "embedding": True, "top_kept": True}
