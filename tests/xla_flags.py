"""The XLA flags of the test processes and of every program a test starts. LLVM's cheapest code generation: the
suite's models are tiny, so compiling, not running, is most of its time: tests/test_sampler.py took 111 and 125 s of
CPU at the default level, 78 s with these flags and 84 and 92 s with the first alone (2 cores, one run after the
other). The programs are the same; only their machine code is less optimized. A SmolLM2-135M run of the shipped tests
is no slower (one step: 98 s at the default level, 91 s with these)."""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's process: `COMPILE_FLAGS` and, given `devices`, that many forced host devices (without,
  a program forces its own)."""
  forced = f" --xla_force_host_platform_device_count={devices}" if devices else ""
  return COMPILE_FLAGS + forced
