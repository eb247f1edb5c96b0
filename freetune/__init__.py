"""freetune: QLoRA fine-tuning for free and small GPUs. The recipes orchestrate; this library does the work.

Modules, in the order a recipe uses them:
  console      what the notebook shows: errors as messages, no library progress bars, one duration format
  params       check the parameters cell's values against their declared types
  run_config   RunConfig: the checked parameters, folders and plan in one record (also Kaggle's job file)
  platform     Colab / Kaggle / local differences as one table (paths, secrets, install)
  plan         the machine check and the training plan (dtype, precision, attention, layout, batch), decided in
               short steps (every choose_*: a Decision, value and reason); for_world re-decides it for a torchrun job
  data         load and normalise training data (messages, ShareGPT, prompt/completion, Alpaca, column mapping)
  templates    named chat templates for base models (chatml, llama3, zephyr) and their Ollama twins
  audit        find junk rows before training, and clean them
  model        the 4-bit base model and its LoRA adapter
  sft_config   the SFTConfig from the plan and the recipe's parameters
  train        the run with progress, memory and a summary (run_summary.json)
  trainer      FreetuneTrainer: every override of the Trainer's and SFTTrainer's methods, in one class
  reach        every other reach into library internals, one module per library, each tagged with its release
  speed        the speed features, one module each (attention, the fused LoRA layer, MLP, CUDA graphs, host
               embeddings, sampler, compiled layers, ...): each says whether it applies, train installs them in order
  tracking     eval loss while training, the overfitting warning, report_to (TensorBoard, Trackio)
  checkpoint   complete-or-ignored checkpoints, resume, time budget, SIGTERM, Hub sync
  distributed  torchrun's RANK/LOCAL_RANK/WORLD_SIZE: one script for 1 or N processes
  launch       the Kaggle cell that runs train_ddp.py under torchrun and streams its logs
  evaluate     what the adapter generates, base vs adapter; one verdict per model
  chat         try it: type prompts, see the adapter's answer streamed (held-out prompts when headless)
  tasks        per-recipe validity checks and metrics (SVG, Home Assistant)
  export       merge, GGUF, Ollama Modelfile, Hub upload
  fixtures     offline stand-ins: a tiny model of a real architecture and Qwen's real tokenizer
  resources    free RAM, disk (Kaggle's quota counted) and GPU memory; handing a model's memory back
"""

import importlib
import logging

from freetune import console
from freetune.errors import FreetuneError

__version__ = "0.1.0"
__all__ = ["FreetuneError", "__version__"]

# bitsandbytes 0.50 warns at import, on CPUs with AVX-512 bf16, that it could not fetch an optional faster CPU
# kernel from the Hub ("Failed to load CPU gemm_4bit_forward from kernels-community": the `kernels` package is
# not installed). It then uses its own C++ kernel for that op (4-bit inference at batch size 1), so nothing is
# missing; the line only reads like a failure to a new user. That one message is dropped, nothing else.
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward"))
# transformers 5.17's Trainer copies the tokenizer's PAD/BOS/EOS ids into the model's config and says so in a red
# warning ("The tokenizer has new PAD/BOS/EOS tokens ..."), on every run whose base config names another BOS (Qwen's
# names none). The copy is what freetune wants; the notebook's audit already reports the tokens that matter (EOS
# inside the labels, pad == EOS). That one message is dropped.
logging.getLogger("transformers.trainer_utils").addFilter(
    lambda record: not str(record.msg).startswith("The tokenizer has new PAD/BOS/EOS tokens"))

_SUBMODULES = {"params", "platform", "plan", "data", "audit", "model", "train", "trainer",
               "distributed", "launch", "checkpoint", "evaluate", "tasks", "export", "secrets", "fixtures",
               "templates", "tracking", "chat", "resources", "run_config", "sft_config"}


# A notebook shows freetune's lines and its errors' messages, not the libraries' bars and chained tracebacks.
console.progress_bars_off()
console.show_freetune_errors_as_messages()


def __getattr__(name):
    # `import freetune` then `freetune.train.train(...)`: submodules load on first use, so a recipe needs one
    # import line and importing freetune stays cheap (no torch until a step needs it).
    if name in _SUBMODULES:
        return importlib.import_module(f"freetune.{name}")
    if name == "RunConfig":  # the run's settings, the one record every notebook cell reads (freetune.run_config)
        return importlib.import_module("freetune.run_config").RunConfig
    raise AttributeError(f"module 'freetune' has no attribute {name!r}")
