"""The suite's order (tests/conftest.py): the longest files first, each file's tests in their own order."""

import dataclasses
from pathlib import Path

from tests import conftest


@dataclasses.dataclass
class Item:
  path: Path
  name: str


def test_each_named_longest_file_exists():
  here = Path(__file__).parent
  assert [name for name in conftest.LONGEST_FILES if not (here / name).exists()] == []
  assert len(set(conftest.LONGEST_FILES)) == len(conftest.LONGEST_FILES)


def test_the_longest_files_come_first_and_each_files_tests_keep_their_order():
  first, second = conftest.LONGEST_FILES[:2]
  files = ["test_a.py", second, "test_a.py", first, second, "test_b.py"]
  items = [Item(Path("tests") / f, n) for f, n in zip(files, ["a1", "s1", "a2", "f1", "s2", "b1"])]
  conftest.pytest_collection_modifyitems(None, items)
  assert [i.name for i in items] == ["f1", "s1", "s2", "a1", "a2", "b1"]
