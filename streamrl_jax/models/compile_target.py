"""The backend a program is traced for. It is jax's default backend, except while `compiling_for` names another: a
plan (`streamrl plan`) traces the trainer's and the sampler's programs on a CPU-only machine for a TPU topology, and
every choice the model code makes by backend (XLA:CPU's low-precision products, the KV cache's dtype, the grouped
experts' method, the attention kernels) must then be the TPU's, not the CPU's."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax

_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("compile_target", default=None)


def target_backend() -> str:
  """The platform being traced for: 'cpu', 'gpu', 'tpu' (`compiling_for`'s, else jax's default backend)."""
  return _target.get() or jax.default_backend()


@contextlib.contextmanager
def compiling_for(platform: str) -> Iterator[None]:
  """While inside, code traced on this thread takes `platform`'s choices (a TPU topology's programs compiled here)."""
  token = _target.set(platform)
  try:
    yield
  finally:
    _target.reset(token)
