"""The package's log lines: a logger per module under `streamrl_jax` (`logging.getLogger(__name__)`), configured
once by the program that runs (`configure`). A library user sees nothing below WARNING until it configures logging."""

from __future__ import annotations

import logging
import sys

ROOT = "streamrl_jax"
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class ConsoleHandler(logging.Handler):
  """Writes each record to the stream current at that moment (a notebook's or pytest's capture included): stderr, or
  with `split` stdout below WARNING and stderr from it; through tqdm when `around_bar`, so that a progress bar stays
  whole below the lines."""

  def __init__(self, split: bool = False, around_bar: bool = False):
    super().__init__()
    self.split, self.around_bar = split, around_bar

  def emit(self, record: logging.LogRecord) -> None:
    try:
      line = self.format(record)
      stream = sys.stdout if self.split and record.levelno < logging.WARNING else sys.stderr
      if self.around_bar:
        from tqdm import tqdm

        tqdm.write(line, file=stream)
      else:
        print(line, file=stream, flush=True)
    except Exception:  # noqa: BLE001 - logging's own contract: a broken handler must not stop the program
      self.handleError(record)


class BareFormatter(logging.Formatter):
  """A one-process command's lines: the message alone, a warning or an error said so in front."""

  def format(self, record: logging.LogRecord) -> str:
    text = super().format(record)
    return text if record.levelno < logging.WARNING else f"{record.levelname.lower()}: {text}"


def configure(level: str = "INFO", role: str | None = None, *, around_bar: bool = False) -> None:
  """The package's records at `level` and above go to the console: bare messages for a one-process command (stdout;
  warnings and errors on stderr), or, with `role` (one program of a run across processes), lines on stderr that
  start with the time, the role and the process id, so that the lines of several programs read apart. Calling it
  again replaces the last."""
  if level.upper() not in LEVELS:
    raise ValueError(f"log level {level!r}; known: {list(LEVELS)}")
  logger = logging.getLogger(ROOT)
  for handler in [h for h in logger.handlers if isinstance(h, ConsoleHandler)]:
    logger.removeHandler(handler)
  handler = ConsoleHandler(split=role is None, around_bar=around_bar)
  stamped = logging.Formatter(f"%(asctime)s {role}[%(process)d] %(levelname)s %(message)s", "%Y-%m-%d %H:%M:%S")
  handler.setFormatter(BareFormatter("%(message)s") if role is None else stamped)
  logger.addHandler(handler)
  logger.setLevel(level.upper())
  logger.propagate = False
