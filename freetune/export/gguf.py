"""Convert a merged model to GGUF: llama.cpp's convert_hf_to_gguf.py writes f16 / q8_0; `llama-quantize` (compiled
llama.cpp) makes q4_k_m when present, else Ollama makes it from the f16 file (`ollama create -q q4_K_M -f
Modelfile.f16`, see freetune.export.ollama). The disk it needs is checked first."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from freetune import resources
from freetune.errors import FreetuneError
from freetune.export.converter import CONVERTER, find_converter, find_quantize_tool
from freetune.resources import size_text
from freetune.secrets import redact


CONVERTER_OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# Size of one GGUF relative to the parameter count, in bytes per parameter (q8_0 stores 34 bytes per 32 weights,
# q4_k_m ~4.9 bits per weight with its scales; small tensors stay f32 and add a little).
_GGUF_BYTES_PER_PARAM = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 1.07, "q6_k": 0.83, "q5_k_m": 0.72,
                         "q4_k_m": 0.62, "q4_0": 0.57}
# llama.cpp's k-quants (q4_k_m) come only from its compiled llama-quantize: gguf-py quantises q8_0 but no k-quant, and
# PyPI's llama-cpp-python ships a source distribution only (a C++ build of llama.cpp: minutes of every CI run and of a
# free notebook's two cores). Ollama quantises an f16 GGUF itself on import, so that is the one step offered instead.
Q4_K_M_BY_OLLAMA = ("q4_k_m (the size Ollama users pull) needs llama.cpp's compiled llama-quantize, which no PyPI "
                    "package ships ready to run; Ollama makes it from the f16 GGUF: see the `ollama create -q q4_K_M` "
                    "line below.")


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

    _check_disk(merged, out, [*outtypes, *quantize], intermediate, free_disk_bytes, keep_safe)

    log_path = out / "convert.log"
    written: list[Path] = []
    for outtype in (*outtypes, *([intermediate] if intermediate else [])):
        target = out / f"{name}-{outtype.upper()}.gguf"
        print(f"Converting {merged.name} to {target.name} with llama.cpp's {CONVERTER} ...", flush=True)
        command = [sys.executable, str(script), str(merged), "--outfile", str(target), "--outtype", outtype]
        written.append(_write(target, command, log_path, f"llama.cpp's converter ({outtype})", keep_safe))
    if quantize:
        source = next(p for p in written if p.name.endswith(tuple(f"-{t.upper()}.gguf"
                                                                   for t in ("f16", "bf16", "f32"))))
        for qtype in quantize:
            target = out / f"{name}-{qtype.upper()}.gguf"
            print(f"Quantising {source.name} to {target.name} with {tool.name} ...", flush=True)
            written.append(_write(target, [str(tool), str(source), str(target), qtype.upper()], log_path,
                                  f"llama-quantize ({qtype})", keep_safe))
        if intermediate:
            source.unlink()
            written.remove(source)
    for path in written:
        print(f"  {path}  {size_text(path.stat().st_size)}", flush=True)
    return written


def _check_disk(merged: Path, out: Path, types: list[str], intermediate: str | None, free_disk_bytes: int | None,
                keep_safe: str) -> None:
    """Refuse before converting when the GGUF files (and an intermediate f16 one) will not fit in out."""
    params = _safetensors_params(merged)
    needed = sum(_GGUF_BYTES_PER_PARAM.get(t, 2.0) * params for t in types)
    needed += _GGUF_BYTES_PER_PARAM["f16"] * params if intermediate else 0
    free = resources.free_disk_bytes(out) if free_disk_bytes is None else int(free_disk_bytes)
    if free < needed:
        raise FreetuneError(f"The GGUF files ({', '.join(types)}) need about {size_text(needed)} in {out}; "
                            f"{size_text(free)} is free. Convert fewer types (q8_0 alone is about half of f16), or "
                            f"choose an out_dir on a bigger disk. {keep_safe}")


def _write(target: Path, cmd: list[str], log_path: Path, what: str, keep_safe: str) -> Path:
    """Run the llama.cpp tool that writes target; a half-written GGUF is removed, so it never looks like a result."""
    try:
        _run_logged(cmd, log_path, what, keep_safe)
    except FreetuneError:
        target.unlink(missing_ok=True)
        raise
    return target
