"""peft's and bitsandbytes' internals freetune reaches into: the LoRA 4-bit layers the fused kernel stands in for,
their quantisation state, bitsandbytes' CPU 4-bit kernel and its inference repacking. Written against the releases
in WRITTEN_AGAINST (the pins in pyproject.toml)."""

from __future__ import annotations

import warnings

from freetune.reach import versions  # noqa: F401  (imported for its check of the installed releases, first)

WRITTEN_AGAINST = {"peft": "0.21", "bitsandbytes": "0.50"}

# bitsandbytes' block size for a double-quantised weight's absmax values (QuantState.state2.blocksize).
NESTED_BLOCKSIZE = 256


def fusable(module) -> str:
    """'' when `module` can take the fused forward, else why not (peft 0.21's lora.bnb.Linear4bit and its adapter
    dicts, bitsandbytes 0.50's Linear4bit and QuantState)."""
    import torch

    try:
        from bitsandbytes.nn import Linear4bit
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except ImportError as exc:
        return f"bitsandbytes/peft unavailable: {exc}"
    if not isinstance(module, LoraLinear4bit):
        return "not a peft LoRA layer over a 4-bit base"
    base = module.base_layer
    if not isinstance(base, Linear4bit) or getattr(base.weight, "quant_state", None) is None:
        return "base layer has no quantisation state"
    if getattr(base.weight.quant_state, "packing_format_for_cpu", False):
        return "weight repacked for CPU inference"
    if base.weight.dim() != 2 or base.weight.shape[1] != 1:  # _dequantize reads the (n, 1) layout Linear4bit keeps
        return f"packed weight of shape {tuple(base.weight.shape)}"
    if module.lora_variant or any(module.use_dora.values()):
        return "a LoRA variant (DoRA, ...) has its own forward"
    if len(module.lora_A) != 1:
        return "several adapters"
    dropout = next(iter(module.lora_dropout.values()))
    if not isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity)):
        return f"dropout module {type(dropout).__name__}"
    if base.weight.quant_state.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"compute dtype {base.weight.quant_state.dtype}"
    return ""


def single_quantised(quant_state, absmax) -> None:
    """bitsandbytes 0.50: a double-quantised weight's QuantState made single-quantised, its absmax values `absmax`
    (dequantised once to fp32 by freetune.speed.nf4.quant_args). The 8-bit values and their own state go (nothing reads
    them any more); bitsandbytes' own kernels (generation, merging an adapter) read the fp32 values as they read any
    single-quantised weight's."""
    quant_state.absmax = absmax
    quant_state.nested = False
    quant_state.state2 = None
    quant_state.offset = None


# ---- bitsandbytes 0.50: its CPU 4-bit kernel and layouts (freetune.speed.bnb_cpu) ------------------------------------

_BNB_CPU_KERNELS: list = []  # the torch.library.Library holding freetune's kernel: freed, it would unregister it


def register_cpu_dequantize(dequantize) -> None:
    """bitsandbytes 0.50 / torch 2.8-2.13: `dequantize` registered as the CPU kernel of bitsandbytes' dequantize_4bit
    op, for every shape (the CUDA kernels are untouched).

    bitsandbytes registers its own CPU kernel from Python (torch.library.register_kernel). torch before 2.13 refuses
    a second register_kernel over another library's Python kernel ("already a kernel registered from python
    overriding dequantize_4bit's behavior"); Library.impl with allow_override=True (torch 2.8 on; the default from
    2.13) replaces it on every release. torch.compiler.disable, as register_kernel does: dynamo never traces into it."""
    import torch

    library = torch.library.Library("bitsandbytes", "IMPL")
    with warnings.catch_warnings():  # torch warns that a kernel is overridden: that is the point
        warnings.simplefilter("ignore")
        library.impl("dequantize_4bit", torch.compiler.disable(dequantize), "CPU", allow_override=True)
    _BNB_CPU_KERNELS.append(library)


def _keep_out_of_cpu_repacking(model, partial_blocks_only: bool) -> int:
    """bitsandbytes 0.50: turn off the AVX-512 bf16 inference repacking of Linear4bit layers (all of them, or those
    whose input size is not a whole number of quantisation blocks); returns how many were turned off."""
    from bitsandbytes.nn import Linear4bit

    kept = 0
    for module in model.modules():
        if not isinstance(module, Linear4bit) or not getattr(module, "support_avx512bf16_for_cpu", False):
            continue
        state = getattr(module.weight, "quant_state", None)
        if partial_blocks_only and (state is None or not module.in_features % state.blocksize):
            continue
        module.support_avx512bf16_for_cpu = False
        kept += 1
    return kept


def keep_cpu_inference_layout(model) -> int:
    """bitsandbytes 0.50: keep its Linear4bit layers whose input size is not a whole number of blocks out of the CPU
    inference repacking (AVX-512 bf16 CPUs, eval mode), which cannot reshape them; returns how many."""
    return _keep_out_of_cpu_repacking(model, partial_blocks_only=True)


def keep_training_layout(model) -> int:
    """bitsandbytes 0.50: keep every Linear4bit layer of a model that trains out of the CPU inference repacking;
    returns how many.

    bitsandbytes 0.50.2 repacks a layer's 4-bit weight for its AVX-512 bf16 inference kernel the first time the layer
    runs in eval mode without gradients (an evaluation between training steps) and never packs it back: every later
    training step then runs the inference kernel, whose in-place bias add on a tensor that needs its gradient raises
    "a view of a leaf Variable that requires grad is being used in an in-place operation"."""
    return _keep_out_of_cpu_repacking(model, partial_blocks_only=False)


