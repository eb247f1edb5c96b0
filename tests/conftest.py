"""Shared test fixtures: the tiny offline model (built once per machine and cached) and sample data."""

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Tests never reach a hub: fail fast instead of hanging on a download.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


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
