"""Models by Hugging Face Hub id: `org/name` or `org/name@revision` (a branch, tag or commit); prompt files by
`hf://datasets/org/name[@revision]/path` (`hub_dataset`).

Only the files this decoder reads (config, tokenizer, generation config, safetensors and their index) are fetched,
through huggingface_hub into its standard cache, the one transformers and vLLM share: `HF_HUB_CACHE`, else
`HF_HOME/hub`, read when a model is resolved. `HF_HUB_OFFLINE=1` reads the cache alone and opens no connection;
without it, the Hub's endpoint (`HF_ENDPOINT`) is probed first (a TCP connection within `PROBE_TIMEOUT` seconds,
again after `PROBE_AGAIN_S` when it failed; no probe behind a proxy), and where it cannot be reached the cache is
read alone, or the model refused at once in one line rather than after huggingface_hub's retries (about 25 s).
`HF_TOKEN` reaches gated and private models.
config.json comes first, so a model of an architecture this decoder does not implement is refused before its weights
are downloaded. `streamrl launch local` pins a Hub id to its commit (`pinned`) before it starts the trainer and
samplers, so all of them read one snapshot.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

_log = logging.getLogger(__name__)

DATASET_URL = re.compile(r"hf://datasets/(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w.-]+))?/(?P<path>.+)")
HUB_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "*.safetensors", "model.safetensors.index.json")
COMMIT = re.compile(r"[0-9a-f]{40}")
_TRUE = ("1", "ON", "YES", "TRUE")
OFFLINE = "HF_HUB_OFFLINE is set"
PROBE_TIMEOUT = 5.0  # seconds for the name lookup and TCP connection to the Hub's endpoint, together
PROBE_AGAIN_S = 60.0  # an endpoint found unreachable is probed again after this long (a blip does not last)
_PROXIES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_probed: dict[str, tuple[str | None, float]] = {}  # endpoint -> (why it cannot be reached (None: it can), when)


class HubError(OSError):
  """A Hub model could not be had; the message names it and says what to do."""


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
  """(repository, revision or None) when `spec` is written as a Hub id, else None."""
  match = HUB_ID.fullmatch(spec)
  return (match["repo"], match["revision"]) if match else None


def hub_cache() -> Path:
  """The Hub cache the environment names now: `HF_HUB_CACHE`, else `HF_HOME/hub`, else huggingface_hub's default."""
  from huggingface_hub import constants

  if os.environ.get("HF_HUB_CACHE"):
    return Path(os.environ["HF_HUB_CACHE"]).expanduser()
  if os.environ.get("HF_HOME"):
    return Path(os.environ["HF_HOME"]).expanduser() / "hub"
  return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
  """Whether `HF_HUB_OFFLINE` is set now (huggingface_hub reads it once, at import)."""
  from huggingface_hub import constants

  return os.environ.get("HF_HUB_OFFLINE", "").upper() in _TRUE or bool(constants.HF_HUB_OFFLINE)


def endpoint() -> str:
  """The Hub's endpoint the environment names now: `HF_ENDPOINT`, else huggingface_hub's."""
  from huggingface_hub import constants

  return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def unreachable(url: str) -> str | None:
  """Why the Hub endpoint `url` cannot be reached, in words (None: it can, or a proxy decides); a reachable endpoint
  is probed once per process, an unreachable one again after `PROBE_AGAIN_S`."""
  if any(os.environ.get(name) for name in _PROXIES):
    return None  # httpx connects through the proxy, which alone knows whether the Hub is reachable: no probe here
  if url not in _probed or (_probed[url][0] is not None and time.monotonic() - _probed[url][1] > PROBE_AGAIN_S):
    _probed[url] = (_probe(url), time.monotonic())
  return _probed[url][0]


