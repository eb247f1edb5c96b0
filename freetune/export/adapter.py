"""The adapter, saved first and never touched again: save it on the main process, check a folder holds a complete
one, read which base model it was trained on."""

from __future__ import annotations

import json
import os
from pathlib import Path

from freetune.errors import FreetuneError


ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def _is_main(is_main_process: bool | None) -> bool:
    if is_main_process is not None:
        return is_main_process
    return int(os.environ.get("RANK", 0)) == 0  # torchrun's global rank; alone, we are rank 0


def check_adapter(adapter_dir: str | Path) -> Path:
    """The adapter folder, if it holds a complete PEFT adapter (config and safetensors weights)."""
    folder = Path(adapter_dir).expanduser()
    missing = [name for name in ADAPTER_FILES if not (folder / name).is_file()]
    if missing:
        where = "does not exist" if not folder.exists() else f"has no {' and no '.join(missing)}"
        raise FreetuneError(f"The adapter folder {str(folder)!r} {where}. Point `adapter_dir` at the folder the "
                            f"training step saved (it holds {' and '.join(ADAPTER_FILES)}), or train first.")
    return folder


def adapter_base_model(adapter_dir: str | Path) -> str:
    """The base model the adapter was trained on, as its adapter_config.json records it."""
    config = json.loads((check_adapter(adapter_dir) / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise FreetuneError(f"{adapter_dir}/adapter_config.json does not name its base model: pass `base` "
                            f"explicitly (the model id the adapter was trained on).")
    return base


def save_adapter(trainer_or_model, tokenizer, out_dir: str | Path, *, is_main_process: bool | None = None):
    """Save the LoRA adapter and tokenizer to out_dir on the main process; returns the folder (None elsewhere).

    Takes a Trainer (uses save_model, which unwraps DDP) or a PEFT model. Only the adapter weights are written:
    a few MB, so this runs before anything that could run out of memory or disk.
    """
    if hasattr(trainer_or_model, "is_world_process_zero") and is_main_process is None:
        is_main_process = trainer_or_model.is_world_process_zero()
    if not _is_main(is_main_process):
        return None
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(trainer_or_model, "save_model"):
        trainer_or_model.save_model(str(out))
    else:
        trainer_or_model.save_pretrained(str(out))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(out))
    return check_adapter(out)
