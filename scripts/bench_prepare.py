"""scripts/bench.py's constants and preparation: the modes, runs and shapes it knows, and the tokenizer, random-weight
models and rows its runs train on (built once per work folder by the scheduler)."""

from __future__ import annotations

import time
from pathlib import Path

from freetune.plan import KNOWN_SHAPES, ModelShape


REPO = Path(__file__).resolve().parents[1]

ROWS_PER_STEP = 8  # per GPU: batch 1 x accumulation 8 in the free-tier recipe

LORA_RANK = 16

# The cuBLAS workspace PyTorch takes on a T4 (sm75; ':4096:2:16:8', 8 MiB per thread and stream) where an H200 takes
# 32 MiB (a training step holds two: the forward's thread and the backward's, so both tools' peaks carry 48 MiB a T4
# would not). Only with --t4-cublas-workspace: on Hopper so small a workspace costs each matmul about three times the
# host time (scripts/matmul_host_cost.py), for both tools, which a T4's own kernels do not pay.
T4_CUBLAS_WORKSPACE = ":4096:2:16:8"

TINY_SHAPE = ModelShape("tiny", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=1024,
                        tied_embeddings=True, attention_bias=True)

ARCHITECTURE = {"Qwen2.5-1.5B": "qwen2", "TinyLlama-1.1B": "llama", "Qwen3-8B": "qwen3", "tiny": "qwen2"}

ROW_LENGTHS = (300, 1200)  # the synthetic rows' lengths (cut at MAX_LENGTH), unless a mode or --row-lengths says

MAX_LENGTH = 1024

# Each mode stands for a recipe: freetune's LoRA dropout there is that recipe's default (recipe_default); Unsloth's runs
# use 0, what its fused LoRA path needs.
MODES = {
    "uncapped": dict(shape="qwen2.5-1.5b", cap_gib=0.0, precision="auto", recipe="svg_coder"),
    "t4": dict(shape="qwen2.5-1.5b", cap_gib=14.5, precision="fp16", recipe="svg_coder"),
    "4gb": dict(shape="tinyllama-1.1b", cap_gib=4.0, precision="fp16", recipe="tiny_4gb"),
    # home_assistant's model under the T4 cap (issue 49), on rows as long as that recipe's (150-500 tokens)
    "t4_8b": dict(shape="qwen3-8b", cap_gib=14.5, precision="fp16", recipe="home_assistant", lengths=(150, 500)),
}

RUNS = ("free_tier", "plain_best", "freetune")

ROW_SOURCES = ("synthetic", "svg_sample")

# Unsloth with its offloaded checkpointing, without checkpointing (both padding-free), and (not asked for in issue 25,
# the other candidate for its fastest) padded batches through its per-layer compile, no checkpointing.
PEER_RUNS = ("unsloth", "unsloth_nockpt", "unsloth_padded")

BENCH = REPO / "scripts" / "bench.py"  # the entry point the workers run (--worker JOB.json)
PEER_WORKER = REPO / "scripts" / "bench_unsloth.py"

PEER_SITE_DEFAULT = "/tmp/usite"

# Issue 25's targets: freetune's tokens/s over Unsloth's, per mode (see peer_targets).
TARGET_X = {"4gb": 1.3, "t4": 1.3, "t4_8b": 1.3, "uncapped": 1.8}

LEAN_X = 1.3

# Issue 49's memory target: freetune's peak allocated at most the fastest fitting Unsloth run's + 5%. --match-peer-memory
# plans one more freetune run (freetune[matched]) for exactly that budget, measured after the peer's runs in the call.
MATCHED = "freetune[matched]"

PEER_MEMORY_MARGIN = 0.05

# --like-for-like: freetune's plan with the peer's training settings (scripts/bench_unsloth.py): LoRA dropout 0 (its
# fused LoRA path needs it; svg_coder's recipe uses 0.05, tiny_4gb's 0) and 8-bit AdamW (its notebooks'; freetune's
# plan takes fused AdamW where the fp32 state is small against the budget). Judged against each mode's target like the
# default run.
LIKE_FOR_LIKE = ("like", {"lora_dropout": 0, "optimizer": "adamw_8bit"})

