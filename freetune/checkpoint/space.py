"""Disk space: what a run will write (checkpoints, the adapter, the export) checked against the free space before
the model loads, and a disk that fills up anyway (another process, a Drive quota) reported as such.

Without this a full disk ended the run mid-training with the tokenizers library's raw "No space left on device
(os error 28)": no folder, no size, no word on whether the checkpoints were still good. They are: a checkpoint is
complete only after its marker (freetune.checkpoint.marker), so the one being written when the disk filled is
never loaded, and the last complete one is.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

from freetune.checkpoint.marker import complete_checkpoints, latest_complete
from freetune.distributed import print0
from freetune.errors import FreetuneError
from freetune.resources import folder_bytes, free_disk_bytes, size_text

SMALL_FILES = 50e6  # trainer state, scheduler, RNG, configs, the run's tokenizer (once), reports: a generous bound


def _shape(model_id: str):
    """The model's shape from its config (a local folder, a known name, or the Hub cache); None if unknown."""
    from freetune.plan import ModelShape

    try:
        return ModelShape.named(model_id)
    except (KeyError, OSError, ValueError):
        pass
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_id, "config.json")
        return ModelShape.from_config(json.loads(Path(cached).read_text()), name=model_id) if isinstance(
            cached, str) else None
    except Exception:  # no cache, an odd config: the check steps aside (it says so)
        return None


def needed_bytes(params: dict, shape, optimizer: str) -> dict[str, float]:
    """What the run writes, by part: checkpoints (save_total_limit kept, plus the one written before the oldest
    is rotated out), the adapter, and the export (merged 16-bit copy, f16 and q8_0 GGUF) when export_gguf is on."""
    try:
        lora = shape.lora_params(params.get("lora_rank", 16), params.get("lora_targets", "all-linear"))
    except ValueError:  # a regular expression of module names: every linear layer bounds it
        lora = shape.lora_params(params.get("lora_rank", 16))
    from freetune.plan.memory import OPTIMIZER_STATE_BYTES

    one_checkpoint = lora * (4 + OPTIMIZER_STATE_BYTES.get(optimizer, 8)) + SMALL_FILES  # fp32 adapter + its state
    parts = {"checkpoints": (params.get("save_total_limit", 3) + 1) * one_checkpoint,
             "adapter": lora * 4 + SMALL_FILES}
    if params.get("export_gguf"):
        parts["export"] = shape.total_params * (2 + 2 + 1.07)
    return parts


def check_disk(paths, params: dict, plan) -> None:
    """Before the model loads: refuse when the run folder's disk cannot hold what the run will write (the space its
    complete checkpoints already take is counted as available: new ones replace them)."""
    shape = _shape(params.get("model_id", ""))
    if shape is None:
        print0("Disk: the model's size is not known before it loads; free space is not checked ahead.")
        return
    parts = needed_bytes(params, shape, plan.memory.optimizer)
    reusable = sum(folder_bytes(p) for p in complete_checkpoints(paths.checkpoints))
    needed = sum(parts.values()) - reusable
    try:
        free = free_disk_bytes(paths.run_dir)
    except OSError:
        return
    if free >= needed:
        return
    shown = ", ".join(f"{name} {size_text(size)}" for name, size in parts.items())
    fixes = ["free space on that disk", "set output_dir to a folder on a larger disk"]
    if parts.get("export"):
        fixes.append("set export_gguf to False (the merged model and its GGUF files need "
                     f"{size_text(parts['export'])})")
    if params.get("save_total_limit", 2) > 2:  # only where the parameters cell has it
        fixes.append("keep fewer checkpoints (save_total_limit 2)")
    raise FreetuneError(f"Not enough disk for this run in {paths.run_dir}: it needs about {size_text(needed)} "
                        f"({shown}), {size_text(free)} is free. Either " + ", or ".join(fixes) + ".")


def is_disk_full(exc: BaseException) -> bool:
    """Whether an exception (or one it was raised from) says the disk is full: OSError errno 28, or a library's
    own words for it (the tokenizers library raises a plain Exception, torch.save a RuntimeError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)
        if "No space left on device" in text or "os error 28" in text or "Disk quota exceeded" in text:
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def disk_full_message(checkpoints_dir: str, needed: float | None = None) -> str:
    """A full disk mid-run: which folder, how much it needs, and what was kept."""
    kept = latest_complete(checkpoints_dir)
    try:
        free = f"{size_text(free_disk_bytes(checkpoints_dir))} is free now"
    except OSError:
        free = "its free space cannot be read"
    need = f"; a checkpoint of this run takes about {size_text(needed)}" if needed else ""
    kept_text = (f"The last complete checkpoint, {kept.name}, is intact (the one being written has no completion "
                 f"marker and is never loaded): free space, then run this again with the same run_name to resume "
                 f"from it." if kept else "No checkpoint was complete yet: free space and run this again.")
    return (f"The disk under {checkpoints_dir} is full ({free}{need}). {kept_text} Or set output_dir to a folder "
            f"on a larger disk (a new run then starts at step 0).")
