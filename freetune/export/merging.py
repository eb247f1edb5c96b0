"""Merge the adapter into a 16-bit copy of its base, after checking that the copy fits.

The base is loaded in 16-bit, never 4-bit (merging into quantised weights rounds the LoRA update away), on the GPU
when a copy fits in its free memory, else on the CPU. A 7B model's merged copy is ~15 GB of RAM and disk; Kaggle's
working folder holds 20 GB in all.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from freetune import resources
from freetune.errors import FreetuneError
from freetune.export.adapter import adapter_base_model, check_adapter
from freetune.resources import GB, size_text
from freetune.secrets import redact


MERGED_MARKER = ".freetune-merged.json"  # written last: a folder without it is not a finished merge
_BYTES_PER_PARAM = {"float16": 2, "bfloat16": 2, "float32": 4}
# Headroom on top of the weights: Python, torch and the tokenizer (~1.5 GB of RAM), one saved shard held in
# memory while written (the merge saves 2 GB shards), and allocator slack.
_RAM_OVERHEAD = 1.5 * GB
_SHARD_BYTES = 2 * GB
_VRAM_OVERHEAD = 0.8 * GB
_DISK_OVERHEAD = 0.1 * GB  # tokenizer, configs


@dataclass
class MergePlan:
    """What a merge needs and has. `problems` says, per thing that will not fit, what to change."""

    base: str
    out_dir: str
    dtype: str
    params: int
    weights_bytes: int      # the merged copy's size: params x bytes per param
    ram_needed: int         # on the chosen device's path (CPU: the whole copy; GPU: one shard on its way to disk)
    ram_free: int
    disk_needed: int
    disk_free: int
    vram_needed: int
    vram_free: int          # 0 without a GPU
    device: str             # "cuda:N" or "cpu": where the merge runs
    problems: list[str] = field(default_factory=list)
    reasons: dict = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return not self.problems

    def table(self) -> str:
        rows = [("merged copy", f"{self.params / 1e9:.2f}B parameters in {self.dtype}",
                 size_text(self.weights_bytes)),
                ("RAM", f"needs {size_text(self.ram_needed)}", f"{size_text(self.ram_free)} free"),
                ("disk", f"needs {size_text(self.disk_needed)} in {self.out_dir}",
                 f"{size_text(self.disk_free)} free")]
        if self.vram_free:
            rows.append(("GPU memory", f"needs {size_text(self.vram_needed)}", f"{size_text(self.vram_free)} free"))
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [f"{a.ljust(width[0])}  {b.ljust(width[1])}  {c}" for a, b, c in rows]
        lines.append(f"merge on: {self.device} ({self.reasons.get('device', '')})")
        lines += [f"WILL NOT FIT: {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _load_config(base: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(base)
    except (OSError, ValueError) as exc:
        raise FreetuneError(f"Could not read the config of base model {base!r}: {redact(str(exc))[:300]}. Check "
                            f"the model id (the one the adapter was trained on) and that this machine is online.") \
            from exc


def count_parameters(base: str) -> int:
    """The base model's parameter count, from its config alone (built on the meta device: no weights, no RAM)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = _load_config(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once


