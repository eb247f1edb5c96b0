"""Per architecture, on rows longer than the sliding window: freetune's path (fused LoRA layers cast once per forward,
freetune's attention where the plan takes it, the CUDA graphs' checkpoint with its fixed buffers emulated on the CPU
where the plan takes it) gives transformers' own path's loss and gradients; where a feature cannot honour the
architecture, the plan steps it aside and the feature itself refuses rather than compute another model.

Cost: ~10 s per architecture on 2 cores once the tiny models are cached (8 architectures); building the five newer
tiny models the first time takes ~1-2 min (freetune.fixtures caches them). compile is not in this matrix (on a CPU
each compiled layer costs ~a minute: tests/test_fused_mlp.py compiles Llama-like layers)."""

import pytest
import torch

from freetune.fixtures import cached_tiny_model
from freetune.plan import Hardware, ModelShape, Plan, decisions
from freetune.speed import attention, batching, cuda_graphs, lora_kernel
from test_graphed_layers import packed_batch, step

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "qwen3_moe")
ROWS, PAD_TO, MAX_ROW = (40, 30, 22), 128, 64  # every row longer than the tiny models' 16-token window


def lora_model(model_dir, attention: str):
    """The tiny model in NF4 (fp32 compute) with LoRA r8 on every linear layer (and a mixture's experts, through
    peft), non-zero B, transformers' checkpoint on every layer."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    torch.manual_seed(0)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, quantization_config=quant,
                                                 attn_implementation=attention)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear",
                                             task_type="CAUSAL_LM"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    model.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
    model.train()
    return model


def plan_for(shape):
    """(transformers' attention, freetune's attention, graphs?) as a T4 plan with a variable-length kernel takes them
    for this shape (freetune.plan.decisions)."""
    own = decisions.choose_attention(Hardware(), "turing", shape).value
    varlen = not decisions.varlen_why_not(shape, MAX_ROW)
    return own, (attention.register_attention() if varlen else own), not decisions.graphs_why_not(shape)


def freetune_path(model_dir, attention: str, graphs: bool):
    model = lora_model(model_dir, attention)
    lora_kernel.use_fused_lora(model)
    assert lora_kernel.cast_adapters_once_per_forward(model, same_buffers=True) is not None
    graphed = cuda_graphs.GraphedLayers(model, max_tokens=PAD_TO, max_row=MAX_ROW,
                                           max_rows=batching.most_rows(len(ROWS), PAD_TO, MAX_ROW), graphs=False,
                                           fixed_pairs=True)
    if graphs:
        assert graphed.install() == len(graphed.layers)
    return model, graphed


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_freetunes_path_gives_transformers_loss_and_gradients_on_rows_longer_than_the_window(architecture):
    model_dir = cached_tiny_model(architecture)
    shape = ModelShape.named(str(model_dir))
    own, attention, graphs = plan_for(shape)
    reference = lora_model(model_dir, own)
    model, _ = freetune_path(model_dir, attention, graphs)
    # One batch: the buffers' reuse by later batches is tests/test_graphed_layers.py's.
    batch = packed_batch(ROWS, pad_to=PAD_TO, max_row=MAX_ROW)
    want, got = step(reference, batch), step(model, batch)
    assert got[0] == pytest.approx(want[0], rel=1e-5), architecture
    assert got[1].keys() == want[1].keys() and len(want[1]) > 0
    for name, grad in want[1].items():
        assert torch.allclose(got[1][name], grad, rtol=1e-4, atol=1e-6), (architecture, name)
        assert grad.abs().sum() > 0, (architecture, name)  # every adapter weight trains


# What each architecture's plan steps aside from, and why (the plan table's words).
STEPS_ASIDE = {
    "mistral": {"varlen": "sliding window (16 tokens)"},
    "gemma2": {"varlen": "soft-caps its attention logits", "graphs": "different masks or rotary embeddings",
               "mlp": "gemma2's MLP is not one it knows", "attention": "eager"},
    "gemma3_text": {"varlen": "sliding window (16 tokens)", "graphs": "different masks or rotary embeddings",
                    "mlp": "gemma3_text's MLP is not one it knows"},
    "phi3": {"mlp": "phi3's MLP is not one it knows"},
    # compile: 40x slower on the GPU (graph breaks at the experts' grouped matmul, recompiles per layer; issue 47's
    # GPU run, reports/gpu/architectures_t4_emulated.json)
    "qwen3_moe": {"graphs": "mixture of experts", "mlp": "mixture of 4 experts", "compile": "mixture of experts"},
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_feature_says_whether_it_honours_the_architecture(architecture):
    shape = ModelShape.named(str(cached_tiny_model(architecture)))
    expected = STEPS_ASIDE.get(architecture, {})
    said = {"varlen": decisions.varlen_why_not(shape, MAX_ROW), "graphs": decisions.graphs_why_not(shape),
            "mlp": decisions.mlp_why_not(shape),
            "attention": decisions.choose_attention(Hardware(), "turing", shape).value}
    compiled = decisions.choose_compile("auto", "cuda", "single", shape)
    said["compile"] = "" if compiled.value else compiled.why
    for feature in ("varlen", "graphs", "mlp", "compile"):
        assert (expected.get(feature, "") in said[feature]) and (bool(said[feature]) == (feature in expected)), \
            (architecture, feature, said[feature])
    assert said["attention"] == expected.get("attention", "sdpa")


@pytest.mark.parametrize("architecture", ("gemma2", "gemma3_text"))
def test_the_graphs_refuse_layers_whose_masks_or_rotary_embeddings_differ(architecture):
    """Forced onto an architecture the plan steps them aside for, the graphs' checkpoint refuses at the first layer
    whose keyword arguments are not layer 0's: replaying layer 0's would train another model (max relative gradient
    difference 0.65-1.31 before this check, issue 47)."""
    model_dir = cached_tiny_model(architecture)
    model, _ = freetune_path(model_dir, "sdpa" if architecture != "gemma2" else "eager", graphs=True)
    with pytest.raises(ValueError, match="decoder layer 1 gets other keyword arguments than layer 0 "
                                         r"\(.*attention_mask.*\)"):
        step(model, packed_batch(ROWS, pad_to=PAD_TO, max_row=MAX_ROW))

    plan = Plan.build(device="cuda", batching="padding_free", gradient_checkpointing=True, checkpoint_every=1)
    assert "different masks or rotary embeddings" in cuda_graphs.why_not(model, plan, 1, cast_once=True)


def test_the_graphs_step_aside_for_experts_whose_lora_weights_they_would_not_train():

    model, _ = freetune_path(cached_tiny_model("qwen3_moe"), "sdpa", graphs=False)
    assert cuda_graphs.unfused_trainable(model)  # the experts' LoRA weights (peft's ParamWrapper)
    plan = Plan.build(device="cuda", batching="padding_free", gradient_checkpointing=True, checkpoint_every=1)
    reason = cuda_graphs.why_not(model, plan, 1, cast_once=True)
    assert "mixture of experts" in reason and "trainable weights outside the fused LoRA layers" in reason


def test_varlen_attention_refuses_a_window_or_a_cap_it_would_drop():
    from freetune.errors import FreetuneError

    module = torch.nn.Module()
    # a window as long as the rows: nothing slides
    attention.refuse_what_varlen_drops(module, 64, {"sliding_window": 64})
    attention.refuse_what_varlen_drops(module, 64, {})
    with pytest.raises(FreetuneError, match="a sliding window of 16 tokens"):
        attention.refuse_what_varlen_drops(module, 64, {"sliding_window": 16})
    with pytest.raises(FreetuneError, match=r"soft-capped logits \(50.0\)"):
        attention.refuse_what_varlen_drops(module, 64, {"softcap": 50.0})


def test_lora_dropout_on_a_mixtures_experts_is_refused_with_a_value_the_parameters_cell_takes():
    """Where the plan had no shape (offline), peft's own refusal comes through attach_lora with the right advice (it
    said "Set lora_targets to 'all-linear'", which it was)."""
    from transformers import AutoModelForCausalLM

    from freetune import params
    from freetune.errors import FreetuneError
    from freetune.model import attach_lora

    model = AutoModelForCausalLM.from_pretrained(str(cached_tiny_model("qwen3_moe")), dtype=torch.float32)
    with pytest.raises(FreetuneError, match="ParamWrapper, which takes no dropout. Set lora_dropout = 0.0"):
        attach_lora(model, rank=4, alpha=8, dropout=0.05)
    params.require(lora_dropout=0.0)
    model = AutoModelForCausalLM.from_pretrained(str(cached_tiny_model("qwen3_moe")), dtype=torch.float32)  # unwrapped
    _, trainable, _ = attach_lora(model, rank=4, alpha=8, dropout=0.0)
    # the plan's count of the LoRA weights (the experts' and the router's included) is peft's
    assert trainable == ModelShape.named(str(cached_tiny_model("qwen3_moe"))).lora_params(4)


def test_a_mixture_of_experts_notebook_is_refused_at_the_recipes_dropout_and_trains_at_the_advised_one(tmp_path):
    """tiny_4gb's Colab notebook on the tiny qwen3_moe (the one notebook run of this matrix): at the recipe's
    lora_dropout 0.05 the preflight cell refuses before the model loads, with the value to set; at that value it
    trains. Cost: one refused run and one 8-step CPU run: 7.1 min measured on 2 cores under a load average of 16,
    so about 1-2 min on idle ones."""
    from conftest import run_recipe

    moe = str(cached_tiny_model("qwen3_moe"))
    refused, record, notebook = run_recipe("tiny_4gb", "colab", tmp_path / "refused", ("model_id", moe),
                                           ("lora_dropout", "0.05"))
    assert refused.returncode != 0
    assert "Set lora_dropout = 0.0" in record["error"] and "ParamWrapper" in record["error"]
    failed = [c for c in notebook.cells if any(o.get("output_type") == "error" for o in c.get("outputs", []))]
    assert len(failed) == 1 and "run.preflight()" in failed[0].source  # the preflight, before any model loads
    trained, record, _ = run_recipe("tiny_4gb", "colab", tmp_path / "trained", ("model_id", moe),
                                    ("lora_dropout", "0.0"))
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert record["training"]["steps"] == 8
