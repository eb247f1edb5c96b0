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


# ---- bitsandbytes 0.50: its 8-bit Adam's state and update (freetune.speed.optimizer) --------------------------------

# The values per absmax scale of the 8-bit optimizers' blockwise state (Optimizer2State.init_state's blocksize).
OPTIMIZER_BLOCK = 256
# A paged optimizer pages the state of tensors of at least this many values (Optimizer8bit.get_state_buffer), and
# keeps smaller ones' in ordinary GPU memory.
PAGED_MIN_SIZE = 100_000


def adam_8bit_blocker(optimizer) -> str:
    """'' when `optimizer` is bitsandbytes 0.50's 8-bit Adam/AdamW (Optimizer2State, optimizer_name "adam", optim_bits
    8; its 8-bit state is always blockwise) with no update norm per whole tensor (max_unorm); else what stands in the
    way (None: not a bitsandbytes 8-bit optimizer at all)."""
    try:
        from bitsandbytes.optim.optimizer import Optimizer2State
    except ImportError:
        return None
    if not isinstance(optimizer, Optimizer2State) or getattr(optimizer.args, "optim_bits", 32) != 8:
        return None
    args = optimizer.args
    if optimizer.optimizer_name != "adam":
        return f"bitsandbytes' {optimizer.optimizer_name} update"
    if args.max_unorm > 0:
        return f"an update norm per tensor (max_unorm={args.max_unorm})"
    return ""


def adam_8bit_sizes(optimizer) -> tuple[int, float]:
    """The sizes of tensor bitsandbytes keeps ordinary 8-bit state for: at least min_8bit_size values (smaller ones get
    fp32 state), and, where the optimizer is paged, under PAGED_MIN_SIZE (larger ones get paged state)."""
    return optimizer.args.min_8bit_size, PAGED_MIN_SIZE if optimizer.is_paged else float("inf")


def adam_8bit_overridden(optimizer) -> set:
    """ids of the parameters with a per-parameter setting (GlobalOptimManager: the Trainer gives embeddings 32-bit
    state), found as bitsandbytes' first step finds them."""
    optimizer.check_overrides()
    return set(optimizer.mng.pid2config)


def adam_8bit_state(optimizer, like) -> dict:
    """bitsandbytes 0.50's fresh 8-bit state for a tensor like `like` (Optimizer2State.init_state's), in ordinary GPU
    memory, never paged (freetune.speed.optimizer flattens only weights whose state bitsandbytes would not page): both
    moments 8-bit, their quantisation maps, one absmax per OPTIMIZER_BLOCK values (the step count is the caller's)."""
    import torch

    if "dynamic" not in optimizer.name2qmap:
        optimizer.fill_qmap()
    qmaps = [optimizer.name2qmap[name].to(like.device) for name in ("dynamic", "udynamic")]
    blocks = -(-like.numel() // OPTIMIZER_BLOCK)
    return {"state1": torch.zeros_like(like, dtype=torch.uint8), "qmap1": qmaps[0],
            "state2": torch.zeros_like(like, dtype=torch.uint8), "qmap2": qmaps[1],
            "absmax1": torch.zeros((blocks,), dtype=torch.float32, device=like.device),
            "absmax2": torch.zeros((blocks,), dtype=torch.float32, device=like.device)}


def adam_8bit_update(optimizer, group: dict, grad, weight, state: dict, step: int) -> None:
    """One 8-bit Adam update of `weight` from `grad` with `state` at step `step` (1 first), the arithmetic of
    Optimizer2State.update_step for 8-bit state; without the torch.cuda.synchronize() bitsandbytes' step adds after
    every parameter (the caller synchronises once for paged state)."""
    import bitsandbytes.functional as F

    betas = group["betas"]
    F.optimizer_update_8bit_blockwise(
        optimizer.optimizer_name, grad, weight, state["state1"], state["state2"], betas[0], betas[1],
        betas[2] if len(betas) >= 3 else 0.0, group.get("alpha", 0.0), group["eps"], step, group["lr"],
        state["qmap1"], state["qmap2"], state["absmax1"], state["absmax2"], group["weight_decay"], gnorm_scale=1.0,
        skip_zeros=optimizer.args.skip_zeros)


def adam_8bit_step_others(optimizer, weights) -> None:
    """bitsandbytes' own step for `weights` ([(group index, index in group, weight)]: those outside freetune's flat
    tensors), without its synchronisation after each."""
    for gindex, pindex, weight in weights:
        if weight.grad is None:
            continue
        group = optimizer.param_groups[gindex]
        if len(optimizer.state[weight]) == 0:
            optimizer.init_state(group, weight, gindex, pindex)
        optimizer.prefetch_state(weight)
        optimizer.update_step(group, weight, gindex, pindex)


def adam_8bit_first_step(optimizer) -> None:
    """What bitsandbytes' step does once before its first update: the per-parameter overrides, state moved to the
    parameters' devices."""
    if not optimizer.initialized:
        optimizer.check_overrides()
        optimizer.to_gpu()
        optimizer.initialized = True
