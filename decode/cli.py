"""The edge of the absl CLIs (decode.generate, bench.cells, bench.step, bench.attention): one catch that turns an
expected failure into one line on stderr and exit 1, and the flag checks they share.

Expected failures: our error types (model.gguf_io.GGUFError, decode.engine.RequestError, decode.kv_plan.PlanError,
CLIError, absl's app.UsageError) and OSError (a missing or unreadable file, a full disk). Any other exception is a
bug and keeps its traceback.

>>> positive_int("kv_resident", "7")
7
>>> positive_int("kv_resident", "seven")
Traceback (most recent call last):
...
decode.cli.CLIError: --kv_resident: 'seven', expected a positive integer
"""
from __future__ import annotations

import functools
import math
import sys

from absl import app


class CLIError(ValueError):
  """A flag or input a CLI refuses; the message is one line naming the flag and what was expected."""


def expected_errors() -> tuple[type, ...]:
  """The exception types a CLI reports in one line (imported here, at the edge: each CLI has loaded them by then)."""
  from decode.engine import RequestError
  from decode.kv_plan import PlanError
  from model.gguf_io import GGUFError
  return (GGUFError, RequestError, PlanError, CLIError, app.UsageError, OSError)


def one_line(e: BaseException) -> str:
  """The first line of an exception's message (its type's name when it has none)."""
  lines = str(e).strip().splitlines()
  return lines[0] if lines else type(e).__name__


def guarded(main):
  """`main(argv)` with the one catch: an expected failure prints `error: <one line>` to stderr and exits 1."""
  @functools.wraps(main)
  def run(argv):
    try:
      return main(argv)
    except Exception as e:  # noqa: BLE001 - re-raised unless expected, so a bug keeps its traceback
      if not isinstance(e, expected_errors()):
        raise
      print(f"error: {one_line(e)}", file=sys.stderr)
      sys.exit(1)
  return run


def run(main) -> None:
  """absl's app.run(main) behind the one catch."""
  app.run(guarded(main))


# -- flag checks ---------------------------------------------------------------------------------------------------

def check(name: str, value, ok: bool, expected: str) -> None:
  """A CLIError `--name: value, expected ...` unless ok."""
  if not ok:
    raise CLIError(f"--{name}: {value!r}, expected {expected}")


def positive_int(name: str, v: str, named: str | None = None) -> int:
  """String flag `--name` as an integer >= 1 (`named`: the words it may also be, e.g. "auto")."""
  alt = f" or {named}" if named else ""
  try:
    n = int(v)
  except ValueError:
    raise CLIError(f"--{name}: {v!r}, expected a positive integer{alt}") from None
  check(name, n, n >= 1, f"a positive integer{alt}")
  return n


def number_in(name: str, v: float, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
  """Float flag `--name` finite and in [lo, hi] ((lo, hi] with lo_open)."""
  ok = math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi
  span = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]" if math.isfinite(hi) else f"{'>' if lo_open else '>='} {lo:g}"
  check(name, v, ok, f"a finite number {'in ' if math.isfinite(hi) else ''}{span}")
  return v


def utf8_text(name: str, text: str) -> str:
  """`text` from the command line (undecodable bytes arrive as surrogate escapes), or a CLIError naming the first
  byte that is not UTF-8."""
  try:
    text.encode("utf-8")
  except UnicodeEncodeError as e:
    raw = text.encode("utf-8", "surrogateescape")
    at = len(text[:e.start].encode("utf-8", "surrogateescape"))
    raise CLIError(f"--{name}: not valid UTF-8 (byte 0x{raw[at]:02x} at byte offset {at})") from None
  return text


def read_utf8(name: str, path: str) -> str:
  """The UTF-8 text of file `path` given by `--name`, or a CLIError naming why not (unreadable, not UTF-8)."""
  try:
    with open(path, "rb") as f:
      raw = f.read()
  except OSError as e:
    raise CLIError(f"--{name} {path}: {e.strerror or type(e).__name__}") from None
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise CLIError(f"--{name} {path}: not valid UTF-8 (byte 0x{raw[e.start]:02x} at byte offset {e.start})") from None
