"""Ship the adapter: keep it, merge it into a 16-bit base, convert to GGUF, run it with Ollama, share it on the Hub.

The order is the order of risk. The adapter (a few MB to a few hundred) is saved first and never touched again;
everything after it needs far more memory and disk, so each step checks what it needs before starting and says
what will not fit, and a failure leaves the adapter where it was.

- merge: the base is loaded in 16-bit, never 4-bit (merging into quantised weights rounds the LoRA update
  away), on the GPU when a copy fits in its free memory, else on the CPU. A 7B model's merged copy is ~15 GB of
  RAM and disk; Kaggle's working folder holds 20 GB in all.
- GGUF: llama.cpp's own `convert_hf_to_gguf.py` writes f16 / q8_0; `llama-quantize` (compiled llama.cpp) makes
  q4_k_m when present, else Ollama makes it from the f16 file (`ollama create -q q4_K_M -f Modelfile.f16`). The
  converter comes from llama.cpp itself (a clone, or the copy vendored in the `llama-cpp-python` source
  distribution on PyPI: `fetch_converter`), never from a home-made writer.
- Ollama: a Modelfile whose TEMPLATE is the Go-template twin of the model's chat template when that is one freetune
  trains with (freetune.templates: ChatML, Llama 3, Zephyr; checked on a probe conversation before it is written),
  with its stop tokens and defaults.
- Hub: rank 0 only, the token from the platform's secrets, a model card recording how the adapter was made.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from freetune.chat import SAMPLING
from freetune.errors import FreetuneError
from freetune.params import HUB_ID as _HUB_ID
from freetune.secrets import hf_token, redact
from freetune.templates import Template
from freetune.templates import identify as identify_template

GB = 1e9  # sizes are shown in decimal GB, as disks and Kaggle's 20 GB quota are
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
MERGED_MARKER = ".freetune-merged.json"  # written last: a folder without it is not a finished merge


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / GB:.1f} GB" if n_bytes >= 0.1 * GB else f"{n_bytes / 1e6:.0f} MB"


def _is_main(is_main_process: bool | None) -> bool:
    if is_main_process is not None:
        return is_main_process
    return int(os.environ.get("RANK", 0)) == 0  # torchrun's global rank; alone, we are rank 0


# --------------------------------------------------------------------------------------------------------------
# The adapter
# --------------------------------------------------------------------------------------------------------------

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


# --------------------------------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------------------------------

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
        rows = [("merged copy", f"{self.params / 1e9:.2f}B parameters in {self.dtype}", _gb(self.weights_bytes)),
                ("RAM", f"needs {_gb(self.ram_needed)}", f"{_gb(self.ram_free)} free"),
                ("disk", f"needs {_gb(self.disk_needed)} in {self.out_dir}", f"{_gb(self.disk_free)} free")]
        if self.vram_free:
            rows.append(("GPU memory", f"needs {_gb(self.vram_needed)}", f"{_gb(self.vram_free)} free"))
        width = [max(len(r[i]) for r in rows) for i in range(2)]
        lines = [f"{a.ljust(width[0])}  {b.ljust(width[1])}  {c}" for a, b, c in rows]
        lines.append(f"merge on: {self.device} ({self.reasons.get('device', '')})")
        lines += [f"WILL NOT FIT: {p}" for p in self.problems]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


def _free_ram() -> int:
    import psutil  # accelerate's dependency, so always present with the train extra

    return int(psutil.virtual_memory().available)


# Kaggle keeps at most 20 GB of files in /kaggle/working, whatever the disk under it reports as free.
KAGGLE_WORKING = Path("/kaggle/working")
KAGGLE_WORKING_QUOTA = 20 * GB


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file() and not f.is_symlink())


def _free_disk(path: Path) -> int:
    probe = path.expanduser().absolute()
    while not probe.exists():  # the output folder may not exist yet: ask the disk it will live on
        probe = probe.parent
    free = int(shutil.disk_usage(probe).free)
    if KAGGLE_WORKING.exists() and _inside(probe, KAGGLE_WORKING):
        free = min(free, int(KAGGLE_WORKING_QUOTA - _folder_bytes(KAGGLE_WORKING)))
    return max(free, 0)


def _free_vram() -> tuple[int, int]:
    """(free bytes, device index) of the GPU with the most free memory; (0, -1) without one."""
    try:
        import torch
    except ImportError:
        return 0, -1
    if not torch.cuda.is_available():
        return 0, -1
    free = [(torch.cuda.mem_get_info(i)[0], i) for i in range(torch.cuda.device_count())]
    return max(free)


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
    config = _load_config(base)
    quantization = getattr(config, "quantization_config", None)
    if quantization:
        method = (quantization.get("quant_method") if isinstance(quantization, dict)
                  else getattr(quantization, "quant_method", None)) or "4-bit"
        raise FreetuneError(
            f"{base!r} is stored {method}-quantised. Merging the adapter into quantised weights rounds its update "
            f"away. Merge into the original 16-bit model instead (for example the same name without '-bnb-4bit'); "
            f"the adapter works on either.")
    params = count_parameters(base)
    weights = params * _BYTES_PER_PARAM[dtype]
    ram_free = _free_ram() if free_ram_bytes is None else int(free_ram_bytes)
    disk_free = _free_disk(Path(out_dir)) if free_disk_bytes is None else int(free_disk_bytes)
    previous = Path(out_dir).expanduser()
    if (previous / MERGED_MARKER).exists():  # an earlier merge there is replaced: its space counts as free
        disk_free += _folder_bytes(previous)
    vram_free, gpu_index = _free_vram()
    if free_vram_bytes is not None:
        vram_free, gpu_index = int(free_vram_bytes), max(gpu_index, 0)

    vram_needed = int(weights * 1.1 + _VRAM_OVERHEAD)
    gpu_ram_needed = int(min(weights, _SHARD_BYTES) + _RAM_OVERHEAD)
    cpu_ram_needed = int(weights * 1.1 + _RAM_OVERHEAD)
    disk_needed = int(weights + _DISK_OVERHEAD)
    problems, reasons = [], {}

    if device == "auto":
        if vram_free >= vram_needed:
            device, reasons["device"] = f"cuda:{gpu_index}", "the 16-bit copy fits in the GPU's free memory"
        else:
            reasons["device"] = ("no GPU" if not vram_free else
                                 f"the GPU has {_gb(vram_free)} free, the copy needs {_gb(vram_needed)}")
            device = "cpu"
    elif device.startswith("cuda"):
        if vram_free < vram_needed:
            problems.append(f"Merging on the GPU needs about {_gb(vram_needed)} of GPU memory; {_gb(vram_free)} "
                            f"is free. Use device='cpu' (or 'auto'), or free the GPU first: delete the training "
                            f"model (`del model, trainer; gc.collect(); torch.cuda.empty_cache()`) or restart.")
        reasons["device"] = "asked for"
    else:
        reasons["device"] = "asked for"
    ram_needed = gpu_ram_needed if device.startswith("cuda") else cpu_ram_needed
    if ram_free < ram_needed:
        problems.append(
            f"Merging on the {'GPU' if device.startswith('cuda') else 'CPU'} needs about {_gb(ram_needed)} of RAM "
            f"({params / 1e9:.2f}B parameters x {_BYTES_PER_PARAM[dtype]} bytes, plus headroom); {_gb(ram_free)} "
            f"is free. Merge on a GPU with {_gb(vram_needed)} free, on a machine with more RAM (Kaggle has about "
            f"30 GB, Colab's free tier 12 GB), or skip the merge and ship the adapter alone.")
    if disk_free < disk_needed:
        problems.append(
            f"The merged copy needs about {_gb(disk_needed)} of disk in {out_dir}; {_gb(disk_free)} is free "
            f"(Kaggle's /kaggle/working holds 20 GB in all). Choose an out_dir on a bigger disk (Kaggle: /tmp, "
            f"not kept after the session), delete old checkpoints, or skip the merge.")
    return MergePlan(base=str(base), out_dir=str(out_dir), dtype=dtype, params=params, weights_bytes=weights,
                     ram_needed=ram_needed, ram_free=ram_free, disk_needed=disk_needed, disk_free=disk_free,
                     vram_needed=vram_needed, vram_free=vram_free, device=device, problems=problems,
                     reasons=reasons)


def _inside(child: Path, parent: Path) -> bool:
    child, parent = child.resolve(), parent.resolve()
    return child == parent or parent in child.parents


def _check_merge_target(out: Path, adapter: Path) -> None:
    if _inside(out, adapter) or _inside(adapter, out):
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
    import gc

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
            hint = ("Out of memory: free the GPU first (delete the training model and trainer, gc.collect(), "
                    "torch.cuda.empty_cache()), or merge with device='cpu' on a machine with more RAM.\n")
        raise FreetuneError(f"The merge failed: {redact(str(exc))[:500]}\n{hint}Nothing was written to {out}; the "
                            f"adapter is safe at {adapter}.") from exc
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    partial.rename(out)
    print(f"Merged model: {out} ({_gb(sum(f.stat().st_size for f in out.iterdir()))})", flush=True)
    return out


# --------------------------------------------------------------------------------------------------------------
# GGUF, with llama.cpp's own converter
# --------------------------------------------------------------------------------------------------------------

# llama-cpp-python's source distribution vendors llama.cpp, converter and gguf-py included: a PyPI download
# instead of a git clone. 0.3.36 converts Qwen2/2.5/3 and Llama with transformers 5.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CONVERTER = "convert_hf_to_gguf.py"
# The parts of llama.cpp the converter imports, and what it needs to be installed.
_CONVERTER_PARTS = (CONVERTER, "conversion/", "gguf-py/", "requirements/", "requirements.txt", "LICENSE")
CONVERTER_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# Size of one GGUF relative to the parameter count, in bytes per parameter (q8_0 stores 34 bytes per 32 weights,
# q4_k_m ~4.9 bits per weight with its scales; small tensors stay f32 and add a little).
_GGUF_BYTES_PER_PARAM = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.07, "q6_k": 0.83, "q5_k_m": 0.72,
                         "q4_k_m": 0.62, "q4_0": 0.57}
GET_CONVERTER_HELP = (
    "Get llama.cpp's converter one of these ways:\n"
    "  - `python scripts/get_llama_cpp_converter.py`, or in a notebook `freetune.export.fetch_converter()`: "
    f"downloads llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s source from PyPI and keeps only the converter "
    "(in ~/.cache/freetune/llama.cpp, found without further settings);\n"
    "  - on Colab or Kaggle: `!git clone --depth 1 https://github.com/ggml-org/llama.cpp` and "
    "`!pip install sentencepiece`, then pass converter='llama.cpp' (or set FREETUNE_LLAMA_CPP to the folder). "
    "Do not `pip install -r` llama.cpp's requirements there: they pin a CPU build of torch and an older "
    "transformers, which would replace the notebook's own.")
# llama.cpp's k-quants (q4_k_m) come only from its compiled llama-quantize: gguf-py quantises q8_0 but no k-quant, and
# PyPI's llama-cpp-python ships a source distribution only (a C++ build of llama.cpp: minutes of every CI run and of a
# free notebook's two cores). Ollama quantises an f16 GGUF itself on import, so that is the one step offered instead.
Q4_K_M_BY_OLLAMA = ("q4_k_m (the size Ollama users pull) needs llama.cpp's compiled llama-quantize, which no PyPI "
                    "package ships ready to run; Ollama makes it from the f16 GGUF: see the `ollama create -q q4_K_M` "
                    "line below.")
GET_QUANTIZE_HELP = (
    "q4_k_m needs llama.cpp's compiled `llama-quantize`. Build it (a few minutes) with "
    "`git clone --depth 1 https://github.com/ggml-org/llama.cpp && cmake -S llama.cpp -B llama.cpp/build "
    "-DLLAMA_CURL=OFF && cmake --build llama.cpp/build --target llama-quantize -j`, then put llama.cpp/build/bin "
    "on PATH or pass quantize_tool=. Ollama can also quantise on import: `ollama create NAME -q q4_K_M -f "
    "Modelfile` from the f16 GGUF.")


def converter_cache_dir() -> Path:
    """Where fetch_converter keeps llama.cpp's converter ($FREETUNE_CACHE/llama.cpp, else ~/.cache/freetune/...)."""
    root = os.environ.get("FREETUNE_CACHE") or str(Path.home() / ".cache" / "freetune")
    return Path(root).expanduser() / "llama.cpp"


