"""Shared test fixtures: the tiny offline model (built once per machine and cached) and sample data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests never reach a hub: fail fast instead of hanging on a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def trace_writes(run_dir) -> dict:
    """Environment under which every torchrun rank reports, at exit, the files it wrote under run_dir
    (tests/trace_writes/sitecustomize.py): what proves that only rank 0 writes."""
    path = os.pathsep.join(filter(None, [str(REPO / "tests" / "trace_writes"), os.environ.get("PYTHONPATH")]))
    return {"FREETUNE_TRACE_WRITES": str(run_dir), "PYTHONPATH": path}


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from freetune.fixtures import cached_tiny_model

    return cached_tiny_model("qwen2")


@pytest.fixture(scope="session")
def svg_sample() -> Path:
    from freetune.fixtures import sample_data_path

    return sample_data_path("svg")


@pytest.fixture(scope="session")
def home_assistant_sample() -> Path:
    from freetune.fixtures import sample_data_path

    return sample_data_path("home_assistant")


def run_recipe(recipe, target, out, *params, env=None):
    """scripts/run_recipe.py --embedded, as a user runs it: (completed process, its JSON record, executed notebook)."""
    import nbformat

    cmd = [sys.executable, str(REPO / "scripts" / "run_recipe.py"), recipe, "--target", target, "--embedded",
           "--out", str(out)]
    for name, value in params:
        cmd += ["-p", name, value]
    result = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=1500)
    record = json.loads((out / f"{recipe}-{target}.json").read_text())
    return result, record, nbformat.read(out / f"{recipe}-{target}.ipynb", as_version=4)


RECIPES = tuple(sorted(p.stem for p in (REPO / "recipes").glob("*.py")))  # every recipe is one file there
TARGETS = ("colab", "kaggle")


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """executed_notebook(recipe, target) -> (result, record, nb, out): each recipe x target run once per test
    session on its embedded default (Kaggle: torchrun with 2 gloo processes), shared by every test that only
    reads what a default run shows. Notebook runs are the slowest thing in the suite: reuse these, and start a
    run of your own only for parameters that differ from the default."""
    cache = {}

    def get(recipe: str, target: str):
        if (recipe, target) not in cache:
            out = tmp_path_factory.mktemp(f"{recipe}-{target}")
            params = [("ddp_processes", "2")] if target == "kaggle" else []
            env = trace_writes(out / "runs" / target) if target == "kaggle" else None
            cache[recipe, target] = (*run_recipe(recipe, target, out, *params, env=env), out)
        return cache[recipe, target]

    return get
