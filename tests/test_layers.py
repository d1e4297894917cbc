"""The package's import drawing: no circle between modules, and no import that runs back up a floor."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "streamrl_jax"
# Floors, lowest first: a module may import from its own floor or below, never above.
FLOORS = (
    ("types", "messages", "message_codec", "pytrees", "registry", "settings", "meshes", "modes", "run_shape",
     "resources", "stopping", "faults", "launch",
     "host_memory", "config_types", "config_listing", "phase_clock", "logs", "counters",
     "truncation", "trl_names"),  # plain records and helpers
    ("models", "tasks", "envs", "rewards"),  # the decoder, tokenizers, prompt datasets, environments, reward functions
    ("training", "streaming", "scheduling", "sampling", "serving", "agents", "sim", "distributed", "gke",
     "records", "job", "workflow"),  # the parts (agent programs beside the server they speak to), what a run leaves in
    # its workdir, the job around the RL steps (warm-up, held-out evaluation), the step's graph of stages
    ("pipeline", "arms", "planning"),  # workers, controller, sessions, programs, the training job; algorithm arms;
    # a run planned for a topology (its parts built as the run builds them, compiled without values)
    ("gin_config", "arm_files"),  # the config layer binds every part's config and reads arm files
    ("commands", "cli"),  # the `streamrl` command
)


def _modules() -> dict[str, Path]:
  out = {}
  for path in PACKAGE.rglob("*.py"):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return out


def import_graph() -> dict[str, set[str]]:
  """Module -> the package's modules it imports (at module level or inside functions)."""
  modules = _modules()

  def resolve(name: str) -> str:
    while name and name not in modules:
      name = name.rpartition(".")[0]
    return name
  graph = {}
  for name, path in modules.items():
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("streamrl_jax"):
        targets |= {resolve(f"{node.module}.{alias.name}") for alias in node.names}
      elif isinstance(node, ast.Import):
        targets |= {resolve(alias.name) for alias in node.names if alias.name.startswith("streamrl_jax")}
    graph[name] = targets - {name, "streamrl_jax"}
  return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one node (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for nxt in sorted(graph.get(node, ())):
      if nxt not in index:
        visit(nxt)
        low[node] = min(low[node], low[nxt])
      elif nxt in on_stack:
        low[node] = min(low[node], index[nxt])
    if low[node] == index[node]:
      component = []
      while True:
        top = stack.pop()
        on_stack.discard(top)
        component.append(top)
        if top == node:
          break
      if len(component) > 1:
        found.append(sorted(component))
  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def floor_of(module: str) -> int:
  top = module.split(".")[1]
  return next(i for i, names in enumerate(FLOORS) if top in names)


def test_circles_are_found_by_hand():
  assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_in_a_circle():
  assert circles(import_graph()) == []


def test_every_module_has_a_floor_and_no_import_runs_back_up():
  graph = import_graph()
  upward = [(a, b) for a, targets in sorted(graph.items()) if a != "streamrl_jax" for b in sorted(targets)
            if floor_of(b) > floor_of(a)]
  assert upward == []


def test_no_package_loads_its_names_lazily():
  """A package `__getattr__` (names loaded on first use) hides an import circle from the drawing above."""
  lazy = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("__init__.py")
          if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(p.read_text()).body)]
  assert not lazy


# The command line loads a command's parts when it runs: `streamrl --help` stays light, and a command sets the host
# device count before jax is imported. Everywhere else imports sit at the module's top, in the drawing above.
LAZY_IMPORTS_ALLOWED = ("cli.py", "commands/", "__init__.py")  # (the last: the package's own, `streamrl_jax.train`)


def imports_in_functions(source: str, package: str) -> list[str]:
  """`function: module` for each import of another of the package's top-level parts inside a function."""
  out = []
  for fn in ast.walk(ast.parse(source)):
    if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
      for node in ast.walk(fn):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
            [a.name for a in node.names] if isinstance(node, ast.Import) else []
        out += [f"{fn.name}: {name}" for name in names
                if name.startswith("streamrl_jax.") and name.split(".")[1] != package]
  return out


def test_no_function_imports_another_part():
  assert imports_in_functions("def f():\n  from streamrl_jax.models import x\n  from streamrl_jax.sim.y import z\n"
                              "  import numpy\n", "sim") == ["f: streamrl_jax.models"]
  found = {}
  for path in sorted(PACKAGE.rglob("*.py")):
    module = path.relative_to(PACKAGE).as_posix()
    if not module.startswith(LAZY_IMPORTS_ALLOWED):
      if lazy := imports_in_functions(path.read_text(), module.split("/")[0].removesuffix(".py")):
        found[module] = lazy
  assert found == {}


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
  """Every module `start` imports, directly or through others."""
  seen, todo = set(), [start]
  while todo:
    for nxt in graph.get(todo.pop(), ()):
      if nxt not in seen:
        seen.add(nxt)
        todo.append(nxt)
  return seen


def test_arms_stand_on_the_trainer_worker_and_nothing_below_it_knows_arms():
  """The arms' parts (all but their program, which builds a run) reach into `pipeline/` only for the trainer
  worker and its control protocol; nothing those import comes back to `arms/`, so the two packages meet one way."""
  assert reachable({"a": {"b"}, "b": {"c"}, "c": set()}, "a") == {"b", "c"}
  graph = import_graph()
  arms = {m for m in graph if m.startswith("streamrl_jax.arms")}
  used = {t for m in arms - {"streamrl_jax.arms.program"} for t in graph[m] if t.startswith("streamrl_jax.pipeline")}
  assert used <= {"streamrl_jax.pipeline.trainer.worker", "streamrl_jax.pipeline.trainer.control"}, used
  below = set().union(*(reachable(graph, m) | {m} for m in used))
  assert not below & arms, sorted(below & arms)