def fetch_converter(dest: str | Path | None = None, version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Download llama-cpp-python's source distribution from PyPI and keep only llama.cpp's converter, its
    `conversion` package, gguf-py and requirements in dest (default: converter_cache_dir()). Returns the
    converter's path. Done once: a finished folder carries a marker naming its version."""
    import tarfile

    dest = Path(dest).expanduser() if dest else converter_cache_dir()
    marker = dest / f".complete-llama-cpp-python-{version}"
    if marker.exists():
        return dest / CONVERTER
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
               f"llama-cpp-python=={version}", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        archives = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not archives:
            raise FreetuneError(f"Could not download llama-cpp-python=={version}'s source from PyPI "
                                f"(`{' '.join(cmd[2:])}` said: {(done.stderr or done.stdout).strip()[-500:]}). "
                                f"Check that this machine reaches PyPI.\n{GET_CONVERTER_HELP}")
        prefix = f"{archives[0].name[:-len('.tar.gz')]}/vendor/llama.cpp/"
        staging = Path(tmp) / "llama.cpp"
        with tarfile.open(archives[0]) as archive:
            members = []
            for member in archive.getmembers():
                rel = member.name[len(prefix):] if member.name.startswith(prefix) else None
                if rel and (member.isfile() or member.isdir()) and any(
                        rel == part or rel.startswith(part) for part in _CONVERTER_PARTS):
                    member.name = rel
                    members.append(member)
            extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(staging, members=members, **extra)
        if not (staging / CONVERTER).is_file():
            raise FreetuneError(f"llama-cpp-python=={version}'s source has no vendor/llama.cpp/{CONVERTER}. "
                                f"Pick another version.\n{GET_CONVERTER_HELP}")
        (staging / marker.name).write_text(f"from llama-cpp-python=={version} (PyPI source distribution)\n")
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    return dest / CONVERTER


def find_converter(converter: str | Path | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py: from `converter` (the file or its llama.cpp folder), else
    $FREETUNE_LLAMA_CPP, else fetch_converter's cache, else ./llama.cpp (a clone in the notebook's folder)."""
    def as_script(path: str | Path) -> Path:
        path = Path(path).expanduser()
        return path if path.suffix == ".py" else path / CONVERTER

    if converter is not None:
        candidates = [("the converter argument", as_script(converter))]
    else:
        candidates = [("FREETUNE_LLAMA_CPP", as_script(os.environ["FREETUNE_LLAMA_CPP"]))] \
            if os.environ.get("FREETUNE_LLAMA_CPP") else []
        candidates += [("fetch_converter's cache", converter_cache_dir() / CONVERTER),
                       ("./llama.cpp", Path("llama.cpp") / CONVERTER)]
    for _, path in candidates:
        if path.is_file():
            return path.absolute()
    looked = "; ".join(f"{name}: {path}" for name, path in candidates)
    raise FreetuneError(f"llama.cpp's converter ({CONVERTER}) was not found (looked at {looked}).\n"
                        f"{GET_CONVERTER_HELP}")


def find_quantize_tool(quantize_tool: str | Path | None = None, converter: Path | None = None) -> Path | None:
    """llama.cpp's llama-quantize: the given path, else on PATH, else built next to the converter."""
    if quantize_tool is not None:
        path = Path(quantize_tool).expanduser()
        if not path.is_file():
            raise FreetuneError(f"quantize_tool {str(path)!r} does not exist. {GET_QUANTIZE_HELP}")
        return path
    found = shutil.which("llama-quantize")
    if found:
        return Path(found)
    if converter is not None:
        built = converter.parent / "build" / "bin" / "llama-quantize"
        if built.is_file():
            return built
    return None


def _safetensors_params(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                shape = f.get_slice(key).get_shape()
                n = 1
                for dim in shape:
                    n *= dim
                total += n
    return total


_MISSING_MODULE = re.compile(r"No module named '([^']+)'")


def _run_logged(cmd: list[str], log_path: Path, what: str, keep_safe: str) -> None:
    """Run a llama.cpp tool, its output into log_path (the converter prints the whole chat template); on failure
    a FreetuneError with the last lines and what to do."""
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        done = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    if done.returncode == 0:
        return
    tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
    hint = ""
    missing = _MISSING_MODULE.findall(tail)
    if missing:
        package = missing[-1].split(".")[0]
        pin = "==0.2.3" if package == "sentencepiece" else ""  # the converter asks for sentencepiece < 0.3
        hint = (f"\nThe converter needs the Python package {package!r} in this environment: "
                f"`pip install {package}{pin}`, then run this again.")
    raise FreetuneError(f"{what} failed (exit {done.returncode}). Last lines:\n{redact(tail)}{hint}\n"
                        f"Full log: {log_path}. {keep_safe}")


def convert_to_gguf(merged_dir: str | Path, out_dir: str | Path, *, outtypes=("f16", "q8_0"),
                    quantize=("q4_k_m",), converter: str | Path | None = None,
                    quantize_tool: str | Path | None = None, name: str | None = None,
                    free_disk_bytes: int | None = None) -> list[Path]:
    """Convert a merged (16-bit, safetensors) model to GGUF with llama.cpp's convert_hf_to_gguf.py.

    outtypes: what the converter writes directly (f16, bf16, f32, q8_0).
    quantize: k-quants made from the f16 file by llama.cpp's llama-quantize, skipped with a message when the
      tool is missing (it is a compiled program, not part of the Python converter).
    Returns the GGUF files written, named <name>-<TYPE>.gguf (name: the merged folder's name).
    """
    merged = Path(merged_dir).expanduser()
    if not (merged / "config.json").is_file() or not list(merged.glob("*.safetensors")):
        raise FreetuneError(f"{str(merged)!r} is not a merged model folder (config.json and *.safetensors). Run "
                            f"freetune.export.merge first; GGUF conversion needs full weights, not an adapter.")
    bad = [t for t in outtypes if t not in CONVERTER_OUTTYPES]
    if bad:
        raise FreetuneError(f"outtypes {bad} are not written by the converter; use {CONVERTER_OUTTYPES} there and "
                            f"put k-quants such as 'q4_k_m' in `quantize`.")
    script = find_converter(converter)
    keep_safe = f"The merged model at {merged} is kept."
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    name = name or merged.name

    tool = find_quantize_tool(quantize_tool, script) if quantize else None
    if quantize and tool is None:
        print(f"Skipping {', '.join(quantize)}: {Q4_K_M_BY_OLLAMA}", flush=True)
        quantize = ()
    source_types = [t for t in outtypes if t in ("f16", "bf16", "f32")]
    intermediate = "f16" if quantize and not source_types else None

    params = _safetensors_params(merged)
    needed = sum(_GGUF_BYTES_PER_PARAM.get(t, 2.0) * params for t in (*outtypes, *quantize))
    needed += _GGUF_BYTES_PER_PARAM["f16"] * params if intermediate else 0
    free = _free_disk(out) if free_disk_bytes is None else int(free_disk_bytes)
    if free < needed:
        raise FreetuneError(f"The GGUF files ({', '.join((*outtypes, *quantize))}) need about {_gb(needed)} in "
                            f"{out}; {_gb(free)} is free. Convert fewer types (q8_0 alone is about half of f16), "
                            f"or choose an out_dir on a bigger disk. {keep_safe}")

    log_path = out / "convert.log"
    written: list[Path] = []
    for outtype in (*outtypes, *([intermediate] if intermediate else [])):
        target = out / f"{name}-{outtype.upper()}.gguf"
        print(f"Converting {merged.name} to {target.name} with llama.cpp's {CONVERTER} ...", flush=True)
        try:
            _run_logged([sys.executable, str(script), str(merged), "--outfile", str(target),
                         "--outtype", outtype], log_path, f"llama.cpp's converter ({outtype})", keep_safe)
        except FreetuneError:
            target.unlink(missing_ok=True)  # a half-written GGUF must not look like a result
            raise
        written.append(target)
    if quantize:
        source = next(p for p in written if p.name.endswith(tuple(f"-{t.upper()}.gguf"
                                                                   for t in ("f16", "bf16", "f32"))))
        for qtype in quantize:
            target = out / f"{name}-{qtype.upper()}.gguf"
            print(f"Quantising {source.name} to {target.name} with {tool.name} ...", flush=True)
            try:
                _run_logged([str(tool), str(source), str(target), qtype.upper()], log_path,
                            f"llama-quantize ({qtype})", keep_safe)
            except FreetuneError:
                target.unlink(missing_ok=True)
                raise
            written.append(target)
        if intermediate:
            source.unlink()
            written.remove(source)
    for path in written:
        print(f"  {path}  {_gb(path.stat().st_size)}", flush=True)
    return written


# --------------------------------------------------------------------------------------------------------------
# Ollama
# --------------------------------------------------------------------------------------------------------------

_END_MARKER = re.compile(r"end|eos|eot|^</s>$", re.I)


def stop_tokens(tokenizer, template: Template | None) -> list[str]:
    """Strings that end a turn: the template's end token (<|im_end|> for ChatML), the EOS token, and a pad token that
    marks an end such as Qwen's <|endoftext|> (a model that drifts past its turn emits it; a plain <pad> or <unk> is
    no stop)."""
    stops = [template.end_token(tokenizer)] if template is not None else []
    eos, pad = tokenizer.eos_token, tokenizer.pad_token
    for token in (eos, pad if pad and _END_MARKER.search(pad) else None):
        if token and token not in stops:
            stops.append(token)
    return stops


def _quote(text: str) -> str:
    if '"""' in text:
        raise FreetuneError('A Modelfile value cannot contain """ (it ends the quoted block); remove it from the '
                            'system prompt.')
    return f'"""{text}"""'


def write_modelfile(gguf_path: str | Path, tokenizer, out_path: str | Path | None = None, *,
                    system_prompt: str | None = None, temperature: float = SAMPLING["temperature"],
                    top_p: float = SAMPLING["top_p"], repeat_penalty: float = SAMPLING["repetition_penalty"],
                    num_ctx: int = 4096,
                    extra_parameters: dict | None = None) -> Path:
    """Write an Ollama Modelfile for gguf_path (default: 'Modelfile' next to it); returns its path.

    TEMPLATE is the Go-template twin of the tokenizer's chat template when that is one of freetune.templates'
    (ChatML, Llama 3, Zephyr: checked on a probe conversation). Any other template is left out: Ollama then reads
    the chat template the converter stored in the GGUF and picks its own matching template; check it with
    `ollama show NAME --template`.
    Beside a q8_0 file with its f16 twin, `Modelfile.f16` (FROM the f16 file) is written too: `ollama create -q
    q4_K_M` quantises an f16 GGUF, and ollama_commands names it.
    system_prompt: the default system message (None keeps the chat template's own default, if it has one).
    Defaults: temperature 0.7 and top_p 0.8 (Qwen's recommended sampling), num_ctx 4096 (Ollama's default
    context is shorter and silently cuts long prompts and answers).
    """
    gguf = Path(gguf_path).expanduser()
    if gguf.suffix != ".gguf":
        raise FreetuneError(f"{str(gguf)!r} is not a .gguf file: pass one of the files convert_to_gguf returned.")
    out = Path(out_path).expanduser() if out_path else gguf.parent / "Modelfile"
    # Ollama resolves FROM relative to the Modelfile's folder: keep the pair movable when they sit together.
    source = f"./{gguf.name}" if gguf.parent.resolve() == out.parent.resolve() else str(gguf.resolve())
    template, default_system, reason = identify_template(tokenizer)
    lines = [f"# Written by freetune.export.write_modelfile. Chat template: {reason}.", f"FROM {source}", ""]
    if template is not None:
        lines += [f"TEMPLATE {_quote(template.go(tokenizer))}", ""]
    else:
        lines += [f"# No TEMPLATE: {reason}; Ollama uses the chat template stored in the GGUF.", ""]
    system = system_prompt if system_prompt is not None else default_system
    if system:
        lines += [f"SYSTEM {_quote(system)}", ""]
    lines += [f'PARAMETER stop "{token}"' for token in stop_tokens(tokenizer, template)]
    params = {"temperature": temperature, "top_p": top_p, "repeat_penalty": repeat_penalty, "num_ctx": num_ctx,
              **(extra_parameters or {})}
    lines += [f"PARAMETER {key} {value}" for key, value in params.items()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    f16 = _f16_beside(gguf)
    if f16 is not None and out_path is None:  # for `ollama create -q q4_K_M`, which quantises an f16 GGUF
        out.with_name(F16_MODELFILE).write_text(
            "\n".join(f"FROM ./{f16.name}" if line.startswith("FROM ") else line for line in lines) + "\n")
    return out


F16_MODELFILE = "Modelfile.f16"


def _f16_beside(gguf: Path) -> Path | None:
    """The f16 GGUF converted with `gguf` (same name, -F16), when there is one and `gguf` is not already a k-quant
    or f16 itself."""
    stem, _, kind = gguf.stem.rpartition("-")
    f16 = gguf.with_name(f"{stem}-F16.gguf")
    return f16 if kind.upper() not in ("F16", "Q4_K_M") and f16.is_file() else None


_OLLAMA_NAME = re.compile(r"^([a-z0-9][a-z0-9._-]*/)?[a-z0-9][a-z0-9._-]*(:[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def ollama_commands(modelfile: str | Path, name: str) -> str:
    """The shell commands that import the GGUF into Ollama and chat with it."""
    if not _OLLAMA_NAME.match(name):
        raise FreetuneError(f"{name!r} is not a valid Ollama model name: use lowercase letters, digits, '-', '_' "
                            f"and '.', optionally 'namespace/' before and ':tag' after (e.g. 'svg-coder:q8').")
    modelfile = Path(modelfile).expanduser().absolute()
    commands = f"ollama create {name} -f {modelfile}\nollama run {name}"
    f16 = modelfile.with_name(F16_MODELFILE)
    if f16.is_file():
        base = name.split(":")[0]
        commands += (f"\n# q4_k_m, the size Ollama users pull (~40% smaller than q8_0), quantised by Ollama from "
                     f"the f16 GGUF:\nollama create {base}:q4_k_m -q q4_K_M -f {f16}")
    return commands


# --------------------------------------------------------------------------------------------------------------
# The Hub
# --------------------------------------------------------------------------------------------------------------

_SECRET_KEYS = re.compile(r"(^|_)(token|secret|password|api_key|apikey)$", re.I)


def _clean_parameters(parameters: dict) -> dict:
    """Parameters fit to publish: names that hold secrets dropped, any token inside a value redacted."""
    return {key: (redact(value) if isinstance(value, str) else value)
            for key, value in parameters.items() if not _SECRET_KEYS.search(str(key))}


def _md_cell(value) -> str:
    if isinstance(value, float):
        value = f"{value:.4g}"
    elif isinstance(value, (dict, list, tuple)):
        value = json.dumps(value, default=str)
    text = redact(str(value)).replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= 200 else text[:197] + "..."


def _md_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _eval_markdown(eval_table) -> str:
    """eval_table: rows (metric, base, adapter) as sanity.Comparison.rows() gives, or a dict metric -> value, or
    metric -> {column: value}."""
    if isinstance(eval_table, (list, tuple)):
        rows = [list(r) for r in eval_table]
        width = max(len(r) for r in rows)
        header = ["metric", "base", "adapter"] if width == 3 else ["metric"] + [f"value {i}" for i in range(1, width)]
        return _md_table(header, rows)
    if all(isinstance(v, dict) for v in eval_table.values()):
        columns = list(dict.fromkeys(c for v in eval_table.values() for c in v))
        return _md_table(["metric", *columns], [[m, *(v.get(c, "") for c in columns)] for m, v in eval_table.items()])
    return _md_table(["metric", "value"], [[k, v] for k, v in eval_table.items()])


def _looks_like_hub_id(name: str) -> bool:
    return bool(_HUB_ID.fullmatch(name or "")) and not Path(name).exists()


def model_card(*, base_model: str, dataset: str, recipe: str, parameters: dict, audit_summary: dict | None,
               eval_table=None, repo_id: str, extra_files: dict | None = None) -> str:
    """A README.md for the Hub: YAML front matter (base_model, library_name: peft, tags, datasets) and sections
    recording the base model, data set, recipe, parameters (never a token), data audit and evaluation.

    extra_files: {filename: what it is} for files the repo holds besides the adapter (GGUF, Modelfile).
    """
    import yaml  # PyYAML: a dependency of transformers, so always present

    front = {"base_model": base_model, "library_name": "peft", "pipeline_tag": "text-generation",
             "tags": ["freetune", "lora", "qlora", "sft", "trl",
                      re.sub(r"[^a-z0-9-]+", "-", recipe.lower()).strip("-")]}
    if _looks_like_hub_id(dataset):  # a local file is recorded in the text, not as a Hub data set id
        front["datasets"] = [dataset]
    params = _clean_parameters(parameters)
    name = repo_id.split("/")[-1]
    sections = [
        "---\n" + yaml.safe_dump(front, sort_keys=False, allow_unicode=True) + "---",
        f"# {name}",
        f"A LoRA adapter for [{base_model}](https://huggingface.co/{base_model}), fine-tuned with QLoRA by the "
        f"freetune recipe `{recipe}`.",
        "## Training",
        _md_table(["what", "value"], [["base model", base_model], ["data set", dataset], ["recipe", recipe]]),
        "### Parameters",
        _md_table(["parameter", "value"], [[k, v] for k, v in params.items()]) if params else "(none recorded)",
        "## Data audit",
        (_md_table(["finding", "value"], [[k, v] for k, v in audit_summary.items()]) if audit_summary
         else "No audit summary was recorded."),
        "## Evaluation",
        _eval_markdown(eval_table) if eval_table else "No evaluation was recorded.",
        "## Use",
        "```python\nfrom peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
        f"model = AutoPeftModelForCausalLM.from_pretrained({repo_id!r})\n"
        f"tokenizer = AutoTokenizer.from_pretrained({repo_id!r})\n```",
    ]
    if extra_files:
        sections += ["## Files", _md_table(["file", "what"], [[k, v] for k, v in extra_files.items()])]
    return redact("\n\n".join(sections) + "\n")


def _status_code(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def push_to_hub(folder: str | Path, repo_id: str, *, token: str | None = None, private: bool = True, api=None,
                is_main_process: bool | None = None, commit_message: str = "Upload with freetune",
                path_in_repo: str | None = None, allow_patterns=None, ignore_patterns=("*.log",),
                retries: int = 3, retry_wait_s: float = 5.0) -> str | None:
    """Upload folder to the Hub model repo repo_id (created if missing, private by default); returns its URL.

    Runs on the main process only (None elsewhere). token: None reads HF_TOKEN from the platform's secrets, and
    a missing token is an error before anything is sent. api: an object with HfApi's create_repo and
    upload_folder (default: huggingface_hub.HfApi). Network failures are retried; refused credentials are not.
    allow_patterns / ignore_patterns: which files go (logs such as convert.log stay behind by default).
    """
    if not _is_main(is_main_process):
        return None
    if not _HUB_ID.fullmatch(repo_id or ""):
        raise FreetuneError(f"repo_id {repo_id!r} is not 'user-or-org/name'. Use your Hub user name, e.g. "
                            f"'your-name/svg-coder-qwen2.5-1.5b'.")
    token = token or hf_token(required=True, purpose=f"upload to {repo_id}")
    source = Path(folder).expanduser()
    if not source.is_dir() or not any(source.iterdir()):
        raise FreetuneError(f"Nothing to upload: {str(source)!r} is not a folder with files.")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()

    def attempt(what: str, call):
        for attempt_no in range(1, retries + 1):
            try:
                return call()
            except Exception as exc:  # HfHubHTTPError, requests/httpx errors, timeouts: sorted out below
                status = _status_code(exc)
                message = redact(str(exc), [token])[:400]
                if status in (401, 403):
                    raise FreetuneError(
                        f"The Hub refused to {what} ({status}): {message}\nThe token needs 'Write' access, and "
                        f"{repo_id.split('/')[0]!r} must be your user name or an organisation you can write to. "
                        f"The files are still in {source}.") from None
                if attempt_no == retries or (status is not None and 400 <= status < 500 and status != 429):
                    raise FreetuneError(f"Could not {what} after {attempt_no} attempt(s): {message}\n"
                                        f"The files are still in {source}; run this cell again.") from None
                wait = retry_wait_s * 2 ** (attempt_no - 1)
                print(f"Could not {what} ({message[:160]}); retrying in {wait:.0f} s "
                      f"({attempt_no}/{retries}).", flush=True)
                time.sleep(wait)

    print(f"Uploading {source} to https://huggingface.co/{repo_id} ({'private' if private else 'public'}) ...",
          flush=True)
    attempt(f"create the repo {repo_id}", lambda: api.create_repo(
        repo_id=repo_id, token=token, private=private, repo_type="model", exist_ok=True))
    attempt(f"upload {source.name} to {repo_id}", lambda: api.upload_folder(
        repo_id=repo_id, folder_path=str(source), token=token, repo_type="model", commit_message=commit_message,
        path_in_repo=path_in_repo, allow_patterns=allow_patterns,
        ignore_patterns=list(ignore_patterns) if ignore_patterns else None))
    url = f"https://huggingface.co/{repo_id}"
    print(f"Uploaded: {url}", flush=True)
    return url
