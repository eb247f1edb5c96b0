"""freetune: QLoRA fine-tuning for free and small GPUs. The recipes orchestrate; this library does the work.

Modules, in the order a recipe uses them:
  params       check the parameters cell's values against their declared types
  platform     Colab / Kaggle / local differences as one table (paths, secrets, install)
  preflight    the machine check and the training plan (dtype, precision, attention, layout, batch)
  data         load and normalise training data (messages, ShareGPT, prompt/completion, Alpaca, column mapping)
  templates    named chat templates for base models (chatml, llama3, zephyr) and their Ollama twins
  audit        find junk rows before training, and clean them
  model        the 4-bit base model and its LoRA adapter
  train        SFTTrainer with progress, memory and a summary; writes run_summary.json
  tracking     eval loss while training, the overfitting warning, report_to (TensorBoard, Trackio)
  checkpoint   complete-or-ignored checkpoints, resume, time budget, SIGTERM, Hub sync
  distributed  torchrun's RANK/LOCAL_RANK/WORLD_SIZE: one script for 1 or N processes
  launch       the Kaggle cell that runs train_ddp.py under torchrun and streams its logs
  sanity       what the adapter generates, base vs adapter; one verdict per model
  chat         try it: type prompts, see the adapter's answer streamed (held-out prompts when headless)
  tasks        per-recipe validity checks and metrics (SVG, Home Assistant)
  export       merge, GGUF, Ollama Modelfile, Hub upload
  fixtures     offline stand-ins: a tiny model of a real architecture and Qwen's real tokenizer
"""

import importlib

from freetune.errors import FreetuneError

__version__ = "0.1.0"
__all__ = ["FreetuneError", "__version__"]

_SUBMODULES = {"params", "platform", "preflight", "memory", "data", "audit", "model", "train", "distributed",
               "launch", "checkpoint", "sanity", "tasks", "export", "secrets", "fixtures", "templates", "tracking",
               "chat"}


def __getattr__(name):
    # `import freetune` then `freetune.train.train(...)`: submodules load on first use, so a recipe needs one
    # import line and importing freetune stays cheap (no torch until a step needs it).
    if name in _SUBMODULES:
        return importlib.import_module(f"freetune.{name}")
    raise AttributeError(f"module 'freetune' has no attribute {name!r}")