def plan_merge(base: str, out_dir: str | Path, *, dtype: str = "float16", device: str = "auto",
               free_ram_bytes: int | None = None, free_disk_bytes: int | None = None,
               free_vram_bytes: int | None = None) -> MergePlan:
    """Estimate RAM, GPU memory and disk for a 16-bit merged copy of `base`, compare with what is free, and pick
    where to merge. Loads the config only. The free_* arguments replace what the machine reports (tests, or
    planning for another machine).

    device: "auto" (the GPU if the copy fits in its free memory, else the CPU), "cpu", or "cuda"/"cuda:N".
    """
    if dtype not in _BYTES_PER_PARAM:
        raise FreetuneError(f"dtype must be one of {sorted(_BYTES_PER_PARAM)}, not {dtype!r}. float16 is what "
                            f"llama.cpp's converter and every GPU read; bfloat16 keeps a bf16 model's exact range.")
    _refuse_quantised(base, _load_config(base))
    params = count_parameters(base)
    weights = params * _BYTES_PER_PARAM[dtype]
    ram_free, disk_free, vram_free, gpu_index = _what_is_free(out_dir, free_ram_bytes, free_disk_bytes,
                                                              free_vram_bytes)
    vram_needed = int(weights * 1.1 + _VRAM_OVERHEAD)
    gpu_ram_needed = int(min(weights, _SHARD_BYTES) + _RAM_OVERHEAD)
    cpu_ram_needed = int(weights * 1.1 + _RAM_OVERHEAD)
    disk_needed = int(weights + _DISK_OVERHEAD)

    device, reason, problems = _merge_device(device, vram_free, vram_needed, gpu_index)
    ram_needed = gpu_ram_needed if device.startswith("cuda") else cpu_ram_needed
    if ram_free < ram_needed:
        problems.append(
            f"Merging on the {'GPU' if device.startswith('cuda') else 'CPU'} needs about {size_text(ram_needed)} of "
            f"RAM ({params / 1e9:.2f}B parameters x {_BYTES_PER_PARAM[dtype]} bytes, plus headroom); "
            f"{size_text(ram_free)} is free. Merge on a GPU with {size_text(vram_needed)} free, on a machine with "
            f"more RAM (Kaggle has about 30 GB, Colab's free tier 12 GB), or skip the merge and ship the adapter "
            f"alone.")
    if disk_free < disk_needed:
        problems.append(
            f"The merged copy needs about {size_text(disk_needed)} of disk in {out_dir}; {size_text(disk_free)} is "
            f"free (Kaggle's /kaggle/working holds 20 GB in all). Choose an out_dir on a bigger disk (Kaggle: /tmp, "
            f"not kept after the session), delete old checkpoints, or skip the merge.")
    return MergePlan(base=str(base), out_dir=str(out_dir), dtype=dtype, params=params, weights_bytes=weights,
                     ram_needed=ram_needed, ram_free=ram_free, disk_needed=disk_needed, disk_free=disk_free,
                     vram_needed=vram_needed, vram_free=vram_free, device=device, problems=problems,
                     reasons={"device": reason})


def _refuse_quantised(base: str, config) -> None:
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None)) or "4-bit"
        raise FreetuneError(
            f"{base!r} is stored {method}-quantised. Merging the adapter into quantised weights rounds its update "
            f"away. Merge into the original 16-bit model instead (for example the same name without '-bnb-4bit'); "
            f"the adapter works on either.")


def _what_is_free(out_dir: str | Path, ram: int | None, disk: int | None, vram: int | None
                  ) -> tuple[int, int, int, int]:
    """(RAM, disk, GPU memory free, GPU index): what this machine reports, where no figure is given."""
    ram_free = (resources.ram_bytes()[1] or 0) if ram is None else int(ram)
    disk_free = resources.free_disk_bytes(out_dir) if disk is None else int(disk)
    previous = Path(out_dir).expanduser()
    if (previous / MERGED_MARKER).exists():  # an earlier merge there is replaced: its space counts as free
        disk_free += resources.folder_bytes(previous)
    vram_free, gpu_index = resources.free_vram_bytes()
    if vram is not None:
        vram_free, gpu_index = int(vram), max(gpu_index, 0)
    return ram_free, disk_free, vram_free, gpu_index


def _merge_device(device: str, vram_free: int, vram_needed: int, gpu_index: int) -> tuple[str, str, list[str]]:
    """(where to merge, why, problems): "auto" takes the GPU when the copy fits its free memory."""
    if device == "auto":
        if vram_free >= vram_needed:
            return f"cuda:{gpu_index}", "the 16-bit copy fits in the GPU's free memory", []
        return "cpu", ("no GPU" if not vram_free else
                       f"the GPU has {size_text(vram_free)} free, the copy needs {size_text(vram_needed)}"), []
    if device.startswith("cuda") and vram_free < vram_needed:
        return device, "asked for", [
            f"Merging on the GPU needs about {size_text(vram_needed)} of GPU memory; {size_text(vram_free)} is free. "
            f"Use device='cpu' (or 'auto'), or free the GPU first: delete the training model (`del model, trainer; "
            f"freetune.resources.release_memory()`) or restart."]
    return device, "asked for", []


