"""llama.cpp's own GGUF converter, never a home-made writer: fetched once from PyPI (the copy vendored in the
`llama-cpp-python` source distribution) or found in a clone; and its compiled llama-quantize, where there is one."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from freetune.errors import FreetuneError


# llama-cpp-python's source distribution vendors llama.cpp, converter and gguf-py included: a PyPI download
# instead of a git clone. 0.3.36 converts Qwen2/2.5/3 and Llama with transformers 5.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
CONVERTER = "convert_hf_to_gguf.py"
# The parts of llama.cpp the converter imports, and what it needs to be installed.
_CONVERTER_PARTS = (CONVERTER, "conversion/", "gguf-py/", "requirements/", "requirements.txt", "LICENSE")
GET_CONVERTER_HELP = (
    "Get llama.cpp's converter one of these ways:\n"
    "  - `python scripts/get_llama_cpp_converter.py`, or in a notebook `freetune.export.fetch_converter()`: "
    f"downloads llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}'s source from PyPI and keeps only the converter "
    "(in ~/.cache/freetune/llama.cpp, found without further settings);\n"
    "  - on Colab or Kaggle: `!git clone --depth 1 https://github.com/ggml-org/llama.cpp` and "
    "`!pip install sentencepiece`, then pass converter='llama.cpp' (or set FREETUNE_LLAMA_CPP to the folder). "
    "Do not `pip install -r` llama.cpp's requirements there: they pin a CPU build of torch and an older "
    "transformers, which would replace the notebook's own.")
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
