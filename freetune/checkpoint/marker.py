"""Complete-or-ignored checkpoints: the marker a complete one carries, and the newest one that is really complete.

The Trainer writes checkpoint-N/ file by file; only after all of it, and after every rank has finished its part (a
barrier), the main process writes `freetune_complete.json` (`write_marker`): the step and every file's size. A
folder without that marker, or whose files no longer match it, is incomplete: the resume deletes it and never
loads it (freetune.checkpoint.resume). freetune.trainer.FreetuneTrainer._save_checkpoint calls these in that order;
freetune.checkpoint's docstring says what a kill at each point of a save leaves behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

MARKER = "freetune_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Scratch folders: a checkpoint being deleted, one being downloaded from the Hub, the run's tokenizer being written
# (freetune.trainer.save_tokenizer_once). Never loaded, removed on resume.
_SCRATCH_PREFIXES = (".deleting-", ".download-", ".writing-")


# ---- Completeness -------------------------------------------------------------------------------------------

def checkpoint_step(path: str | Path) -> int | None:
    match = _CHECKPOINT.match(Path(path).name)
    return int(match.group(1)) if match else None


def check_complete(folder: str | Path) -> tuple[bool, str]:
    """(complete?, why): the marker exists, names this step, and every file it lists has the recorded size."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        return False, "no completion marker (its save was interrupted)"
    try:
        info = json.loads(marker.read_text())
        files = dict(info["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False, "unreadable completion marker"
    if info.get("step") != checkpoint_step(folder):
        return False, f"its marker is for step {info.get('step')}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return False, f"{name} is missing"
        if path.stat().st_size != size:
            return False, f"{name} has {path.stat().st_size} bytes, the marker says {size}"
    return True, f"complete: step {info['step']}, {len(files)} files"


def _required_files(world_size: int) -> list[str]:
    rng = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{rank}.pth" for rank in range(world_size)]
    return ["trainer_state.json", "optimizer.pt", "scheduler.pt", *rng]


def write_marker(folder: str | Path, step: int, world_size: int) -> Path:
    """Declare checkpoint-N complete: flush every file to disk, then write the marker atomically (temp + rename)."""
    folder = Path(folder)
    # FSDP (FULL_STATE_DICT) saves the gathered optimizer state as optimizer.bin, written by rank 0 alone,
    # beside pytorch_model_fsdp.bin (the adapter for the resume); DDP and one process save optimizer.pt.
    fsdp_optimizer = (folder / "optimizer.bin").is_file()
    missing = [name for name in _required_files(world_size) if not (folder / name).is_file()
               and not (name == "optimizer.pt" and fsdp_optimizer)]
    if not any(folder.glob("*.safetensors")):
        missing.append("the adapter weights (*.safetensors)")
    if missing:
        # A bug, not a user error: declaring this checkpoint complete would make a later resume load garbage.
        raise RuntimeError(f"{folder} lacks {missing} after the Trainer saved it; not marking it complete.")
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        _fsync(path)
        files[path.relative_to(folder).as_posix()] = path.stat().st_size
    info = {"step": step, "world_size": world_size, "files": files, "written_at": time.time()}
    temporary = folder / f".{MARKER}.tmp"
    with open(temporary, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MARKER)
    _fsync(folder)
    return folder / MARKER


def _fsync(path: Path) -> None:
    # The page cache survives a killed process but not a lost machine; a marker must never reach the disk before
    # the files it vouches for.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some FUSE mounts (Drive) refuse fsync on directories; the rename order still holds there
    finally:
        os.close(fd)


def complete_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete checkpoint-N folders, oldest step first."""
    folder = Path(checkpoints_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and checkpoint_step(p) is not None and check_complete(p)[0]]
    return sorted(found, key=checkpoint_step)


def latest_complete(checkpoints_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def remove_incomplete(checkpoints_dir: str | Path) -> list[str]:
    """Delete interrupted saves and scratch folders (they are never loaded); returns what was removed and why.

    Deleted rather than moved aside: an incomplete checkpoint cannot be repaired, and on Drive each one can weigh
    as much as the optimizer state (hundreds of MB), many times over after repeated disconnects.
    """
    folder = Path(checkpoints_dir)
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith(_SCRATCH_PREFIXES):
            reason = "a leftover of an interrupted rotation, download or tokenizer save"
        elif checkpoint_step(path) is not None:
            complete, reason = check_complete(path)
            if complete:
                continue
        else:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"{path.name} ({reason})")
    return removed


def rotate(checkpoints_dir: str | Path, keep: int, protect: set[str] = frozenset()) -> list[str]:
    """Delete the oldest complete checkpoints beyond `keep` (run only after the newest one's marker is written).

    protect: folder names still being uploaded to the Hub. Each victim is first renamed aside, so a kill halfway
    through the deletion leaves a scratch folder, never a half-deleted folder named like a checkpoint.
    """
    complete = complete_checkpoints(checkpoints_dir)
    victims = [p for p in complete[:-keep] if p.name not in protect] if keep > 0 else []
    for path in victims:
        _discard(path)
    return [p.name for p in victims]


def _discard(path: Path) -> None:
    aside = path.with_name(".deleting-" + path.name)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def weights_finite(model) -> bool:
    """Whether every trainable weight is finite, on every rank (one host sync: for saves, not for every step)."""
    import torch
    import torch.distributed as dist

    weights = [p for p in model.parameters() if p.requires_grad]
    if not weights:
        return True
    finite = torch.stack([torch.isfinite(p).all() for p in weights]).all().to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # FSDP: each rank holds a shard; all stop or none
    return bool(finite.item())

