"""Every decision of the training plan, one function each: (value, why) from the machine and what was asked.

freetune.preflight.make_plan calls them in order, as short steps; nothing else chooses. Each returns its value and
the reason the plan table shows beside it, so a reader of a plan can tell why it is what it is.

The precision policy, and why:
- Turing (T4, sm_75): fp16 tensor cores, no fast bf16. Compute in fp16 with fp16 mixed precision (loss
  scaling). The non-quantised weights load in fp16 even when the checkpoint says bfloat16: bf16 tensors on the
  fp16 path fail with `"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'`.
  LoRA weights stay fp32 (the GradScaler refuses to unscale fp16 gradients, and fp16 weights lose small updates).
- Ampere and newer (sm_80+): bf16, which has fp32's range and needs no loss scaling.
- No GPU: fp32 on the CPU (checks and smoke runs).
"""

from __future__ import annotations

from freetune.errors import FreetuneError
from freetune.speed.attention import (EFFICIENT_BACKENDS, POLICY_BACKENDS, VARLEN_ATTENTION, VARLEN_KERNEL_NAMES,
                                      varlen_backend, varlen_works)
from freetune.hardware import Hardware
from freetune.memory import TILE_TOKENS, ModelShape, embedding_bytes, estimate, shape_of

POLICIES = ("turing", "ampere")
LAYOUTS = ("auto", "single", "ddp", "fsdp")
# A recipe parameter is a string ("auto" / "on" / "off": papermill cannot read a `bool | str` annotation); library
# callers may pass a bool. None: decided by memory.
CHECKPOINTING = {"auto": None, None: None, "on": True, True: True, "off": False, False: False}


# ---- precision and placement ----------------------------------------------------------------------------------

def resolve_policy(force_policy: str | None, precision: str) -> str | None:
    from_precision = {"auto": None, "fp16": "turing", "bf16": "ampere"}
    if precision not in from_precision:
        raise FreetuneError(f"precision must be 'auto', 'fp16' or 'bf16', not {precision!r}.")
    if force_policy is not None and force_policy not in POLICIES:
        raise FreetuneError(f"force_policy must be one of {POLICIES} or None, not {force_policy!r}.")
    wanted = from_precision[precision]
    if force_policy and wanted and force_policy != wanted:
        raise FreetuneError(f"force_policy={force_policy!r} contradicts precision={precision!r}: give one of them.")
    return force_policy or wanted


def choose_policy(hardware: Hardware, force_policy: str | None) -> tuple[str, str, list[str]]:
    """('turing' | 'ampere' | 'cpu', why, warnings). The why is the compute dtype's reason."""
    if not hardware.gpus:
        warnings = ([f"precision forced to the {force_policy} policy, but there is no GPU: fp32 on the CPU"]
                    if force_policy else [])
        return "cpu", "no GPU: fp32 on the CPU (16-bit math there is slow or unsupported); for checks and smoke runs", \
            warnings
    slowest = min(hardware.gpus, key=lambda g: g.capability)
    if force_policy == "turing":
        return "turing", f"forced (precision='fp16'): the T4 policy, fp16, on {slowest.name}", []
    if force_policy == "ampere":
        if slowest.capability < (8, 0) or not hardware.bf16_supported:
            return "ampere", f"forced (precision='bf16') on {slowest.name}", [
                f"bf16 forced on {slowest.name} ({slowest.sm}), which has no native bf16: expect slow or failing "
                f"kernels. Use precision='auto' (fp16) on this GPU"]
        return "ampere", f"forced (precision='bf16') on {slowest.name}", []
    if slowest.capability >= (8, 0) and hardware.bf16_supported:
        return "ampere", f"{slowest.name} is {slowest.sm} (Ampere or newer): bf16, fp32's range at 16-bit cost", []
    if slowest.capability >= (8, 0):
        return "turing", f"{slowest.name} is {slowest.sm} but this torch reports no bf16 on it: fp16", []
    return "turing", f"{slowest.name} is {slowest.sm} (Turing or older): fp16 tensor cores, no fast bf16", []


