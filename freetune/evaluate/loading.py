"""The trained adapter found and loaded on its base model for the evaluation (and for try it, freetune.chat)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from freetune.checkpoint import checkpoint_step
from freetune.errors import FreetuneError
from freetune.evaluate.comparison import ComparisonReport, compare_model
from freetune.resources import release_memory


def resolve_adapter_dir(adapter_dir: str | Path) -> Path:
    """The folder itself when it holds an adapter (final folder or a Trainer checkpoint-N), else a FreetuneError
    that says which folder to pass instead."""
    path = Path(adapter_dir).expanduser()
    if not path.is_dir():
        raise FreetuneError(f"Adapter folder {str(path)!r} does not exist. Point `adapter_dir` at the folder "
                            f"training saved (output_dir, or one of its checkpoint-N folders).")
    if (path / "adapter_config.json").exists():
        return path
    checkpoints = sorted((p for p in path.glob("checkpoint-*") if (p / "adapter_config.json").exists()),
                         key=lambda p: -1 if checkpoint_step(p) is None else checkpoint_step(p))
    if checkpoints:
        names = ", ".join(p.name for p in checkpoints)
        raise FreetuneError(f"{str(path)!r} holds no adapter of its own (no adapter_config.json), but has saved "
                            f"checkpoints: {names}. Pass one of them, e.g. {str(checkpoints[-1])!r} (the newest).")
    if (path / "config.json").exists():
        raise FreetuneError(f"{str(path)!r} is a full model, not a LoRA adapter (no adapter_config.json). The "
                            f"sanity check compares a base model with an adapter: pass the adapter folder.")
    raise FreetuneError(f"{str(path)!r} holds no adapter (no adapter_config.json). Pass the folder training "
                        f"saved the adapter to, or one of its checkpoint-N folders.")


def load_for_comparison(base_model: str | Path, adapter_dir: str | Path, plan=None):
    """(peft model, tokenizer): the base 4-bit on a GPU (as it trained) or fp32 on a CPU, the adapter on top.

    plan: the run's freetune.plan.Plan, for its compute dtype (read from this machine when None).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = resolve_adapter_dir(adapter_dir)
    if torch.cuda.is_available():
        from freetune.model import nf4_config
        from freetune.plan import make_plan

        dtype = (plan or make_plan()).precision.torch_dtype
        kwargs = dict(dtype=dtype, device_map={"": torch.cuda.current_device()}, quantization_config=nf4_config(dtype))
    else:  # bf16 matmuls are slow on most CPUs, and 4-bit brings nothing where memory is plentiful
        kwargs = dict(dtype=torch.float32)
    print(f"Loading {base_model} with the trained adapter ...", flush=True)
    base = AutoModelForCausalLM.from_pretrained(str(base_model), **kwargs)
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except Exception as exc:
        trained_on = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise FreetuneError(
            f"Could not put the adapter {str(adapter_dir)!r} on {str(base_model)!r}: {type(exc).__name__}: "
            f"{str(exc)[:300]}. The adapter was trained on {trained_on!r}: pass that model as the base.") from exc
    # A Trainer checkpoint saves the tokenizer training used (chat template, pad token): prefer it.
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_model
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    return model, tokenizer


def compare(base_model: str | Path, adapter_dir: str | Path, rows, *, task: str | ModuleType | None = None,
            greedy: bool = True, seeds=(0, 1, 2), temperature: float = 0.7, max_new_tokens: int = 256,
            batch_size: int = 8, plan=None) -> ComparisonReport:
    """Load the base model and the adapter (final folder or checkpoint-N) and compare their generations.

    base_model: the folder or hub id training started from. rows: normalised rows with varied prompts (a few
    held-out ones; 8 is plenty). task: "svg", "home_assistant" or None for the sanity numbers only.
    This loads a second copy of the base: free the training model first on a small GPU, or call
    compare_model on the model already in memory.
    """
    adapter_dir = resolve_adapter_dir(adapter_dir)
    model, tokenizer = load_for_comparison(base_model, adapter_dir, plan=plan)
    try:
        return compare_model(model, tokenizer, rows, task=task, greedy=greedy, seeds=seeds,
                             temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             adapter_dir=str(adapter_dir))
    finally:
        del model
        release_memory()


def pick_rows(dataset, n: int) -> list[dict]:
    """n rows spread evenly over the data set (deterministic), so the prompts are varied, not the first few."""
    total = len(dataset)
    if n >= total:
        return [dict(dataset[i]) for i in range(total)]
    return [dict(dataset[i * total // n]) for i in range(n)]
