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

The files, one job each (this package re-exports what the recipes call):
    adapter.py     save the adapter, check a folder holds one, read its base model
    merging.py     plan_merge (what a 16-bit merge needs and has) and merge
    converter.py   llama.cpp's converter: fetch it from PyPI once, or find a clone; find llama-quantize
    gguf.py        convert_to_gguf
    ollama.py      the Modelfile and the commands that import it into Ollama
    card.py        the model card
    hub.py         push_to_hub
Free RAM, disk and GPU memory are read by freetune.resources, as the preflight reads them.
"""

from freetune.export.adapter import ADAPTER_FILES, adapter_base_model, check_adapter, save_adapter
from freetune.export.card import model_card
from freetune.export.converter import (CONVERTER, GET_CONVERTER_HELP, GET_QUANTIZE_HELP, LLAMA_CPP_PYTHON_VERSION,
                                       converter_cache_dir, fetch_converter, find_converter, find_quantize_tool)
from freetune.export.gguf import CONVERTER_OUTTYPES, Q4_K_M_BY_OLLAMA, convert_to_gguf
from freetune.export.hub import push_to_hub
from freetune.export.merging import MERGED_MARKER, MergePlan, count_parameters, merge, plan_merge
from freetune.export.ollama import F16_MODELFILE, identify_template, ollama_commands, stop_tokens, write_modelfile

__all__ = ["ADAPTER_FILES", "CONVERTER", "CONVERTER_OUTTYPES", "F16_MODELFILE", "GET_CONVERTER_HELP",
           "GET_QUANTIZE_HELP", "LLAMA_CPP_PYTHON_VERSION", "MERGED_MARKER", "Q4_K_M_BY_OLLAMA", "MergePlan",
           "adapter_base_model", "check_adapter", "convert_to_gguf", "converter_cache_dir", "count_parameters",
           "fetch_converter", "find_converter", "find_quantize_tool", "identify_template", "merge", "model_card",
           "ollama_commands", "plan_merge", "push_to_hub", "save_adapter", "stop_tokens", "write_modelfile"]
