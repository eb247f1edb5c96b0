"""freetune's speed features, one module each, installed by training in this order (freetune.train._speed_up).

Each feature module exposes FEATURE (freetune.speed.feature.Feature): its name, whether it applies to this plan and
model (and why not), and how it installs itself and is undone. The order matters where one feature reads what an
earlier one put in place: CUDA graphs replay the layers whose LoRA weights the LoRA kernel casts once per forward;
the MLP kernel stands in for MLPs over fused LoRA layers; layers are compiled last, over everything else.

Modules the features use, installed elsewhere or by them: batching (the padding-free collator, put in by
freetune.trainer.FreetuneTrainer), bnb_cpu (bitsandbytes' CPU 4-bit kernel fixed at model load, freetune.model),
nf4 (a 4-bit weight's state as plain tensors, and its dequantisation), triton_kernels (launched by the fused LoRA and
MLP ops on a GPU), attention_efficient (the memory-efficient kernel's custom ops), layer_graphs (what cuda_graphs
records and replays), mlp_ops and mlp_traced (the fused MLP's parts and its traced form), dropout (LoRA dropout's
draws inside compiled layers).

Feature modules are imported when training asks for them (features()), not with this package: batching and the
reaches that import it stay light.
"""

from __future__ import annotations

FEATURES = ("sampler", "lora_kernel", "cuda_graphs", "mlp", "loss_head", "garbage", "attention", "host_embeddings",
            "compiled_layers")


def features() -> list:
    """The FEATURE objects of FEATURES' modules, in that order."""
    import importlib

    return [importlib.import_module(f"{__name__}.{module}").FEATURE for module in FEATURES]
