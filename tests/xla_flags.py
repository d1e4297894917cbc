"""The XLA flags of the test processes and of every program a test starts. LLVM's cheapest code generation: the
suite's models are tiny, so compiling, not running, is most of its time (tests/test_sampler.py on 2 cores: 111-125 s
of CPU at the default level, 78-92 s with these; the same programs, the same results). Programs that decode a real
model run longer than they compile and keep the default (`DEFAULT`)."""

COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
DEFAULT = ""


def xla_flags(devices: int | None = None, compile_flags: str = COMPILE_FLAGS) -> str:
  """XLA_FLAGS for a test's process: `compile_flags` and, given `devices`, that many forced host devices (without,
  a program forces its own)."""
  forced = f" --xla_force_host_platform_device_count={devices}" if devices else ""
  return (compile_flags + forced).strip()
