"""The plan for models users bring, from their own config.json (public values written out here), on a faked T4: the
shape, the architecture's particulars (experts, tied embeddings, head_dim, sliding windows, soft-capping), which
fast-path feature steps aside for it and why, and a model that cannot fit refused before any download."""

import json

import pytest

from freetune.speed import attention
from freetune.errors import FreetuneError
from freetune.plan import ModelShape, estimate, shape_of
from freetune.plan import GPU, Hardware, make_plan

T4 = Hardware(gpus=[GPU("Tesla T4", (7, 5), 14.7)], arch_list=["sm_75", "sm_80"], torch="2.13.0", cuda="12.8",
              disk_free_gib={"/work": 60.0}, ram_total_gib=30.0, ram_available_gib=28.0)

# The hub's config.json values that decide the plan (the rest of each file left out: transformers fills its defaults).
CONFIGS = {
    "Llama-3.2-1B-Instruct": dict(
        model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072),
    "gemma-3-1b-it": dict(
        model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        sliding_window=512, sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1000000.0,
        rope_local_base_freq=10000.0, max_position_embeddings=32768),
    "gemma-2-2b-it": dict(
        model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=2304, intermediate_size=9216,
        num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
        sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256),
    "Phi-4-mini-instruct": dict(
        model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=32, num_attention_heads=24, num_key_value_heads=8, vocab_size=200064,
        tie_word_embeddings=True, partial_rotary_factor=0.75, sliding_window=262144, max_position_embeddings=131072),
    "Mistral-7B-Instruct-v0.3": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
        sliding_window=None, tie_word_embeddings=False, rope_theta=1000000.0),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        tie_word_embeddings=False, use_sliding_window=False, sliding_window=None),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("configs")
    for name, config in CONFIGS.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    return {name: str(root / name) for name in CONFIGS}


@pytest.fixture
def t4_with_varlen(monkeypatch):
    """A T4 whose variable-length kernel passed its probe (the probe needs a GPU: here it is taken as passed)."""
    monkeypatch.setattr(attention, "varlen_works", lambda device, policy="ampere": (True, "probed by the test"))
    monkeypatch.setattr(attention, "varlen_backend", lambda device: "efficient")


def test_the_shape_comes_from_each_models_own_config_json(folders):
    llama = ModelShape.named(folders["Llama-3.2-1B-Instruct"])
    assert (llama.model_type, llama.tied_embeddings, llama.head_dim, llama.sliding_window) == ("llama", True, 64, None)
    assert llama.total_params == pytest.approx(1.236e9, rel=0.01)  # Llama-3.2-1B: 1.24 B
    gemma3 = ModelShape.named(folders["gemma-3-1b-it"])
    # transformers' Gemma-3 config ties the embeddings by default and derives the layer types from the pattern.
    assert gemma3.tied_embeddings and gemma3.sliding_window == 512 and gemma3.per_layer_arguments
    assert gemma3.total_params == pytest.approx(1.0e9, rel=0.02)  # gemma-3-1b: 1.0 B
    gemma2 = ModelShape.named(folders["gemma-2-2b-it"])
    assert (gemma2.attn_softcap, gemma2.final_softcap, gemma2.sliding_window) == (50.0, 30.0, 4096)
    phi = ModelShape.named(folders["Phi-4-mini-instruct"])
    assert phi.head_dim in (None, 128) and phi.q_dim == 3072 and phi.sliding_window == 262144
    assert phi.total_params == pytest.approx(3.84e9, rel=0.02)  # Phi-4-mini: 3.8 B
    mistral = ModelShape.named(folders["Mistral-7B-Instruct-v0.3"])
    assert mistral.sliding_window is None and not mistral.tied_embeddings
    assert mistral.total_params == pytest.approx(7.25e9, rel=0.01)  # Mistral-7B-v0.3: 7.25 B
    moe = ModelShape.named(folders["Qwen3-30B-A3B"])
    assert (moe.experts, moe.experts_per_token, moe.expert_intermediate) == (128, 8, 768)
    assert moe.total_params == pytest.approx(30.5e9, rel=0.02)  # Qwen3-30B-A3B: 30.5 B
    assert moe.expert_params == 48 * 128 * 3 * 2048 * 768
    # the experts count 16-bit (bitsandbytes does not quantise 3-D parameters): ~58 GiB of weights for them alone
    assert estimate(moe, max_length=256, micro_batch=1, frozen_dtype="float16").other_weights_gib > 54


def test_a_t4_plans_llama_and_mistral_with_every_fast_path_feature(folders, t4_with_varlen):
    for name in ("Llama-3.2-1B-Instruct", "Mistral-7B-Instruct-v0.3"):
        plan = make_plan(T4, model_shape=folders[name], lora_dropout=0.05)
        assert plan.memory.estimate.fits and plan.batch.batching == "padding_free", name
        assert plan.kernels.attention == "freetune_varlen" and plan.kernels.lora == "fused" and plan.kernels.compile
        assert name in dict((c, v) for c, v, _ in plan.rows())["model"]
        assert plan.reasons["model"].endswith("config.json")
    mistral = make_plan(T4, model_shape=folders["Mistral-7B-Instruct-v0.3"], lora_dropout=0.0)
    assert mistral.memory.checkpointing and mistral.memory.checkpoint_every == 1  # memory is tight: every layer
    assert mistral.kernels.mlp == "traced" and mistral.kernels.cuda_graph_tokens > 0 and mistral.memory.embeddings_on_host


