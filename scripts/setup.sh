#!/usr/bin/env bash
# Makes .venv (Python 3.12 through pyenv) and installs the project pinned by constraints.txt.
#   bash scripts/setup.sh          runtime only (the demo)
#   bash scripts/setup.sh --test   also the test extras, llama-cpp-python (the reference engine) included
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
if [ ! -x .venv/bin/python ]; then
  py=""
  # (grep without -q: under pipefail, grep -q exiting at the first match can kill pyenv with SIGPIPE and fail the
  # pipeline, a race that sent a clean CI clone to the pyenv shim below)
  if command -v pyenv >/dev/null 2>&1 && pyenv versions --bare | grep -x '3.12.1' >/dev/null; then
    py="$(PYENV_VERSION=3.12.1 pyenv which python3)"
  elif command -v python3.12 >/dev/null 2>&1 && python3.12 --version >/dev/null 2>&1; then
    py="$(command -v python3.12)"
  elif command -v pyenv >/dev/null 2>&1; then
    pyenv install -s 3.12.1 && py="$(PYENV_VERSION=3.12.1 pyenv which python3)"
  fi
  [ -n "$py" ] || { echo "setup: need Python 3.12 (pyenv 3.12.1 or python3.12 on PATH)" >&2; exit 1; }
  "$py" -m venv .venv
fi
# llama.cpp builds for this CPU, without the multimodal library or tools (only the Python bindings are used).
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF}"
export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -c constraints.txt -e ".${extras}"