def choose_precision(policy: str) -> tuple[str, str, dict]:
    """(compute dtype, mixed precision mode, reasons for the weights' dtypes) for a policy."""
    if policy == "cpu":
        return "float32", "no", {
            "mixed_precision": "no autocast on the CPU",
            "load_dtype": "fp32 like the compute",
            "lora_dtype": "fp32"}
    if policy == "turing":
        return "float16", "fp16", {
            "mixed_precision": "fp16 autocast with loss scaling (GradScaler)",
            "load_dtype": "fp16 even if the checkpoint says bfloat16: bf16 tensors on the fp16 path fail with "
                          "'_amp_foreach_non_finite_check_and_unscale_cuda' not implemented for 'BFloat16'",
            "lora_dtype": "fp32 (peft autocast_adapter_dtype): the GradScaler cannot unscale fp16 gradients, "
                          "and fp16 weights lose small updates"}
    return "bfloat16", "bf16", {
        "mixed_precision": "bf16 autocast; no loss scaling needed",
        "load_dtype": "bf16, the dtype the compute runs in",
        "lora_dtype": "fp32 (peft autocast_adapter_dtype): bf16 weights lose small updates"}


def choose_frozen_dtype(policy: str, compute_dtype: str) -> tuple[str, str]:
    """(dtype of the frozen non-4-bit weights, why)."""
    if policy == "cpu":
        return "float32", "a CPU run is a check: fp32 as peft's prepare_model_for_kbit_training leaves them"
    return compute_dtype, (f"the frozen embeddings, norms and head stay {compute_dtype}, as loaded: nothing trains "
                           f"them, so peft's fp32 upcast would only double their memory and that of the residual "
                           f"stream every layer saves")


# ---- what the architecture allows ----------------------------------------------------------------------------------

def varlen_why_not(shape: ModelShape | None, max_length: int) -> str:
    """Why freetune's padding-free attention (freetune.fast) cannot honour this model ('' where it can): its kernels
    take the rows' boundaries only, no sliding window and no soft-capping."""
    if shape is None:
        return ""
    if shape.attn_softcap:
        return (f"{shape.model_type or shape.name} soft-caps its attention logits, which the variable-length kernels "
                f"do not")
    if shape.sliding_window and shape.sliding_window < max_length:
        return (f"{shape.model_type or shape.name}'s sliding window ({shape.sliding_window} tokens) is shorter than "
                f"max_length ({max_length}), and the variable-length kernels attend to the whole row")
    return ""


def graphs_why_not(shape: ModelShape | None) -> str:
    """Why freetune.graphed_layers cannot replay this model's layers ('' where it can): it replays one set of keyword
    arguments (mask, rotary embeddings) for every layer."""
    if shape is not None and shape.experts:
        return (f"{shape.model_type or shape.name} is a mixture of experts: the experts' LoRA weights (peft's "
                f"ParamWrapper) are not fused LoRA layers, whose weights are the only ones the graphs take "
                f"gradients of")
    if shape is not None and shape.per_layer_arguments:
        return (f"{shape.model_type or shape.name} gives its layers different masks or rotary embeddings by layer "
                f"type ({', '.join(sorted(set(shape.layer_types)))}), and the graphs replay one set for every layer")
    return ""


def mlp_why_not(shape: ModelShape | None) -> str:
    """Why freetune.fused_mlp cannot stand in for this model's MLP ('' where it can)."""
    from freetune.speed.mlp import MLP_MODEL_TYPES

    if shape is None or shape.model_type in MLP_MODEL_TYPES:
        return ""
    if shape.experts:
        return f"{shape.model_type}'s MLP is a mixture of {shape.experts} experts"
    return (f"{shape.model_type or shape.name}'s MLP is not one it knows ({', '.join(sorted(MLP_MODEL_TYPES))}: "
            f"separate gate, up and down projections with SiLU)")


