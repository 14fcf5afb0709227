#!/bin/sh
# Print the Python interpreter the course runs with, setting one up if needed:
#   1. $COURSE_PYTHON if set;
#   2. the interpreter .course-python names, if it works (utils.student writes that file into a
#      starter kit: the kit then runs with the course's environment instead of installing another);
#   3. .venv/bin/python if this repository already has a working virtual environment;
#   4. python3 if it already has the core dependencies (a GPU box or Colab with torch preinstalled);
#   5. otherwise create .venv and install the dependencies listed in pyproject.toml, saying first
#      what it installs, why and about how large, with pip's own progress shown.
# Which torch (step 5): the CUDA build (PyPI's default) wherever a kernel can be compiled or run:
# with an NVIDIA GPU, or without one but with a CUDA toolkit (nvcc), because linking the
# extensions needs the CUDA libraries of torch's CUDA build (libtorch_cuda, libc10_cuda), which the
# CPU-only build does not ship (utils.build refuses a CPU-only torch). On a
# machine with neither, the CPU-only build from PyTorch's CPU index, a small fraction of the size:
# the CPU tests run, and the compile and GPU tests skip there with any torch. COURSE_TORCH=cuda or
# COURSE_TORCH=cpu overrides the choice.
# `sh utils/env.sh --plan` prints what step 5 would install here, and why, and installs nothing.
# Progress goes to stderr; stdout carries only the interpreter's path.
set -e
cd "$(dirname "$0")/.."
CORE="import torch, ninja, numpy, matplotlib, pytest"
CPU_INDEX=https://download.pytorch.org/whl/cpu
PLAN=; [ "$1" = --plan ] && PLAN=1
if [ -z "$PLAN" ]; then
if [ -n "$COURSE_PYTHON" ]; then echo "$COURSE_PYTHON"; exit 0; fi
if [ -f .course-python ]; then
  KIT_PYTHON=$(cat .course-python)
  if [ -x "$KIT_PYTHON" ] && "$KIT_PYTHON" -c "$CORE" >/dev/null 2>&1; then echo "$KIT_PYTHON"; exit 0; fi
fi
if [ -x .venv/bin/python ] && .venv/bin/python -c "$CORE" >/dev/null 2>&1; then echo .venv/bin/python; exit 0; fi
if python3 -c "$CORE" >/dev/null 2>&1; then command -v python3; exit 0; fi
fi

DEPS=$(python3 -c "import re; t = open('pyproject.toml').read(); print(' '.join(re.findall(r'^  \"([^\"]+)\",', t.split('dependencies = [')[1].split(']')[0], re.M)))")
# The toolkit is found as utils.build finds it (CUDA_HOME, CUDA_PATH, nvcc on PATH, standard places)
TOOLKIT=$(python3 -c "import sys; sys.path.insert(0, '.'); from utils.build import find_cuda_home; print(find_cuda_home())" 2>/dev/null || true)
if [ -n "$COURSE_TORCH" ]; then
  TORCH=$COURSE_TORCH; WHY="COURSE_TORCH=$COURSE_TORCH"
elif nvidia-smi -L >/dev/null 2>&1; then
  TORCH=cuda; WHY="an NVIDIA GPU is visible"
elif [ -n "$TOOLKIT" ]; then
  TORCH=cuda; WHY="no GPU, but the CUDA toolkit in $TOOLKIT compiles the kernels, which needs torch's CUDA build"
else
  TORCH=cpu; WHY="no GPU and no CUDA toolkit: no kernel can be compiled or run here"
fi
case "$TORCH" in
  cuda) echo "setting up .venv (once): torch's CUDA build from PyPI ($WHY): about 5 GB installed" \
             "(torch about 1 GB, the NVIDIA CUDA libraries it depends on about 3 GB), minutes to download" >&2 ;;
  cpu) echo "setting up .venv (once): torch's CPU-only build from $CPU_INDEX ($WHY): a few hundred MB." \
            "The CPU tests run; the compile and GPU tests skip. COURSE_TORCH=cuda installs the CUDA build instead" >&2 ;;
  *) echo "COURSE_TORCH must be cuda or cpu, got '$TORCH'" >&2; exit 2 ;;
esac
echo "then the other dependencies of pyproject.toml ($DEPS): a few hundred MB at most" >&2
if [ -n "$PLAN" ]; then exit 0; fi
python3 -m venv .venv >&2
.venv/bin/python -m pip install --upgrade pip >&2
if [ "$TORCH" = cpu ]; then
  .venv/bin/python -m pip install torch --index-url "$CPU_INDEX" >&2
fi
.venv/bin/python -m pip install $DEPS >&2
.venv/bin/python -c "$CORE" >&2
echo .venv/bin/python
