"""The docs a newcomer reads: a short README, links that lead somewhere, and a layout that is the package's."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from pathlib import Path

from streamrl_jax.records import metric_table

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "launchers" / "README.md"]


def anchors(text: str) -> set[str]:
  """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as hyphens."""
  return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
          for h in re.findall(r"^#{1,6} (.*)$", text, re.M)}


def broken_links(page: Path) -> list[str]:
  """The page's relative links whose file is missing or whose anchor names no heading there (code blocks skipped)."""
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  out = []
  for target in re.findall(r"\]\(([^)\s]+)\)", text):
    if target.startswith(("http://", "https://", "mailto:")):
      continue
    path, _, anchor = target.partition("#")
    linked = (page.parent / path).resolve() if path else page
    if not linked.exists():
      out.append(f"{target} (no such file)")
    elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
      out.append(f"{target} (no such heading)")
  return out


def test_anchors_and_broken_links_by_hand(tmp_path):
  assert anchors("# A title\n## Weights in flight, partial rollouts\ntext\n") == {
      "a-title", "weights-in-flight-partial-rollouts"}
  (tmp_path / "other.md").write_text("# Other\n## Part two\n")
  page = tmp_path / "page.md"
  page.write_text("[a](other.md#part-two) [b](other.md#part-three) [c](gone.md) [d](#here) [e](https://x.org)\n"
                  "# Here\n```\n[f](inside-code.md)\n```\n")
  assert broken_links(page) == ["other.md#part-three (no such heading)", "gone.md (no such file)"]


def test_the_readme_reads_in_five_minutes():
  lines = (ROOT / "README.md").read_text().splitlines()
  assert len(lines) <= 200, f"README.md has {len(lines)} lines; the details belong in docs/"
  assert lines[2:4] == [
      "```bash",
      "pip install -e . && streamrl train --workdir runs/demo   # install, then the CPU demo: warm-up + async GRPO"]
  assert re.fullmatch(r'pip install -e "\.\[test\]" && python -m pytest -q {10}# the tests: about \d+ min on 2 CPU cores '
                      r"\(\+ torch, CPU\)", lines[4]), lines[4]
  assert lines[5] == "```"


def test_every_link_of_the_readme_and_the_docs_leads_somewhere():
  broken = {page.relative_to(ROOT).as_posix(): links for page in PAGES if (links := broken_links(page))}
  assert not broken


def test_the_architecture_layout_names_every_module_and_folder_of_the_package_and_every_inner_module():
  text = (ROOT / "docs" / "architecture.md").read_text()
  block = text.split("## Layout: one folder a part", 1)[1].split("```", 2)[1]
  listed = set(re.findall(r"^  (\w+(?:\.py|/))", block, re.M))
  package = ROOT / "streamrl_jax"
  actual = {p.name + "/" if p.is_dir() else p.name for p in package.iterdir()
            if p.name not in ("__init__.py", "__pycache__") and (p.is_dir() or p.suffix == ".py")}
  assert listed == actual, f"listed, not in the package: {listed - actual}; not listed: {actual - listed}"
  unnamed = [str(p.relative_to(package)) for p in sorted(package.rglob("*.py"))
             if p.parent != package and p.name != "__init__.py" and not re.search(rf"\b{p.stem}\b", block)]
  assert not unnamed, f"modules the layout does not name: {unnamed}"


def _package_classes() -> dict[str, tuple[set[str], list[str]]]:
  """Every class of the package: the names its body, methods and `self.x =` give it, and its bases' names."""
  out: dict[str, tuple[set[str], list[str]]] = {}
  for path in (ROOT / "streamrl_jax").rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if not isinstance(node, ast.ClassDef):
        continue
      names, bases = out.setdefault(node.name, (set(), []))
      bases += [b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases]
      for inner in ast.walk(node):
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
          names.add(inner.name)
        elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
          names.add(inner.id)
        elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
          names.add(inner.attr)
  return out


def _has(classes, name: str, attr: str, seen=()) -> bool:
  """Whether class `name` (or a base: one outside the package may hold anything) has `attr`."""
  if name not in classes:
    return True
  names, bases = classes[name]
  return attr in names or any(_has(classes, b, attr, (*seen, name)) for b in bases if b not in seen)


def dangling_names(text: str, classes) -> list[str]:
  """The page's backticked `Class.attr` (a class of the package) and `streamrl_jax.module.Name` that name nothing."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  out = []
  for name in re.findall(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`", text):
    head, attr = name.split(".")[:2]
    if name.startswith("streamrl_jax."):
      if not _importable(name):
        out.append(name)
    elif head[0].isupper() and head in classes and not _has(classes, head, attr):
      out.append(name)
  return out


def _importable(name: str) -> bool:
  """`name` is a module, or a name in one."""
  try:
    if importlib.util.find_spec(name) is not None:
      return True
  except (ImportError, AttributeError):
    pass
  module, _, last = name.rpartition(".")
  try:
    return hasattr(importlib.import_module(module), last)
  except ImportError:
    return False


def test_every_class_attribute_and_module_name_the_docs_give_exists():
  classes = _package_classes()
  assert dangling_names("`Taken.refused` `Taken.nothing` `streamrl_jax.gin_config.parse` `streamrl_jax.gin_config.x` "
                        "`NotOurs.x` `metrics.jsonl`", classes) == ["Taken.nothing", "streamrl_jax.gin_config.x"]
  dangling = {page.relative_to(ROOT).as_posix(): found for page in PAGES
              if (found := dangling_names(page.read_text(), classes))}
  assert not dangling


# Backticked names of other projects' code that the docs cite (they name nothing here).
ELSEWHERE = {"named_jit", "update_fn", "individual_dot"}
OWN = ("test_docs.py", "test_metric_table.py")  # tests that spell out unknown names on purpose


def _code_words() -> set[str]:
  """Every identifier and metric key (`reward/task`) in the repository's code, configs and notebooks."""
  words = set()
  for ext in ("py", "gin", "toml", "ipynb", "yaml", "sh"):
    for path in ROOT.rglob(f"*.{ext}"):
      if not {".venv", ".git", "node_modules"} & set(path.relative_to(ROOT).parts) and path.name not in OWN:
        words |= set(re.findall(r"[A-Za-z_][\w/]*", path.read_text(errors="ignore")))
  return words


def unknown_identifiers(text: str, words: set[str]) -> list[str]:
  """The page's backticked snake_case identifiers and metric keys (`a_b`, `trainer_s/optimizer`) that appear
  nowhere in `words`, nor as a row key of the metrics table."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  found = re.findall(r"`([a-z][a-z0-9]*_[a-z0-9_]+(?:/[a-z0-9_]+)?)`", text)
  return sorted({w for w in found if w not in words and w not in ELSEWHERE and metric_table.unlisted({w: 0})
                 and not (ROOT / w).exists()})  # (a path of the repository)


def test_every_identifier_and_metric_key_the_docs_give_exists():
  assert unknown_identifiers("`step_s` `max_token_staleness` `reward/task` `trainer_s/optimizer` `kl_mean`",
                             {"step_s", "kl_mean"}) == ["max_token_staleness"]
  words = _code_words()
  unknown = {page.relative_to(ROOT).as_posix(): found for page in PAGES
             if (found := unknown_identifiers(page.read_text(), words))}
  assert not unknown