def choose_attention(hardware: Hardware, policy: str, shape: ModelShape | None = None) -> tuple[str, str]:
    """(attn_implementation, why): sdpa by default, FlashAttention 2 where installed and sm80+, eager only if
    torch has no sdpa, or for soft-capped attention logits (transformers' sdpa drops the cap)."""
    if shape is not None and shape.attn_softcap:
        return "eager", (f"{shape.model_type or shape.name} soft-caps its attention logits "
                         f"({shape.attn_softcap:g}): transformers' eager attention applies the cap, sdpa would drop it")
    if not hardware.sdpa:
        return "eager", "this torch has no scaled_dot_product_attention (torch < 2.0): eager"
    if (policy == "ampere" and hardware.flash_attn and hardware.gpus
            and all(g.capability >= (8, 0) for g in hardware.gpus)):
        return "flash_attention_2", "flash-attn is installed and every GPU is sm80+: FlashAttention 2"
    if policy == "turing":
        return "sdpa", "PyTorch's fused attention (memory-efficient kernel on Turing); never the seq x seq matrix"
    if policy == "ampere":
        why = "PyTorch's fused attention (FlashAttention kernel on sm80+)"
        return "sdpa", why + ("; pip install flash-attn to use FlashAttention 2 directly" if not hardware.flash_attn
                              else "")
    return "sdpa", "PyTorch's fused attention, which also runs on a CPU"


def choose_layout(hardware: Hardware, asked: str = "auto", device: str = "cuda") -> tuple[str, int, str]:
    """(layout, world_size, why): one GPU -> single, several -> DDP (make_plan's memory step may still shard them:
    FSDP), or the layout asked for."""
    if asked not in LAYOUTS:
        raise FreetuneError(f"layout must be one of {LAYOUTS}, not {asked!r}.")
    layout, world_size, why = _machine_layout(hardware)
    if asked == "auto" or device == "cpu" and asked != "fsdp":
        return layout, world_size, why
    if asked != layout:
        why = (f"{asked} as asked (layout={asked!r}), over {world_size} process(es)" if asked != "single"
               else "single as asked (layout='single'): one process on one GPU")
        if asked == "single":
            world_size = 1
    return asked, world_size, why


def _machine_layout(hardware: Hardware) -> tuple[str, int, str]:
    """(layout, world_size, why) from the machine alone."""
    if not hardware.gpus:
        return "cpu", 1, "no GPU"
    n = hardware.torchrun_world_size or hardware.gpu_count
    if n == 1:
        extra = (f" (torchrun started 1 process; {hardware.gpu_count} GPUs visible)"
                 if hardware.gpu_count > 1 else "")
        return "single", 1, "one GPU" + extra
    return "ddp", n, (f"{n} GPUs: DDP, one full model copy per GPU, through torchrun --nproc_per_node={n}; one "
                      f"process seeing {n} GPUs would make the Trainer use nn.DataParallel, which SFTTrainer refuses")


# ---- memory ------------------------------------------------------------------------------------------------------

def choose_shape(model_shape) -> tuple[ModelShape | None, str]:
    """(the model's shape, where it came from or why there is none): from its own config.json (a local folder, or the
    Hub's config.json alone, before any weights: freetune.memory.shape_of)."""
    if model_shape is None:
        return None, "no model given"
    if isinstance(model_shape, ModelShape):
        return model_shape, "as given"
    return shape_of(str(model_shape))


def resolve_shape(model_shape) -> ModelShape | None:
    return choose_shape(model_shape)[0]


def choose_budget(hardware: Hardware, device: str, memory_budget_gib: float | None) -> tuple[float | None, str]:
    """(GiB the plan may fill, why): the smallest GPU's memory, or the CPU RAM available, unless set."""
    if device == "cuda":
        budget = memory_budget_gib or min(g.memory_gib for g in hardware.gpus)
        return budget, "set by memory_budget_gib" if memory_budget_gib else "the smallest GPU's memory"
    budget = memory_budget_gib or hardware.ram_available_gib or hardware.ram_total_gib
    return budget, "set by memory_budget_gib" if memory_budget_gib else "the CPU RAM available"