def _check_merge_target(out: Path, adapter: Path) -> None:
    if resources.inside(out, adapter) or resources.inside(adapter, out):
        raise FreetuneError(f"out_dir {str(out)!r} and the adapter folder {str(adapter)!r} overlap. Merge into a "
                            f"folder of its own (e.g. next to the adapter: '<run>/merged'); the adapter is kept as is.")
    if out.exists() and any(out.iterdir()) and not (out / MERGED_MARKER).exists():
        raise FreetuneError(f"out_dir {str(out)!r} already holds files that are not a freetune merge. Choose an "
                            f"empty or new folder; nothing was replaced.")


def merge(base: str | None, adapter_dir: str | Path, out_dir: str | Path, *, dtype: str = "float16",
          device: str = "auto", plan: MergePlan | None = None, **free_overrides) -> Path:
    """Merge the LoRA adapter into a 16-bit copy of `base` and save it (safetensors + tokenizer) to out_dir.

    base: the model id or folder the adapter was trained on (None: the one adapter_config.json names).
    device: "auto" picks the GPU when the copy fits its free memory, else the CPU (see plan_merge).
    free_overrides: free_ram_bytes / free_disk_bytes / free_vram_bytes, passed to plan_merge.
    A merge that cannot fit is refused before anything is loaded; the adapter folder is never written to.
    """
    import torch

    adapter = check_adapter(adapter_dir)
    base = base or adapter_base_model(adapter)
    out = Path(out_dir).expanduser()
    _check_merge_target(out, adapter)
    plan = plan or plan_merge(base, out, dtype=dtype, device=device, **free_overrides)
    if not plan.fits:
        raise FreetuneError("The merge will not fit, so nothing was loaded or written:\n  - "
                            + "\n  - ".join(plan.problems) + f"\nThe adapter is safe at {adapter}.")
    print(plan.table(), flush=True)

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if out.exists():
        shutil.rmtree(out)  # an earlier merge (checked above), re-creatable from the adapter: make room first
    out.parent.mkdir(parents=True, exist_ok=True)
    # Written under a temporary name and renamed when complete: a crash never leaves a folder that looks merged.
    partial = Path(tempfile.mkdtemp(prefix=f".{out.name}-partial-", dir=out.parent))
    model = None
    try:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=getattr(torch, plan.dtype),
                                                     device_map={"": plan.device})
        model = PeftModel.from_pretrained(model, str(adapter))
        # safe_merge checks each merged weight for NaN/inf before replacing the original.
        model = model.merge_and_unload(safe_merge=True)
        model.save_pretrained(str(partial), max_shard_size=f"{_SHARD_BYTES / GB:.0f}GB")
        has_tokenizer = (adapter / "tokenizer_config.json").exists()
        AutoTokenizer.from_pretrained(str(adapter) if has_tokenizer else base).save_pretrained(str(partial))
        (partial / MERGED_MARKER).write_text(json.dumps(
            {"base": str(base), "adapter": str(adapter), "dtype": plan.dtype}, indent=2))
    except (OSError, RuntimeError, ValueError, MemoryError) as exc:
        shutil.rmtree(partial, ignore_errors=True)
        hint = ""
        if "out of memory" in str(exc).lower() or isinstance(exc, MemoryError):
            hint = ("Out of memory: free the GPU first (`del model, trainer; freetune.resources.release_memory()`), "
                    "or merge with device='cpu' on a machine with more RAM.\n")
        raise FreetuneError(f"The merge failed: {redact(str(exc))[:500]}\n{hint}Nothing was written to {out}; the "
                            f"adapter is safe at {adapter}.") from exc
    finally:
        del model
        resources.release_memory()
    partial.rename(out)
    print(f"Merged model: {out} ({size_text(resources.folder_bytes(out))})", flush=True)
    return out
