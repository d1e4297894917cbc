"""The XLA flags of the test processes and of every program a test starts: LLVM's cheapest code generation and XLA:CPU's
older fusion emitters, which compile faster. The suite's models are tiny, so compiling, not running, is most of its
time. tests/test_sampler.py, one run after the other on 2 cores ("Intel(R) Xeon(R) Processor", AMX): 111 and 125 s of
CPU with no flag; 84 and 92 s with the optimization level alone; 78 and 90 s with the LLVM pair; 57 s with all three.
The programs are the same; their machine code is made differently. A SmolLM2-135M step of the shipped tests is no
slower (98 s with no flag, 97 s with all three)."""

COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                 "--xla_cpu_use_fusion_emitters=false")
# For a test that reads what XLA made of a program (its optimized HLO, its cost): `.compile(USERS_COMPILER)` runs the
# HLO passes a user's program gets (the fusion emitters change them; the other two flags are LLVM's alone).
USERS_COMPILER = {"xla_cpu_use_fusion_emitters": True}


def xla_flags(devices: int | None = None) -> str:
  """XLA_FLAGS for a test's process: `COMPILE_FLAGS` and, given `devices`, that many forced host devices (without,
  a program forces its own)."""
  forced = f" --xla_force_host_platform_device_count={devices}" if devices else ""
  return COMPILE_FLAGS + forced
