#!/bin/sh
# Print the Python interpreter the course runs with, setting one up if needed:
#   1. $COURSE_PYTHON if set;
#   2. .venv/bin/python if this repository already has a working virtual environment;
#   3. python3 if it already has the core dependencies (a GPU box or Colab with torch preinstalled);
#   4. otherwise create .venv and install the dependencies listed in pyproject.toml.
# Progress goes to stderr; stdout carries only the interpreter's path.
set -e
cd "$(dirname "$0")/.."
CORE="import torch, ninja, numpy, matplotlib, pytest"
if [ -n "$COURSE_PYTHON" ]; then echo "$COURSE_PYTHON"; exit 0; fi
if [ -x .venv/bin/python ] && .venv/bin/python -c "$CORE" >/dev/null 2>&1; then echo .venv/bin/python; exit 0; fi
if python3 -c "$CORE" >/dev/null 2>&1; then command -v python3; exit 0; fi
echo "setting up .venv with the dependencies of pyproject.toml (once; a CUDA build of torch is large)" >&2
python3 -m venv .venv >&2
DEPS=$(python3 -c "import re; t = open('pyproject.toml').read(); print(' '.join(re.findall(r'^  \"([^\"]+)\",', t.split('dependencies = [')[1].split(']')[0], re.M)))")
.venv/bin/python -m pip install --quiet --upgrade pip >&2
.venv/bin/python -m pip install --quiet $DEPS >&2
.venv/bin/python -c "$CORE" >&2
echo .venv/bin/python
