"""A plan's model by its shapes alone (no weight is read): a config.json file, a model directory, a catalog name, a
GGUF file, or a Hub id (its config.json from the Hugging Face cache, fetched if the Hub can be reached, else the
shapes this package ships for the models its plans are documented with: `planning/shapes/`)."""

from __future__ import annotations

import json
from pathlib import Path

from streamrl_jax.models import ModelConfig
from streamrl_jax.models.catalog import CATALOG, resolve_model
from streamrl_jax.models.families import config_from_hf
from streamrl_jax.models.hub import HubError, hub_config, parse_hub_id

SHIPPED = Path(__file__).parent / "shapes"


def shipped() -> dict[str, Path]:
  """Hub id -> the config.json this package ships for it (`org--name.json`)."""
  return {path.stem.replace("--", "/", 1): path for path in sorted(SHIPPED.glob("*.json"))}


def config_file(spec: str) -> tuple[Path, str]:
  """(the config.json of the model `spec`, where it came from)."""
  path = Path(spec).expanduser()
  if path.is_file() and path.suffix == ".json":
    return path, "file"
  if (path / "config.json").is_file():
    return path / "config.json", "directory"
  if spec in CATALOG or path.suffix == ".gguf":
    return resolve_model(spec) / "config.json", "catalog" if spec in CATALOG else "gguf"
  if parse_hub_id(spec) and not path.exists():
    repo = parse_hub_id(spec)[0]
    try:
      return hub_config(spec), "hub"
    except HubError as err:
      if repo in shipped():
        return shipped()[repo], "shipped"
      raise HubError(f"{err}; shapes shipped for: {sorted(shipped())}") from err
  raise ValueError(f"--model {spec!r}: neither a config.json, a model directory, a catalog name ({sorted(CATALOG)}), "
                   "a .gguf file nor a Hugging Face Hub id (org/name)")


def model_shapes(spec: str, compute_dtype: str, param_dtype: str = "float32") -> tuple[ModelConfig, str]:
  """(the model's config computing in `compute_dtype` with weights in `param_dtype`, where its config came from)."""
  path, source = config_file(spec)
  try:
    hf = json.loads(path.read_text())
  except (OSError, ValueError) as err:
    raise ValueError(f"--model {spec!r}: {path} is not a readable config.json ({err})") from err
  return config_from_hf(hf, dtype=compute_dtype, param_dtype=param_dtype), source