def _probe(url: str, timeout: float = PROBE_TIMEOUT) -> str | None:
  """Why no TCP connection to `url`'s host opens within `timeout` seconds, name lookup included (None: one does)."""
  parts = urlsplit(url)
  host, port = parts.hostname or "", parts.port or (80 if parts.scheme == "http" else 443)
  said: list[str | None] = []

  def connect() -> None:
    try:
      socket.create_connection((host, port), timeout=timeout).close()
      said.append(None)
    except OSError as err:
      said.append(f"no connection to {host}:{port}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
  thread = threading.Thread(target=connect, name="hub-probe", daemon=True)  # a thread: name lookups take no timeout
  thread.start()
  thread.join(timeout)
  return said[0] if said else f"no connection to {host}:{port} within {timeout:g} s"


def _cache_alone() -> tuple[str | None, str]:
  """(why the cache is read alone: `OFFLINE`, the endpoint unreachable, or None to use the network; the endpoint)."""
  url = endpoint()
  if offline():
    return OFFLINE, url
  why = unreachable(url)
  return (f"the Hugging Face Hub at {url} cannot be reached ({why})" if why else None), url


def hub_model(spec: str) -> Path:
  """The snapshot directory of the Hub model `spec` (`org/name[@revision]`), fetched into the cache if needed."""
  from streamrl_jax.models.families import config_from_hf

  repo, revision = parse_hub_id(spec)
  cache, (local, url) = hub_cache(), _cache_alone()
  try:
    config = _download(repo, revision, cache, bool(local), "config.json", url)
    config_from_hf(json.loads(Path(config).read_text()))  # an unsupported architecture: before the weights
    if not local:
      _log.info(f"fetching {spec} from the Hugging Face Hub into {cache} (config, tokenizer and safetensors only) ...")
    path = Path(_snapshot(repo, revision, cache, bool(local), url))
  except ValueError:  # the architecture's own message
    raise
  except Exception as err:
    why = _why(err, repo, revision, cache, local)
    if why is None:
      raise
    raise HubError(f"model {spec!r} {why}") from err
  if not any(path.glob("*.safetensors")) and local:
    raise HubError(f"model {spec!r} has no safetensors weights in its cached snapshot {path} and {local}: fetch them "
                   f"with the network (`hf download {repo}`)")
  if not any(path.glob("*.safetensors")):
    raise HubError(f"model {spec!r} has no safetensors weights in its Hub snapshot {path} (this decoder reads no "
                   "PyTorch .bin files): pick a revision that has them, or convert it with transformers' "
                   "save_pretrained(safe_serialization=True) and pass the directory")
  if local and local != OFFLINE:
    _log.warning(f"{local}: model {spec!r} read from its cached snapshot {path}")
  return path


def hub_config(spec: str) -> Path:
  """The config.json of the Hub model `spec` alone (no weights), from the cache or fetched into it: what a plan reads
  (`streamrl plan`). Raises `HubError` naming why it could not be had."""
  repo, revision = parse_hub_id(spec)
  cache, (local, url) = hub_cache(), _cache_alone()
  try:
    return Path(_download(repo, revision, cache, bool(local), "config.json", url))
  except Exception as err:
    why = _why(err, repo, revision, cache, local)
    if why is None:
      raise
    raise HubError(f"model {spec!r} {why}") from err


def pinned(spec: str) -> str:
  """The Hub model `spec` as `org/name@<commit>`: its revision (default: main) resolved to the commit the cache or
  the Hub has now, fetched if needed, so that processes started apart read one snapshot."""
  repo, revision = parse_hub_id(spec)
  if revision is not None and COMMIT.fullmatch(revision):
    return spec
  return f"{repo}@{hub_model(spec).name}"


def prompt_source(spec: str) -> str:
  """A prompt file as `PromptFile` reads it: `spec` itself, or a Hub dataset's file fetched into the cache."""
  return str(hub_dataset(spec)) if spec.startswith("hf://") else spec


def hub_dataset(url: str) -> Path:
  """The local copy of a Hub dataset's file or folder of Parquet shards, `hf://datasets/org/name[@revision]/path`
  (a `.parquet` or `.jsonl` file, else a folder whose `*.parquet` shards are fetched), read from or fetched into the
  Hub cache as models are."""
  match = DATASET_URL.fullmatch(url)
  if match is None:
    raise ValueError(f"prompt file {url!r}: a Hub dataset is hf://datasets/org/name/path or "
                     "hf://datasets/org/name@revision/path")
  repo, revision, inside = match["repo"], match["revision"], match["path"].strip("/")
  cache, (local, hub_url) = hub_cache(), _cache_alone()
  shards = not inside.endswith((".parquet", ".jsonl"))
  try:
    if not shards:
      path = Path(_download(repo, revision, cache, bool(local), inside, hub_url, "dataset"))
    else:
      if not local:
        _log.info(f"fetching the Parquet shards of {url} into {cache} ...")
      path = Path(_snapshot(repo, revision, cache, bool(local), hub_url, [f"{inside}/*.parquet"], "dataset")) / inside
  except Exception as err:
    why = _why(err, repo, revision, cache, local, "dataset")
    if why is None:
      raise
    raise HubError(f"dataset {url!r} {why}") from err
  if shards and not any(path.glob("*.parquet")):
    raise HubError(f"dataset {url!r}: no *.parquet shards under {inside!r} in its Hub snapshot")
  if local and local != OFFLINE:
    _log.warning(f"{local}: dataset {url!r} read from the Hugging Face cache {cache}")
  return path


# Past the probe, huggingface_hub (2.4 here) still retries a failed lookup of a file not in the cache 5 times
# (1 + 2 + 4 + 8 + 8 s; file_download.py `hf_hub_download`, "No local file found. Retrying..", then
# utils/_http.py `http_backoff`, max_retries=5) and exposes no argument or variable to lower that: left as it is,
# for a network that connects.
def _download(repo, revision, cache, local, filename, url=None, repo_type: str = "model") -> str:
  from huggingface_hub import hf_hub_download

  return hf_hub_download(repo, filename, revision=revision, cache_dir=cache, local_files_only=local,
                         repo_type=repo_type, endpoint=url)


def _snapshot(repo, revision, cache, local, url=None, patterns=MODEL_FILES, repo_type: str = "model") -> str:
  from huggingface_hub import snapshot_download

  return snapshot_download(repo, revision=revision, cache_dir=cache, local_files_only=local,
                           allow_patterns=list(patterns), repo_type=repo_type, endpoint=url)


def _why(err: Exception, repo: str, revision: str | None, cache: Path, local: str | None,
         kind: str = "model") -> str | None:
  """What huggingface_hub's `err` means for the model and what to do, in one line (None: not the Hub's); `local`:
  why the cache was read alone (None: it was not)."""
  from huggingface_hub import errors

  page = f"https://huggingface.co/{'datasets/' if kind == 'dataset' else ''}{repo}"
  download = f"hf download {repo}{' --repo-type dataset' if kind == 'dataset' else ''}"
  if isinstance(err, errors.GatedRepoError):
    return f"is gated on the Hugging Face Hub: accept its terms at {page}, then set HF_TOKEN (or `hf auth login`)"
  if isinstance(err, errors.RepositoryNotFoundError):
    return "is not on the Hugging Face Hub (check the id; a private model needs HF_TOKEN)"
  if isinstance(err, errors.RevisionNotFoundError):
    return f"has no revision {revision!r} on the Hub (a branch, tag or commit of {page})"
  absent = f"is not in the Hugging Face cache {cache}{f' at revision {revision!r}' if revision else ''}"
  if local == OFFLINE and isinstance(err, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
    return (f"{absent} and {OFFLINE}: run once with the network (or `{download}`), or point HF_HUB_CACHE at a cache "
            "that has it")
  if local and isinstance(err, (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled)):
    return (f"{absent} and {local}: check the network (a proxy: HTTPS_PROXY; a mirror: HF_ENDPOINT), or copy the "
            f"{kind} into {cache} and set HF_HUB_OFFLINE=1")
  if isinstance(err, (errors.LocalEntryNotFoundError, errors.HfHubHTTPError, OSError)):
    return (f"could not be fetched from the Hugging Face Hub ({type(err).__name__}: {str(err).splitlines()[0]}); "
            f"check the network, or copy the {kind} into {cache} and set HF_HUB_OFFLINE=1")
  return None