def test_gemma_3_gets_no_padding_free_rows_no_graphs_no_fused_mlp_and_the_plan_says_why(folders, t4_with_varlen):
    plan = make_plan(T4, model_shape=folders["gemma-3-1b-it"], lora_dropout=0.0, memory_budget_gib=3)
    assert plan.batch.batching == "grouped" and plan.kernels.attention == "sdpa"
    assert "sliding window (512 tokens) is shorter than max_length (1024)" in plan.reasons["batching"]
    assert plan.kernels.cuda_graph_tokens == 0 and plan.kernels.mlp == "layers"
    assert "gemma3_text's MLP is not one it knows" in plan.reasons["mlp_kernel"]
    assert not plan.memory.estimate.settings["cuda_graphs"] and plan.memory.estimate.settings["mlp_kernel"] == "layers"
    # Rows within the window: padding-free again (nothing slides in a row shorter than the window); the graphs still
    # step aside (sliding and full layers get different masks and rotary embeddings).
    short = make_plan(T4, model_shape=folders["gemma-3-1b-it"], lora_dropout=0.0, max_length=512,
                      memory_budget_gib=3)
    assert short.batch.batching == "padding_free" and short.kernels.cuda_graph_tokens == 0
    assert "different masks or rotary embeddings by layer type" in short.reasons["cuda_graphs"]


def test_gemma_2_attention_is_eager_for_its_soft_capped_logits(folders, t4_with_varlen):
    plan = make_plan(T4, model_shape=folders["gemma-2-2b-it"], lora_dropout=0.0)
    assert plan.kernels.attention == "eager" and "sdpa would drop it" in plan.reasons["attention"]
    assert plan.batch.batching == "grouped" and "soft-caps its attention logits" in plan.reasons["batching"]


def test_phi_3s_fused_projections_keep_peft_s_mlp_and_its_memory_is_not_counted_as_saved(folders, t4_with_varlen):
    tight = dict(lora_dropout=0.0, memory_budget_gib=5)
    plan = make_plan(T4, model_shape=folders["Phi-4-mini-instruct"], **tight)
    assert plan.memory.checkpointing and plan.memory.checkpoint_every == 1
    assert plan.kernels.mlp == "layers" and "phi3's MLP is not one it knows" in plan.reasons["mlp_kernel"]
    # The estimate is the per-projection MLP's: the fused one would have claimed less.
    settings = {k: v for k, v in plan.memory.estimate.settings.items() if k != "model"}
    shape = ModelShape.named(folders["Phi-4-mini-instruct"])
    assert plan.memory.estimate.total_gib == pytest.approx(estimate(shape, **settings).total_gib)
    assert estimate(shape, **{**settings, "mlp_kernel": "traced"}).total_gib < plan.memory.estimate.total_gib


def test_a_mixture_of_experts_that_cannot_fit_a_t4_is_refused_before_download_with_what_would(folders):
    with pytest.raises(FreetuneError, match=r"Qwen3-30B-A3B cannot train on this GPU: 30\.5 B parameters, of which "
                                            r"29\.0 B are experts' weights that stay 16-bit.*fits up to about "
                                            r"\d\.\d B parameters: set model_id to a smaller model"):
        make_plan(T4, model_shape=folders["Qwen3-30B-A3B"], lora_dropout=0.0)


def test_lora_dropout_on_experts_is_refused_with_a_value_the_parameters_cell_takes(folders):
    from freetune import params

    with pytest.raises(FreetuneError, match="takes no LoRA dropout") as refused:
        make_plan(Hardware(), model_shape=folders["Qwen3-30B-A3B"], lora_dropout=0.05)
    assert "Set lora_dropout = 0.0" in str(refused.value)
    params.require(lora_dropout=0.0)  # the advice is a value the parameters cell accepts
    assert make_plan(Hardware(), model_shape=folders["Qwen3-30B-A3B"], lora_dropout=0.0).layout.device == "cpu"


def test_a_hub_id_plans_from_the_hubs_cached_config_json_and_says_why_when_it_cannot(folders, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # huggingface_hub's cache as a download of config.json alone leaves it (the tests run with HF_HUB_OFFLINE=1).
    repo = tmp_path / "models--meta-llama--Llama-3.2-1B-Instruct"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "snapshots" / ("0" * 40) / "config.json").write_text(json.dumps(CONFIGS["Llama-3.2-1B-Instruct"]))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    shape, where = shape_of("meta-llama/Llama-3.2-1B-Instruct")
    assert shape == ModelShape.named(folders["Llama-3.2-1B-Instruct"]).__class__.from_config(
        CONFIGS["Llama-3.2-1B-Instruct"], name="Llama-3.2-1B-Instruct")
    assert where == "the Hub's config.json of meta-llama/Llama-3.2-1B-Instruct"
    assert make_plan(T4, model_shape="meta-llama/Llama-3.2-1B-Instruct").memory.estimate.fits

    offline = make_plan(T4, model_shape="google/gemma-3-1b-it")  # not in the cache, and offline
    assert offline.memory.estimate is None and offline.batch.micro_batch == 1
    assert dict((c, v) for c, v, _ in offline.rows())["model"] == "google/gemma-3-1b-it (shape unknown)"
    assert any("its config.json could not be read from the Hub" in w and "local folder" in w
               for w in offline.warnings)
