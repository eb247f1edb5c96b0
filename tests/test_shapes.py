"""The model's shape read from its own config.json (freetune.plan.shapes): the real SmolLM2 fixture's, the tiny
architectures' the tests build, and a hub id's config.json from huggingface_hub's cache, without any download; each
checked against the parameters the model's safetensors actually hold."""

import json
import math
import shutil
import struct
from pathlib import Path

import pytest

from freetune.fixtures import cached_smollm2, cached_tiny_model
from freetune.plan import KNOWN_SHAPES, ModelShape, make_plan, shape_of
from freetune.plan.shapes import read_config


def stored_parameters(folder: Path) -> int:
    """Parameters in the folder's safetensors files, from their headers alone."""
    total = 0
    for file in Path(folder).glob("*.safetensors"):
        with open(file, "rb") as handle:
            header = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def test_smollm2s_shape_comes_from_its_config_json_and_counts_every_stored_parameter():
    folder = cached_smollm2()
    shape = ModelShape.named(str(folder))
    assert (shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab) == \
        (576, 30, 9, 3, 1536, 49152)
    assert shape.tied_embeddings and not shape.experts and shape.model_type == "llama"
    assert shape.total_params == stored_parameters(folder) == 134_515_008
    assert shape_of(str(folder)) == (shape, str(folder / "config.json"))


# Gemma-2/3 are left out: their layers have two more norms (pre/post feed-forward) than the shape counts, a few
# hidden-sized vectors per layer (256 parameters in the tiny Gemma-2), which no memory figure notices.
@pytest.mark.parametrize("architecture", ["llama", "mistral", "phi3", "qwen2", "qwen3", "qwen3_moe"])
def test_a_tiny_models_shape_from_its_config_counts_every_stored_parameter(architecture):
    folder = cached_tiny_model(architecture)
    config = json.loads((folder / "config.json").read_text())
    shape = ModelShape.named(str(folder))
    assert (shape.hidden, shape.layers, shape.vocab) == \
        (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"])
    assert shape.experts == config.get("num_experts", config.get("num_local_experts", 0))
    assert shape.total_params == stored_parameters(folder)


def test_a_hub_ids_config_in_the_cache_is_read_before_the_table(tmp_path, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub's cache as a download of config.json alone leaves it (the tests run with HF_HUB_OFFLINE=1).
    snapshot = tmp_path / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    shutil.copy(cached_smollm2() / "config.json", snapshot / "config.json")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))

    config, name = read_config("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert name == "SmolLM2-135M-Instruct" and config["hidden_size"] == 576
    assert ModelShape.named("HuggingFaceTB/SmolLM2-135M-Instruct").total_params == 134_515_008
    assert make_plan(model_shape="HuggingFaceTB/SmolLM2-135M-Instruct").reasons["model"] == \
        "the Hub's config.json of HuggingFaceTB/SmolLM2-135M-Instruct"
    # Not in the cache: the table's shape, for the few hub ids the recipes name.
    assert ModelShape.named("Qwen/Qwen2.5-Coder-1.5B-Instruct") == KNOWN_SHAPES["qwen2.5-coder-1.5b"]
    assert read_config("Qwen/Qwen2.5-Coder-1.5B-Instruct") == (None, "Qwen/Qwen2.5-Coder-1.5B-Instruct")
