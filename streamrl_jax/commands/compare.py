"""`streamrl compare RUN_DIR`: the arms of a run on one sample stream side by side (`pipeline.comparison`):
a table on stdout and RUN_DIR/compare.png."""

from __future__ import annotations

from pathlib import Path


def add_compare_parser(sub) -> None:
  compare = sub.add_parser("compare", help="compare the arms of a run (--arms): a table and RUN_DIR/compare.png")
  compare.add_argument("run_dir", help="the run's workdir")
  compare.add_argument("--out", default=None, help="the PNG to write (default RUN_DIR/compare.png)")
  compare.set_defaults(run=cmd_compare)


def cmd_compare(args) -> int:
  from streamrl_jax.records.comparison import read_arms, table, write_comparison_png

  arms = read_arms(Path(args.run_dir))
  out = Path(args.out) if args.out else Path(args.run_dir) / "compare.png"
  write_comparison_png(arms, out)
  print(table(arms))
  if len(arms) == 1:
    print(f"({args.run_dir} has no follower arms: run with --arms FILE ... to train several on one stream)")
  print(f"wrote {out}")
  return 0
