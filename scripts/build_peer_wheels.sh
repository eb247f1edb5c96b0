#!/usr/bin/env bash
# Build .uwhl/: cp312 wheels of the benchmark peer (Unsloth) for the offline GPU machine, installed there into a
# folder of its own (pip install --no-index --no-deps --target /tmp/usite .uwhl/*.whl) because Unsloth pins
# trl <= 1.15 and datasets < 5, below freetune's. Usage: bash scripts/build_peer_wheels.sh [DEST=.uwhl]
#
# What the GPU image lacks for `import unsloth` and FastLanguageModel's QLoRA SFT path (read in its sources):
# unsloth, unsloth_zoo, trl, datasets (+ dill, multiprocess, and the fsspec it accepts), peft (the image's may be
# older than 0.18, and freetune's runs use 0.21.2) and bitsandbytes. Unsloth's other requirements are not imported
# on that path: tyro, msgspec (vLLM LoRA only), hf_transfer (looked up, never needed offline), pydantic (a warning
# filter, guarded), torchao (QAT / fp8 only, behind find_spec), cut_cross_entropy (unsloth_zoo turns it off on
# torch >= 2.8), diffusers, structlog / json5 / nest_asyncio (Studio and the CLI).
set -euo pipefail
DEST="${1:-.uwhl}"; mkdir -p "$DEST"
HERE="$(cd "$(dirname "$0")" && pwd)"
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp)
M=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q "${P[@]}" "${M[@]}" -d "$DEST" unsloth_zoo==2026.10.9 trl==1.15.0 datasets==4.8.5 \
    dill==0.4.1 multiprocess==0.70.19 fsspec==2026.2.0 peft==0.21.2
TMP="$(mktemp -d)"; trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q "${P[@]}" "${M[@]}" -d "$TMP" unsloth==2026.10.9
python3 -m pip download -q "${P[@]}" --platform manylinux_2_24_x86_64 -d "$TMP" bitsandbytes==0.50.2
# Unsloth's wheel is 29 MB, 26 of them its Studio app (studio/: a web front end and its server), which training
# never imports; bitsandbytes keeps its CUDA 13.0 and CPU libraries (as freetune's .whl/ does).
python3 "$HERE/device_wheels_shrink.py" "$TMP"/unsloth-2026.10.9-*.whl "$DEST/$(basename "$TMP"/unsloth-2026.10.9-*.whl)" \
    --drop 'studio/.*'
python3 "$HERE/device_wheels_shrink.py" "$TMP"/bitsandbytes-0.50.2-*.whl \
    "$DEST/$(basename "$TMP"/bitsandbytes-0.50.2-*.whl)" --drop 'bitsandbytes/libbitsandbytes_.*\.so' \
    --keep 'bitsandbytes/libbitsandbytes_(cuda130|cpu)\.so'
ls -1 "$DEST"; du -sh "$DEST"
