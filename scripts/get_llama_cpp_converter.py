"""Fetch llama.cpp's own GGUF converter from PyPI, without a git clone, and print where it is.

llama-cpp-python's source distribution vendors llama.cpp; this downloads it with pip
(`pip download --no-deps --no-binary :all: llama-cpp-python==VERSION`) and keeps only convert_hf_to_gguf.py, its
`conversion` package, gguf-py and the requirements files (a few MB of the 75 MB archive). freetune.export finds
the default folder by itself; elsewhere set FREETUNE_LLAMA_CPP to the printed folder.

    python scripts/get_llama_cpp_converter.py            # -> ~/.cache/freetune/llama.cpp
    python scripts/get_llama_cpp_converter.py --dest DIR --version 0.3.36
"""

from __future__ import annotations

import argparse

from freetune.errors import FreetuneError
from freetune.export import LLAMA_CPP_PYTHON_VERSION, converter_cache_dir, fetch_converter


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dest", default=None, help=f"folder to keep it in (default {converter_cache_dir()})")
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION, help="llama-cpp-python release to take it from")
    args = parser.parse_args(argv)
    try:
        converter = fetch_converter(args.dest, version=args.version)
    except FreetuneError as exc:
        print(f"error: {exc}")
        return 1
    print(converter.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
