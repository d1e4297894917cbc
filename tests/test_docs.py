"""The docs a newcomer reads: a short README, links that lead somewhere, and a layout that is the package's."""

from __future__ import annotations

import re
from pathlib import Path

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
  assert lines[2:6] == [
      "```bash",
      "pip install -e . && streamrl train --workdir runs/demo   # install, then the CPU demo: warm-up + async GRPO",
      'pip install -e ".[test]" && python -m pytest -q          # the tests: about 50 min on 2 CPU cores (+ torch, CPU)',
      "```"]


def test_every_link_of_the_readme_and_the_docs_leads_somewhere():
  broken = {page.relative_to(ROOT).as_posix(): links for page in PAGES if (links := broken_links(page))}
  assert not broken


def test_the_architecture_layout_names_every_module_and_folder_of_the_package():
  text = (ROOT / "docs" / "architecture.md").read_text()
  block = text.split("## Layout: one folder a part", 1)[1].split("```", 2)[1]
  listed = set(re.findall(r"^  (\w+(?:\.py|/))", block, re.M))
  package = ROOT / "streamrl_jax"
  actual = {p.name + "/" if p.is_dir() else p.name for p in package.iterdir()
            if p.name not in ("__init__.py", "__pycache__") and (p.is_dir() or p.suffix == ".py")}
  assert listed == actual, f"listed, not in the package: {listed - actual}; not listed: {actual - listed}"