def recipe_default(recipe: str, name: str):
    """A parameter's default in recipes/<recipe>.py's parameters cell (`name: type = literal  # help`)."""
    import ast

    tree = ast.parse((REPO / "recipes" / f"{recipe}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return ast.literal_eval(node.value)
    raise KeyError(f"recipes/{recipe}.py declares no parameter {name!r}")


def shape_of(name: str) -> ModelShape:
    return TINY_SHAPE if name == "tiny" else KNOWN_SHAPES[name]


def shape_named(name: str) -> ModelShape:
    """The shape a run's report names (its ModelShape.name: 'Qwen3-8B'), for its MFU; any unknown name is an error,
    not the tiny shape (which made the Qwen3-8B runs' MFU read 0.0%)."""
    found = [s for s in (TINY_SHAPE, *KNOWN_SHAPES.values()) if s.name == name]
    if not found:
        raise KeyError(f"no shape named {name!r} in bench's shapes "
                       f"({', '.join(s.name for s in KNOWN_SHAPES.values())})")
    return found[0]


def parse_row_lengths(text: str, max_length: int = MAX_LENGTH) -> tuple[int, int]:
    """--row-lengths: 'MIN,MAX' tokens (uniform, cut at max_length) or 'max' (every row at max_length)."""
    if text.strip().lower() == "max":
        return max_length, max_length
    parts = text.split(",")
    try:
        low, high = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--row-lengths {text!r}: give MIN,MAX in tokens (e.g. 300,1200) or 'max' (every row at "
                         f"max_length, {max_length})") from None
    if not 1 <= low <= high:
        raise ValueError(f"--row-lengths {text!r}: need 1 <= MIN <= MAX (rows longer than {max_length} are cut)")
    return low, high


def matmul_flops_per_token(shape: ModelShape) -> int:
    """Weights a token is multiplied with once in the forward: decoder linear layers and the lm_head."""
    return shape.quantized_params + shape.vocab * shape.hidden


def base_run(run: str) -> str:
    """'freetune[label]' (a --variants run) -> 'freetune'."""
    return run.split("[")[0]


def build_tokenizer(out: Path) -> Path:
    """A word-level tokenizer with pad 0 and eos 1: the rows are token ids already, the trainer needs only the
    special tokens, and their ids must exist in every vocabulary benchmarked (TinyLlama's is 32,000)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(str(out))
    return out


def build_model(shape: ModelShape, out: Path, tokenizer_dir: Path, device: str) -> Path:
    """A random-weight model of `shape` saved to `out` (built on the GPU when there is one: 1.5B weights
    initialise in seconds there, minutes on a CPU)."""
    import torch

    from freetune.fixtures import build_tiny_model

    if (out / "config.json").exists():
        return out
    overrides = dict(intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
                     num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab, pad_token_id=0, eos_token_id=1,
                     bos_token_id=1, tie_word_embeddings=shape.tied_embeddings)
    if shape.head_dim:  # Qwen3's 128 (the tiny fixture's qwen3 config says 16)
        overrides["head_dim"] = shape.head_dim
    with torch.device(device):
        build_tiny_model(out, ARCHITECTURE[shape.name], hidden_size=shape.hidden, num_layers=shape.layers,
                         tokenizer_dir=tokenizer_dir, **overrides)
    return out


def svg_sample_rows() -> list[list[int]]:
    """The bundled SVG sample as svg_coder's notebook trains on it (--embedded): each row a chat with the recipe's
    system prompt, rendered by Qwen2.5's chat template and tokenizer (the offline fixture's) into token ids."""
    import freetune

    tokenizer = freetune.model.load_tokenizer(str(freetune.fixtures.cached_tiny_model("qwen2")))
    rows = freetune.data.normalize(freetune.data.load_rows(str(freetune.fixtures.sample_data_path("svg"))))
    rows = freetune.data.as_chat(rows, recipe_default("svg_coder", "system_prompt"))
    return [tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)
            ["input_ids"] for row in rows]


def synthetic_rows(n: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """n rows of random token ids with lengths uniform in `lengths` (SFT rows are this spread, and the spread
    is what padding wastes)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def measure_matmul_tflops(device: str) -> dict:
    """The GPU's dense 16-bit matmul rate, measured: 8192^3 bf16 (and fp16) products, best of a few timings."""
    import torch

    out = {}
    n = 8192 if device == "cuda" else 512
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if device == "cpu":
            dtype = torch.float32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        best = float("inf")
        for _ in range(5):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    a @ b
                end.record()
                torch.cuda.synchronize()
                best = min(best, start.elapsed_time(end) / 1000 / 10)
            else:
                t = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t)
        out[name if device == "cuda" else "fp32"] = 2 * n ** 3 / best / 1e12
        if device == "cpu":
            break
    return out
