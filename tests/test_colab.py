"""The Colab notebook is valid JSON and its Python cells compile (shell lines aside)."""

import ast
import json
from pathlib import Path

NOTEBOOK = Path(__file__).resolve().parent.parent / "colab" / "streamrl_demo.ipynb"


def test_notebook_cells_compile_and_use_the_public_names():
  notebook = json.loads(NOTEBOOK.read_text())
  code = ["\n".join(line for line in "".join(c["source"]).splitlines() if not line.lstrip().startswith("!"))
          for c in notebook["cells"] if c["cell_type"] == "code"]
  assert len(code) >= 5
  for source in code:
    ast.parse(source)
  text = "\n".join("".join(c["source"]) for c in notebook["cells"])
  for name in ("streamrl train", "streamrl simulate", "load_hf", "load_tokenizer"):
    assert name in text
