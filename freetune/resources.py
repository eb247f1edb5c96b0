"""What this machine has free right now: RAM, disk (Kaggle's working-folder quota counted) and GPU memory; and
handing a finished model's memory back. The preflight reads these before training, the export before it merges or
converts, so both see the same numbers.

Sizes are in bytes here; GB (decimal, as disks and Kaggle's 20 GB quota are counted) is what `size_text` shows.
"""

from __future__ import annotations

import gc
import os
import shutil
from pathlib import Path

GB = 1e9
# Kaggle keeps at most 20 GB of files in /kaggle/working, whatever the disk under it reports as free.
KAGGLE_WORKING = Path("/kaggle/working")
KAGGLE_WORKING_QUOTA = 20 * GB


def size_text(n_bytes: float) -> str:
    """'15.2 GB', or '350 MB' under a tenth of a GB."""
    return f"{n_bytes / GB:.1f} GB" if n_bytes >= 0.1 * GB else f"{n_bytes / 1e6:.0f} MB"


def ram_bytes() -> tuple[int | None, int | None]:
    """(total, available) bytes of RAM; None for what this machine does not say. Available counts the page cache
    the kernel can drop (MemAvailable), as psutil does."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) for line in f if line.strip()}
        return info["MemTotal"] * 1024, info.get("MemAvailable", info["MemFree"]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        pass
    try:
        import psutil  # accelerate's dependency: present wherever training is installed

        memory = psutil.virtual_memory()
        return int(memory.total), int(memory.available)
    except ImportError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), None
    except (ValueError, OSError, AttributeError):
        return None, None


def inside(child: Path, parent: Path) -> bool:
    """Whether `child` is `parent` or lies under it (links resolved)."""
    child, parent = Path(child).resolve(), Path(parent).resolve()
    return child == parent or parent in child.parents


def folder_bytes(folder: Path) -> int:
    """The size of the files under `folder` (links not followed)."""
    return sum(f.stat().st_size for f in Path(folder).rglob("*") if f.is_file() and not f.is_symlink())


def free_disk_bytes(path: str | Path) -> int:
    """Bytes that files written under `path` can take: the free space of the disk it is (or will be) on, and inside
    Kaggle's working folder no more than its quota leaves. Raises OSError when the disk cannot be read."""
    probe = Path(path).expanduser().absolute()
    while not probe.exists():  # the folder may not exist yet: ask the disk it will be created on
        probe = probe.parent
    free = int(shutil.disk_usage(probe).free)
    if KAGGLE_WORKING.exists() and inside(probe, KAGGLE_WORKING):
        free = min(free, int(KAGGLE_WORKING_QUOTA - folder_bytes(KAGGLE_WORKING)))
    return max(free, 0)


def free_vram_bytes() -> tuple[int, int]:
    """(free bytes, device index) of the GPU with the most free memory; (0, -1) without one."""
    try:
        import torch
    except ImportError:
        return 0, -1
    if not torch.cuda.is_available():
        return 0, -1
    return max((torch.cuda.mem_get_info(i)[0], i) for i in range(torch.cuda.device_count()))


def release_memory() -> None:
    """After `del model`: collect the garbage that still holds its tensors (a model's reference cycles), then give
    the CUDA cache back, so the next load, or another process, finds the memory free."""
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