def choose_checkpointing(asked) -> tuple[bool | None, str]:
    """(on, off, or None when the memory estimate decides it ("auto"), why) for the gradient_checkpointing asked."""
    if asked not in CHECKPOINTING:
        raise FreetuneError(f"gradient_checkpointing = {asked!r}: use 'auto' (on unless the batch fits "
                            f"without it), 'on' or 'off'.")
    if CHECKPOINTING[asked] is None:
        return None, "on: no model shape to check the memory against, so the safe side"
    return CHECKPOINTING[asked], "as given"


# Partial checkpointing keeps every other layer's activations, sized from an estimate: it must fit with this margin.
PARTIAL_CHECKPOINT_MARGIN = 1.10


def choose_checkpoint_every(shape, budget_gib: float, max_length: int, micro_batch: int,
                            common: dict) -> tuple[int, str]:
    """(n, why): checkpoint only every n-th decoder layer (transformers' every_n_layers), the largest n whose estimate
    fits the budget with PARTIAL_CHECKPOINT_MARGIN to spare; 1 (every layer) when none does. The layers left out keep
    their activations and skip the recompute: memory the card has spare, spent on speed."""
    settings = {**common, "gradient_checkpointing": True}
    for every in (8, 4, 3, 2):
        est = estimate(shape, max_length=max_length, micro_batch=micro_batch, **settings, checkpoint_every=every)
        if est.total_gib * PARTIAL_CHECKPOINT_MARGIN <= budget_gib:
            checkpointed = -(-shape.layers // every)
            return every, (f"on for {checkpointed} of {shape.layers} layers (every {every}): all of them off would "
                           f"need more than {budget_gib:.1f} GiB; this way ~{est.total_gib:.1f} GiB, and only "
                           f"those layers are recomputed in the backward")
    return 1, ""


# Checkpointed layers' inputs are offloaded to host memory when they take more than this share of the memory budget.
OFFLOAD_MIN_SHARE = 0.10


def choose_offload(shape, budget_gib: float, max_length: int, micro_batch: int, common: dict) -> tuple[bool, str]:
    """(offload the checkpointed layers' inputs to pinned host memory?, why). The copies overlap with the layers'
    compute (TRL's activation offloading, on a stream of its own); worth it when those inputs are a real share of
    the budget: what they free goes to a larger micro-batch, longer rows, or headroom on a small card."""
    settings = {**common, "gradient_checkpointing": True}
    kept = estimate(shape, max_length=max_length, micro_batch=micro_batch, **settings)
    offloaded = estimate(shape, max_length=max_length, micro_batch=micro_batch,
                         **{**settings, "offload_activations": True})
    freed = kept.activations_gib - offloaded.activations_gib
    if freed > OFFLOAD_MIN_SHARE * budget_gib:
        return True, (f"the layers' saved inputs ({freed:.2f} GiB at {micro_batch} x {max_length} tokens) wait in "
                      f"pinned host memory until their backward, copied alongside the compute")
    return False, (f"the layers' saved inputs stay on the GPU ({freed:.2f} GiB, under {OFFLOAD_MIN_SHARE:.0%} of "
                   f"{budget_gib:.1f} GiB)")


# Fused AdamW's fp32 state (8 bytes per LoRA weight, 2 for paged 8-bit) is taken when the difference stays under
# this share of the GPU memory budget.
FUSED_ADAMW_MAX_SHARE = 0.02


def choose_optimizer(optimizer: str, device: str, shape, budget_gib: float | None, lora_rank: int,
                     lora_targets) -> tuple[str, str]:
    """(Trainer optim name, why)."""
    if device == "cpu" and ("8bit" in optimizer or "paged" in optimizer or optimizer == "auto"):
        # bitsandbytes' 8-bit optimisers need CUDA; the CPU run uses plain AdamW.
        return "adamw_torch", "a CPU run: PyTorch's AdamW (bitsandbytes' 8-bit optimizers need CUDA)"
    if optimizer != "auto":
        return optimizer, "as given"
    if shape is None or not budget_gib:
        return "paged_adamw_8bit", "paged 8-bit AdamW: no model shape to size the fp32 state against"
    extra_gib = shape.lora_params(lora_rank, lora_targets) * 6 / 2**30
    if extra_gib <= FUSED_ADAMW_MAX_SHARE * budget_gib:
        return "adamw_torch_fused", (f"fused AdamW: one launch updates every LoRA weight (8-bit AdamW launches per "
                                     f"tensor); its fp32 state costs {extra_gib * 1024:.0f} MiB more, "
                                     f"<= {FUSED_ADAMW_MAX_SHARE:.0%} of {budget_gib:.1f} GiB")
    return "paged_adamw_8bit", (f"paged 8-bit AdamW: fp32 state would cost {extra_gib * 1024:.0f} MiB more, over "
                                f"{FUSED_ADAMW_MAX_SHARE:.0%} of {budget_gib:.1f} GiB")


# ---- speed: kernels, batching, sampler ---------------------------------------------------------------------------

def choose_lora_kernel(device: str, layout: str) -> tuple[str, str]:
    """(kernel, why) for the plan: "fused" on a GPU, peft's own layers elsewhere."""
    if device != "cuda":
        return "peft", ("a CPU run is a check: peft's layers, whose dropout draws match the plain stack's "
                        "(a CPU is bound by arithmetic, not by launches)")
    if layout == "fsdp":
        return "peft", "FSDP flattens the 4-bit weights into its shards; peft's layers read them back from there"
    return "fused", ("one autograd node per LoRA 4-bit layer instead of ~10 (freetune.kernels): the step of a "
                     "small model is bound by kernel launches, not by the GPU's arithmetic")


def every_layer_checkpointed(common: dict) -> bool:
    """Whether the sizing settings checkpoint every decoder layer: the plan's sign that memory is tight."""
    return bool(common.get("gradient_checkpointing")) and common.get("checkpoint_every", 1) == 1


def choose_mlp_kernel(shape, budget_gib: float, max_length: int, common: dict) -> tuple[str, str]:
    """(MLP kernel, why), where every layer is checkpointed (memory is tight): "traced" (freetune.fused_mlp: the SwiGLU
    MLP as one autograd node in the compiled layer; its backward recomputes gate and up, two more 4-bit matmuls per
    layer on a GPU that waits for the host anyway, and holds two tokens x intermediate tensors instead of seven, and two
    chunks of them);
    "chunked" (the same as one op over token chunks) only where not even one row of max_length fits with the traced
    function, so that rows are not cut: it is host-bound, at about half the tokens/s (docs/performance.md). "layers"
    (each projection a fused LoRA layer) where not every layer is checkpointed: the gate and up outputs are then
    kept from the forward, not computed twice."""
    if common.get("lora_kernel") != "fused":
        return "layers", ("each projection on its own, as peft runs it (the fused MLP is for GPU runs, over "
                          "fused LoRA layers)")
    if mlp_why_not(shape):
        return "layers", f"each projection on its own: the fused MLP steps aside, {mlp_why_not(shape)}"
    if not every_layer_checkpointed(common):
        return "layers", "not every layer is checkpointed: there is memory to spare"
    settings = {**common, "mlp_kernel": "traced"}
    one_row = estimate(shape, max_length=max_length, micro_batch=1, **settings)
    if one_row.total_gib <= budget_gib:
        return "traced", ("every layer is checkpointed: the MLP's backward recomputes gate and up instead of keeping "
                          "them and holds 2 instead of 7 tokens x intermediate tensors (freetune.fused_mlp), for a "
                          "larger micro-batch in the same memory")
    chunked = estimate(shape, max_length=max_length, micro_batch=1, **{**settings, "mlp_kernel": "chunked"})
    return "chunked", (f"one row of {max_length} tokens needs ~{one_row.total_gib:.1f} GiB with the MLP as one node, "
                       f"~{chunked.total_gib:.1f} with its backward in chunks of tokens (freetune.fused_mlp), "
                       f"of {budget_gib:.1f} GiB: rows need not be cut")


# Tokens per tile of TRL's chunked loss head where every layer is checkpointed (memory is tight): a tile holds this many
# tokens x 32,768 logits in the compute dtype, recomputed in the backward; smaller tiles are only more, smaller matmuls.
TIGHT_LOSS_TILE_TOKENS = 1024


def choose_loss_tile(common: dict) -> tuple[int, str]:
    """(tokens per tile of TRL's chunked loss head, 0 for TRL's own; why)."""
    if (common.get("device") != "cuda" or common.get("loss_head", "chunked") != "chunked"
            or not every_layer_checkpointed(common)):
        return 0, f"TRL's {TILE_TOKENS:,} tokens per tile"
    return TIGHT_LOSS_TILE_TOKENS, (f"{TIGHT_LOSS_TILE_TOKENS:,} tokens per tile, not TRL's {TILE_TOKENS:,}: every "
                                    f"layer is checkpointed, and a tile of logits is a real share of the memory")


# With CUDA graphs the loss head's tiles are smaller: the graphs' buffers are paid for there (and by 8-bit AdamW).
GRAPHS_LOSS_TILE_TOKENS = 512


def choose_cuda_graphs(common: dict, layout: str, lora_dropout: float | None,
                       shape: ModelShape | None = None) -> tuple[bool, str]:
    """(replay the checkpointed decoder layers as CUDA graphs?, why): freetune.graphed_layers, where every layer is
    checkpointed in one CUDA process with fused, compiled LoRA layers, padding-free rows and no dropout.
    lora_dropout None: no padding-free rows on this machine."""
    if common.get("device") != "cuda":
        return False, "off: a CPU run"
    if graphs_why_not(shape):
        return False, f"off (they step aside): {graphs_why_not(shape)}"
    needs = [(lora_dropout is not None, "padding-free rows (a variable-length attention kernel)"),
             (layout == "single" and common.get("world_size", 1) == 1, "one process"),
             (every_layer_checkpointed(common), "every layer checkpointed"),
             (common.get("lora_kernel") == "fused", "fused LoRA layers"),
             (bool(common.get("compiled")), "compiled layers"),
             (not lora_dropout, "LoRA dropout 0 (a replayed recompute would draw other random numbers)")]
    missing = [what for ok, what in needs if not ok]
    if missing:
        return False, "off: they need " + ", ".join(missing)
    return True, ("each checkpointed layer's forward and backward recorded once per token count and replayed: one "
                  "launch for a layer's work, where the small model's step was bound by the host's launches; "
                  "padding-free batches padded to a multiple of a few hundred tokens for it; "
                  f"{GRAPHS_LOSS_TILE_TOKENS}-token loss tiles (and 8-bit AdamW, where the optimizer is auto) pay "
                  "for its buffers")


def graph_tokens(micro_batch: int, max_length: int) -> int:
    """The multiple of tokens padding-free batches are padded to for CUDA graphs: an eighth of the largest batch
    (at most eight token counts, each recorded once), at least 256, in steps of 64."""
    eighth = -(-micro_batch * max_length // 8)
    return max(256, -(-eighth // 64) * 64)


def choose_embeddings(shape, common: dict, layout: str) -> tuple[bool, str]:
    """(keep the input embedding table in host RAM?, why): on one GPU where every layer is checkpointed (memory is
    tight), unless the lm_head shares the table (freetune.host_embeddings)."""
    size = embedding_bytes(shape, common.get("frozen_dtype", "float32")) / 2**20
    if common.get("device") != "cuda":
        return False, "a CPU run: the whole model is in host RAM already"
    if shape.tied_embeddings:
        return False, f"on the GPU: the lm_head shares the table ({size:,.0f} MiB), and the loss needs it there"
    if layout != "single":
        return False, "on the GPUs: DDP and FSDP keep every weight of the model on each rank's GPU"
    if not every_layer_checkpointed(common):
        return False, f"on the GPU ({size:,.0f} MiB): not every layer is checkpointed, there is memory to spare"
    return True, (f"in host RAM, {size:,.0f} MiB off the GPU: each micro-batch's tokens are looked up there and only "
                  f"their rows copied to the GPU (the lm_head is a weight of its own and stays)")


def choose_compile(compile_layers: str, device: str, layout: str, shape=None) -> tuple[bool, str]:
    """(compile each decoder layer?, why) for the plan; compile_layers is "auto", "on" or "off"."""
    if compile_layers not in ("auto", "on", "off"):
        raise FreetuneError(f"compile = {compile_layers!r}: use 'auto' (on a GPU), 'on' or 'off'.")
    if compile_layers != "auto":
        return compile_layers == "on", "as given"
    if device != "cuda":
        return False, "a CPU run is a check: eager, as the plain stack runs"
    if layout == "fsdp":
        return False, "FSDP: its flat parameters and compiled layers are not combined here"
    if shape is not None and shape.experts:
        # Measured on an H200 (reports/gpu/architectures_t4_emulated.json): dynamo breaks the graph at transformers'
        # grouped_mm fallback and recompiles peft's ParamWrapper per layer until its limit, 1,090 tok/s against 45,471
        # for the eager layers: the same gradients, 40x slower.
        return False, (f"{shape.name} is a mixture of experts: torch.compile breaks its graph at the experts' "
                       f"grouped matmul and recompiles per layer (40x slower, measured): eager layers")
    return True, ("torch.compile per decoder layer: its norms, rotary, SiLU-gate and casts fuse into a few kernels, "
                  "fewer launches and less activation memory; the first steps compile (a minute or two)")


def this_gpu() -> int:
    """This process's GPU (under torchrun, LOCAL_RANK's), where the varlen kernel is probed and its choice kept:
    probing GPU 0 from every rank would put a CUDA context on it for each of them."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else 0


def varlen_attention_reason() -> str:
    """The plan's attention reason once padding-free batching chose freetune's varlen attention."""
    return (f"padding-free rows through PyTorch's variable-length "
            f"{VARLEN_KERNEL_NAMES.get(varlen_backend(this_gpu()), 'attention')} kernel (freetune.fast); anything "
            f"else through sdpa")


def choose_batching(policy: str, gpus_capability: list[tuple[int, int]], micro_batch: int,
                    shape: ModelShape | None = None, max_length: int = 0) -> tuple[str, str, str]:
    """(batching, attn_implementation or "" to keep the plan's, why) for a policy ('turing', 'ampere', 'cpu')."""
    if micro_batch <= 1:
        return "padded", "", "one row per forward pass: nothing to pad"
    if policy == "cpu":
        # A CPU run is a check, not a training run: it keeps the plain stack's batches, so its losses can be
        # compared with the plain stack's row for row (LoRA dropout draws other masks for a packed row). On a
        # CPU sdpa would also compute a packed row's dense block-diagonal mask in full, as on a T4.
        return "padded", "", "a CPU run is a check: the plain stack's padded batches, same rows, same dropout draws"
    if varlen_why_not(shape, max_length):
        return ("grouped", "", f"padded batches of similar length, little padding (padding-free attention steps "
                               f"aside: {varlen_why_not(shape, max_length)})")
    if policy in POLICY_BACKENDS and gpus_capability:
        ok, why = varlen_works(this_gpu(), policy)
        if ok:
            kernel = ("the memory-efficient variable-length attention kernel, which a T4 (sm75) runs too,"
                      if varlen_backend(this_gpu()) in EFFICIENT_BACKENDS else "variable-length FlashAttention")
            return ("padding_free", VARLEN_ATTENTION,
                    f"rows concatenated (padded to a multiple of 8 tokens only); {kernel} keeps them apart ({why})")
        return ("grouped", "", f"padded batches of similar length, little padding (no padding-free kernel: {why})")
    return ("grouped", "", "padded batches of similar length, little padding")


def choose_sampler(batching: str, processes: int) -> tuple[str, str]:
    """(sampler, why): which rows each rank gets in each micro-batch."""
    if processes > 1:
        return "rank_balanced", (f"each optimizer step's rows dealt to the {processes} ranks by length, equal "
                                 f"tokens each: no rank waits for a longer one at the gradient all-reduce")
    if batching == "grouped":
        return "length_grouped", "rows of similar length share a padded micro-batch"
    return "random", "rows in random order"
