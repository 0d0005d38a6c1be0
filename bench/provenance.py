"""Where a measurement came from: the commit and the device, recorded with every benchmark cell."""
from __future__ import annotations

import os
import subprocess


def commit() -> str:
  """Short hash of HEAD, with '+dirty' when the tree has uncommitted changes; $MOEJAX_COMMIT where there is
  no git (the device machine receives a copy of the tree without it)."""
  if os.environ.get("MOEJAX_COMMIT"):
    return os.environ["MOEJAX_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    h = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                           cwd=here).stdout.strip()
    return (h + ("+dirty" if dirty else "")) or "unknown"
  except OSError:
    return "unknown"


def device() -> str:
  import jax
  d = jax.devices()[0]
  return f"{d.platform}:{getattr(d, 'device_kind', d.platform)}"
