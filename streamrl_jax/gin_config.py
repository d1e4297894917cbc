"""gin bindings for the typed config dataclasses: parse files and `--set` overrides, then build.

Only this module knows gin; the dataclasses stay plain. A gin file writes e.g.
`MeshConfig.sampler_devices = 4`.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import logging
import re
import sys
import tokenize
import typing
from pathlib import Path

import gin

from streamrl_jax.arm_files import arms_from_configs
from streamrl_jax.arms.config import ArmsConfig
from streamrl_jax.config_listing import render
from streamrl_jax.config_types import ConfigError, checked, literal_value
from streamrl_jax.envs.config import EnvConfig
from streamrl_jax.gke.launch_config import GKEConfig, GKEPortsConfig, GKESamplersConfig, GKETrainerConfig
from streamrl_jax.meshes import MeshConfig
from streamrl_jax.models.hub import parse_hub_id, pinned
from streamrl_jax.models.lora import LoraConfig
from streamrl_jax.pipeline.config import DERIVED_KEYS, PipelineConfig
from streamrl_jax.pipeline.controller.config import ControllerConfig
from streamrl_jax.job.config import DemoModelConfig, JobConfig
from streamrl_jax.rewards.config import RewardConfig
from streamrl_jax.sampling.config import EngineConfig, SamplerConfig
from streamrl_jax.scheduling import RankerConfig, SchedulingConfig
from streamrl_jax.settings import MOVED_KEYS
from streamrl_jax.streaming.flight_config import FlightConfig
from streamrl_jax.tasks.config import TaskConfig
from streamrl_jax.training import ObjectiveConfig, OptimizerConfig, TrainerConfig
from streamrl_jax.training.config import WaitConfig
from streamrl_jax.training.corrections import CorrectionConfig
from streamrl_jax.training.objectives import ValueLossConfig
from streamrl_jax.trl_names import trl_hint
from streamrl_jax.workflow.config import WorkflowConfig

log = logging.getLogger(__name__)
CONFIG_DIRS = (Path(__file__).resolve().parent.parent / "configs",  # a checkout (pip install -e .)
               Path(sys.prefix) / "share" / "streamrl_jax" / "configs")  # an install (pyproject data-files)
DEMO_CONFIG = next((d / "demo_cpu.gin" for d in CONFIG_DIRS if (d / "demo_cpu.gin").is_file()),
                   CONFIG_DIRS[0] / "demo_cpu.gin")
def example_dir(name: str) -> Path:
  """`examples/NAME` of a checkout, or of an install (pyproject data-files); an error names both places."""
  for root in (Path(__file__).resolve().parent.parent, Path(sys.prefix) / "share" / "streamrl_jax"):
    if (root / "examples" / name).is_dir():
      return root / "examples" / name
  raise FileNotFoundError(f"example {name!r} is in neither {CONFIG_DIRS[0].parent / 'examples'} nor "
                          f"{Path(sys.prefix) / 'share' / 'streamrl_jax' / 'examples'}")


CONFIG_CLASSES = (MeshConfig, EngineConfig, RewardConfig, EnvConfig, SamplerConfig, OptimizerConfig, ObjectiveConfig,
                  CorrectionConfig, LoraConfig, ValueLossConfig, WaitConfig, TrainerConfig, RankerConfig,
                  SchedulingConfig, ControllerConfig, ArmsConfig, WorkflowConfig,
                  PipelineConfig, DemoModelConfig, JobConfig, TaskConfig, FlightConfig, GKETrainerConfig, GKESamplersConfig,
                  GKEPortsConfig, GKEConfig)
for _cls in CONFIG_CLASSES:
  gin.external_configurable(_cls, name=_cls.__name__)
_CLASSES = {cls.__name__: cls for cls in CONFIG_CLASSES}
KNOWN_KEYS = tuple(f"{cls.__name__}.{f.name}" for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)
                   if not dataclasses.is_dataclass(f.default) and "bound_by" not in f.metadata)

# Classes that are not bound, and where their values come from.
NOT_BOUND = {"ModelConfig": "a model's shape comes from its config.json (JobConfig.model); the demo model's from "
                            "DemoModelConfig.hidden_size and DemoModelConfig.num_layers",
             "RopeScaling": "a model's RoPE scaling comes from its config.json (JobConfig.model)"}
_KEY = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\s*=", re.MULTILINE)
_BARE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=", re.MULTILINE)  # `name = value`: a gin macro
_MACRO_USE = re.compile(r"%([A-Za-z_][A-Za-z0-9_]*)")
_INCLUDE = re.compile(r"^\s*include\s+['\"]([^'\"]+)['\"]", re.MULTILINE)


def check_keys(config_files=(), bindings=()) -> None:
  """Refuses, naming where it was written, a binding of an unknown class or key (with the key likely meant: TRL's
  names are understood), of no class at all, of a key that moved or is derived, or of a nested config (bound
  through its own class's keys)."""
  sources = [(f"--set {b!r}", b) for b in bindings] + [(str(f), Path(f).read_text()) for f in config_files]
  included = [Path(f).read_text() for path in config_files for f in _includes(Path(path))]
  used_macros = {m for text in [*(t for _, t in sources), *included] for m in _MACRO_USE.findall(text)}
  for where, text in sources:
    for name in _BARE.findall(text):
      if name not in used_macros:  # gin reads `name = v` as a macro: unused, it binds nothing
        raise ConfigError(f"{name}: a binding names its config class, Class.key=value{_hint('', name)} ({where})")
    for name, field in _KEY.findall(text):
      _check_key(name, field, where)


def _includes(path: Path, seen: frozenset = frozenset()) -> list[Path]:
  """The files `path` includes (`include 'x.gin'`, found beside it), and theirs."""
  out = []
  for name in _INCLUDE.findall(path.read_text()):
    found = path.parent / name
    if found.is_file() and found not in seen:
      out += [found, *_includes(found, seen | {found})]
  return out


def _check_key(name: str, field: str, where: str) -> None:
  key = f"{name}.{field}"
  if key in MOVED_KEYS:
    raise ConfigError(f"{key} moved: set {MOVED_KEYS[key]} instead ({where})")
  if key in DERIVED_KEYS:
    raise ConfigError(f"{key} is set from {DERIVED_KEYS[key]}: bind that one alone ({where})")
  if name in NOT_BOUND:
    raise ConfigError(f"{key}: {name} is not a config to bind; {NOT_BOUND[name]} ({where})")
  if name not in _CLASSES:
    raise ConfigError(f"{key}: unknown config class {name!r}{_hint(name, field)} ({where})")
  fields = {f.name: f for f in dataclasses.fields(_CLASSES[name])}
  if field not in fields:
    raise ConfigError(f"{key}: {name} has no field {field!r}{_hint(name, field)} ({where}); "
                      f"`streamrl config` lists every key")
  if "bound_by" in fields[field].metadata:
    raise ConfigError(f"{key} is not a gin key: it is set by {fields[field].metadata['bound_by']} ({where})")
  if dataclasses.is_dataclass(fields[field].default):
    raise ConfigError(f"{key} is built from the {type(fields[field].default).__name__}.* keys: bind those "
                      f"({where})")


def _hint(name: str, field: str) -> str:
  """"; did you mean X?" for the key likely meant: a key of another class with this field, else what TRL's (or
  vLLM's, verl's) name is here, else the closest key (or, the field unlike any, the closest class)."""
  same_field = sorted((k for k in KNOWN_KEYS if k.endswith(f".{field}")),
                      key=lambda k: -difflib.SequenceMatcher(None, name, k.split(".")[0]).ratio())
  if same_field:
    return f"; did you mean {' or '.join(same_field[:3])}?"
  trl = trl_hint(field)
  if trl is not None:
    return f"; {trl}"
  close = difflib.get_close_matches(f"{name}.{field}" if name else field,
                                    list(KNOWN_KEYS) if name else [k.split(".")[1] for k in KNOWN_KEYS], n=1,
                                    cutoff=0.6)
  if close and not name:
    close = [k for k in KNOWN_KEYS if k.endswith(f".{close[0]}")]
  if not close and name and name not in _CLASSES:
    close = [c for c in difflib.get_close_matches(name, list(_CLASSES), n=1, cutoff=0.6)]
  return f"; did you mean {close[0]}?" if close else ""


class _MissingPathFilter(logging.Filter):
  """Drops gin's "Path not found" records: an include missing from every search path is still an error (raised)."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Path not found")


def parse(config_files=(), bindings=(), late_files=()) -> None:
  """Parses gin files and binding strings, then `late_files` (an arm's file, over the run's `--set`s); a mistake is
  raised as `ConfigError` in one line naming the file or binding (and the line of it that gin could not read)."""
  missing = [str(f) for f in [*config_files, *late_files] if not Path(f).is_file()]
  if missing:
    hint = difflib.get_close_matches(missing[0], _shipped_configs(), n=1, cutoff=0.5)
    hint = [str(Path(h).relative_to("configs").with_suffix("")) for h in hint]  # the short form: found anywhere
    raise ConfigError(f"{'--arms' if missing[0] in map(str, late_files) else '--config'} {missing[0]}: no such file"
                      + (f"; did you mean {hint[0]} (a shipped config)?" if hint else ""))
  bindings = [_quoted_bare_word(b) for b in bindings]
  check_keys([*config_files, *late_files], bindings)
  gin.clear_config()
  quiet = _MissingPathFilter()  # gin logs an error for each search path an `include` is not in, found or not
  logging.getLogger().addFilter(quiet)
  try:
    for path in config_files:
      text = Path(path).read_text()
      gin.add_config_file_search_path(str(Path(path).resolve().parent))  # `include 'x.gin'` beside the file
      _gin_parse(lambda: gin.parse_config_file(str(path)), str(path), text)
  finally:
    logging.getLogger().removeFilter(quiet)
  for binding in bindings:
    _gin_parse(lambda: gin.parse_config(binding), f"--set {binding!r}", binding)
  for path in late_files:
    _gin_parse(lambda: gin.parse_config_file(str(path)), str(path), Path(path).read_text())
  _gin_parse(gin.finalize, "the configuration", "")


_BARE_WORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\w[\w.:/+@-]*)\s*")


def _quoted_bare_word(binding: str) -> str:
  """`--set Class.key=word` as the shell leaves `--set Class.key='word'`: the string 'word' where the key is a `str`
  field; elsewhere a `ConfigError` naming the type the key takes and its default as an example."""
  match = _BARE_WORD.fullmatch(binding)
  if match is None or _is_literal(match[3]) or match[1] not in _CLASSES:
    return binding
  name, field, word = match.groups()
  hints = typing.get_type_hints(_CLASSES[name])
  if field not in hints:
    return binding  # an unknown key: check_keys names it
  if hints[field] is str or str in typing.get_args(hints[field]):
    return f"{name}.{field}={word!r}"
  default = next(f.default for f in dataclasses.fields(_CLASSES[name]) if f.name == field)
  example = ("True or False" if hints[field] is bool else f"e.g. --set {name}.{field}={default!r}"
             if default is not dataclasses.MISSING else "")
  raise ConfigError(f"--set {binding!r}: {word} is not a value of {name}.{field}, which takes "
                    f"{_type_name(hints[field])}" + (f" ({example})" if example else ""))


def _is_literal(text: str) -> bool:
  return literal_value(text)[0]


def _type_name(hint) -> str:
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _gin_parse(call, where: str, text: str) -> None:
  """Runs a gin parse; its error as one line naming `where` (and the line of a text of several)."""
  many = "\n" in text.strip() or not where.startswith("--set")
  try:
    call()
  except (tokenize.TokenError, SyntaxError) as err:
    unclosed = _unclosed(text)
    if unclosed is not None or isinstance(err, tokenize.TokenError):
      line = f" (line {unclosed + 1}: {text.splitlines()[unclosed].strip()!r})" if many and unclosed is not None else ""
      raise ConfigError(f"{where}: a bracket or quote is not closed{line}") from None
    line = f" (line {err.lineno}: {text.splitlines()[err.lineno - 1].strip()!r})" if many and err.lineno else ""
    raise ConfigError(f"{where}: {err.msg.splitlines()[0].rstrip('.')}{line}") from None
  except (ValueError, KeyError, IOError) as err:
    raise ConfigError(f"{where}: {str(err).splitlines()[0]}") from None


def _unclosed(text: str) -> int | None:
  """The index of the first line whose binding leaves a bracket or quote open (up to the next binding)."""
  lines = text.splitlines()
  starts = [i for i, line in enumerate(lines) if _KEY.match(line)] + [len(lines)]
  for begin, end in zip(starts, starts[1:]):
    try:
      list(tokenize.generate_tokens(io.StringIO("\n".join(lines[begin:end]) + "\n").readline))
    except tokenize.TokenError:
      return begin
  return None


def build(cls, **defaults):
  """An instance of a config dataclass from its gin bindings (over `defaults`), each value checked against its
  field's annotation (`config_types`)."""
  if cls not in CONFIG_CLASSES:
    raise TypeError(f"{cls.__name__} is not a gin-bindable config; known: {[c.__name__ for c in CONFIG_CLASSES]}")
  bound = {name: checked(cls, name, value) for name, value in gin.get_bindings(cls.__name__).items()}
  return cls(**{**defaults, **bound})


def run_files(config_files) -> list[str]:
  """The gin files of a run: those given, else the CPU demo's (`configs/demo_cpu.gin`, the one place its
  values are written)."""
  if config_files:
    return [_found(str(f)) for f in config_files]
  if not DEMO_CONFIG.is_file():
    raise FileNotFoundError(f"no --config given, and the CPU demo's demo_cpu.gin is in none of "
                            f"{[str(d) for d in CONFIG_DIRS]}; pass --config FILE")
  return [str(DEMO_CONFIG)]


def _found(name: str) -> str:
  """A config file as typed, else with `.gin` added, else in the shipped configs/ (`smollm2_cpu`, or
  `configs/smollm2_cpu.gin` from outside the checkout: logged with its short form); unfound, as typed (`parse`
  refuses it, with the closest shipped file)."""
  for candidate in (name, f"{name}.gin"):
    if Path(candidate).is_file():
      return candidate
  inside = Path(name).parts[1:] if Path(name).parts[:1] == ("configs",) else Path(name).parts
  for root in CONFIG_DIRS:
    for candidate in (root.joinpath(*inside), root.joinpath(*inside).with_name(Path(name).name + ".gin")):
      if inside and candidate.is_file():
        short = str(candidate.relative_to(root).with_suffix(""))
        if short != name:
          log.info("--config %s: not found from %s; using the shipped %s (short form: --config %s)", name,
                   Path.cwd(), candidate, short)
        return str(candidate)
  return name


def _shipped_configs() -> list[str]:
  return sorted({str(p.relative_to(d.parent)) for d in CONFIG_DIRS if d.is_dir() for p in d.rglob("*.gin")})


def pinned_hub_model(config_files, bindings) -> list[str]:
  """`bindings` with `JobConfig.model` pinned to its commit where it is a Hub id (`hub.pinned`, fetched once into
  the cache): processes started from them read one snapshot, however the Hub's branch moves while they start."""
  parse(run_files(config_files), bindings)
  model = build_job().model
  if not parse_hub_id(model) or Path(model).exists():
    return list(bindings)
  return [*bindings, f"JobConfig.model={pinned(model)!r}"]


def build_run() -> tuple[PipelineConfig, JobConfig]:
  """The pipeline config with its nested parts, each from its own bindings, and the job config."""
  sampler = build(SamplerConfig, engine=build(EngineConfig), reward=build(RewardConfig), env=build(EnvConfig))
  trainer = build(TrainerConfig, optimizer=build(OptimizerConfig),
                  objective=build(ObjectiveConfig, bands=build(CorrectionConfig)),
                  lora=build(LoraConfig), wait=build(WaitConfig))
  parts = dict(mesh=build(MeshConfig), sampler=sampler, trainer=trainer,
               scheduling=build(SchedulingConfig, ranker=build(RankerConfig)), controller=build(ControllerConfig),
               arms=build(ArmsConfig), workflow=build(WorkflowConfig, value_loss=build(ValueLossConfig)))
  return build(PipelineConfig, **parts), build_job()


def build_job() -> JobConfig:
  """The job config with its task's and its demo decoder's, each from its own bindings."""
  return build(JobConfig, task=build(TaskConfig), demo=build(DemoModelConfig))


def with_arms(config: PipelineConfig, job: JobConfig, arm_files, config_files, bindings) -> PipelineConfig:
  """`config` (the lead) with a follower arm per file of `arm_files` (`--arms`), each parsed over the run's files
  and bindings and named by its file's stem (`arm_files.arms_from_configs` checks what they change). The
  run's own bindings are parsed again at the end."""
  if not arm_files:
    return config
  parsed = []
  try:
    for path in map(_found, map(str, arm_files)):
      parse(config_files, bindings, late_files=[path])
      parsed.append((Path(path).stem, *build_run()))
  finally:
    parse(config_files, bindings)
  followers = arms_from_configs(config, job, parsed, JobConfig.model_spec)
  return dataclasses.replace(config, arms=dataclasses.replace(config.arms, followers=followers))


def build_flight() -> FlightConfig:
  """How trainer and samplers reach each other across processes (`FlightConfig` bindings)."""
  return build(FlightConfig)


GKE_PARTS = {"trainer": GKETrainerConfig, "samplers": GKESamplersConfig, "ports": GKEPortsConfig}


def build_gke() -> GKEConfig:
  """Where a run goes on GKE (`GKEConfig` bindings and its parts'; `streamrl launch gke`)."""
  return build(GKEConfig, **{name: build(cls) for name, cls in GKE_PARTS.items()})


def resolved_text(header: str = "") -> str:
  """The parsed configuration as gin text, every key on its own line with its type and help (`config_listing`):
  the run's configs, how programs connect (`FlightConfig`) and where a run goes on GKE (`GKEConfig`)."""
  configs = [*build_run(), build_flight()]
  try:
    configs.append(build_gke())
  except ValueError as err:  # a GKE launch needs more (its image, its bucket): the listing says what
    note = f"`streamrl launch gke` would refuse these: {err}"
    configs += [_unbuilt(GKEConfig, note), *(_unbuilt(cls, "") for cls in GKE_PARTS.values())]
  return render(configs, DERIVED_KEYS, header)


def _unbuilt(cls, note: str) -> tuple[type, dict, str]:
  """(class, its plain fields' defaults under its bindings, note) of a config that does not build (or whose
  holder does not)."""
  defaults = {f.name: f.default for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(f.default)}
  bound = {name: checked(cls, name, value) for name, value in gin.get_bindings(cls.__name__).items()}
  return cls, {**defaults, **bound}, note
