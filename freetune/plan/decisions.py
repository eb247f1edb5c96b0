"""Every decision of the training plan, one function each: a Decision(value, why) from the machine and what was asked.

freetune.plan.make calls them in order, as short steps; nothing else chooses. Each returns its value and the reason the
plan table shows beside it, so a reader of a plan can tell why it is what it is. The decisions that weigh the memory
estimate are in freetune.plan.sizing.

The precision policy, and why:
- Turing (T4, sm_75): fp16 tensor cores, no fast bf16. Compute in fp16 with fp16 mixed precision (loss
  scaling). The non-quantised weights load in fp16 even when the checkpoint says bfloat16: bf16 tensors on the
  fp16 path fail with `"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'`.
  LoRA weights stay fp32 (the GradScaler refuses to unscale fp16 gradients, and fp16 weights lose small updates).
- Ampere and newer (sm_80+): bf16, which has fp32's range and needs no loss scaling.
- No GPU: fp32 on the CPU (checks and smoke runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from freetune.errors import FreetuneError
from freetune.plan.hardware import Hardware, VarlenProbe
from freetune.plan.shapes import ModelShape, shape_of

POLICIES = ("turing", "ampere")
LAYOUTS = ("auto", "single", "ddp", "fsdp")
# A recipe parameter is a string ("auto" / "on" / "off": papermill cannot read a `bool | str` annotation); library
# callers may pass a bool. None: decided by memory.
CHECKPOINTING = {"auto": None, None: None, "on": True, True: True, "off": False, False: False}


@dataclass(frozen=True)
class Decision:
    """One choice of the plan: its value and the reason the plan's table shows beside it (warnings: what the plan
    must say besides, e.g. bf16 forced on a card without it)."""

    value: Any
    why: str
    warnings: tuple = ()


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


def choose_policy(hardware: Hardware, force_policy: str | None) -> Decision:
    """'turing' | 'ampere' | 'cpu'. The why is the compute dtype's reason."""
    if not hardware.gpus:
        warnings = ((f"precision forced to the {force_policy} policy, but there is no GPU: fp32 on the CPU",)
                    if force_policy else ())
        return Decision("cpu", "no GPU: fp32 on the CPU (16-bit math there is slow or unsupported); for checks and "
                               "smoke runs", warnings)
    slowest = min(hardware.gpus, key=lambda g: g.capability)
    if force_policy == "turing":
        return Decision("turing", f"forced (precision='fp16'): the T4 policy, fp16, on {slowest.name}")
    if force_policy == "ampere":
        if slowest.capability < (8, 0) or not hardware.bf16_supported:
            return Decision("ampere", f"forced (precision='bf16') on {slowest.name}", (
                f"bf16 forced on {slowest.name} ({slowest.sm}), which has no native bf16: expect slow or failing "
                f"kernels. Use precision='auto' (fp16) on this GPU",))
        return Decision("ampere", f"forced (precision='bf16') on {slowest.name}")
    if slowest.capability >= (8, 0) and hardware.bf16_supported:
        return Decision("ampere", f"{slowest.name} is {slowest.sm} (Ampere or newer): bf16, fp32's range at 16-bit "
                                  f"cost")
    if slowest.capability >= (8, 0):
        return Decision("turing", f"{slowest.name} is {slowest.sm} but this torch reports no bf16 on it: fp16")
    return Decision("turing", f"{slowest.name} is {slowest.sm} (Turing or older): fp16 tensor cores, no fast bf16")


COMPUTE_DTYPES = {"cpu": "float32", "turing": "float16", "ampere": "bfloat16"}


def choose_mixed_precision(policy: str) -> Decision:
    """The Trainer's autocast mode for a policy."""
    if policy == "cpu":
        return Decision("no", "no autocast on the CPU")
    if policy == "turing":
        return Decision("fp16", "fp16 autocast with loss scaling (GradScaler)")
    return Decision("bf16", "bf16 autocast; no loss scaling needed")


def choose_load_dtype(policy: str) -> Decision:
    """The dtype the non-quantised weights load in: the compute dtype, never the checkpoint's."""
    why = {"cpu": "fp32 like the compute",
           "turing": "fp16 even if the checkpoint says bfloat16: bf16 tensors on the fp16 path fail with "
                     "'_amp_foreach_non_finite_check_and_unscale_cuda' not implemented for 'BFloat16'"}
    return Decision(COMPUTE_DTYPES[policy], why.get(policy, "bf16, the dtype the compute runs in"))


def choose_lora_dtype(policy: str) -> Decision:
    if policy == "cpu":
        return Decision("float32", "fp32")
    if policy == "turing":
        return Decision("float32", "fp32 (peft autocast_adapter_dtype): the GradScaler cannot unscale fp16 gradients, "
                                   "and fp16 weights lose small updates")
    return Decision("float32", "fp32 (peft autocast_adapter_dtype): bf16 weights lose small updates")


def choose_frozen_dtype(policy: str) -> Decision:
    """The dtype of the frozen non-4-bit weights."""
    if policy == "cpu":
        return Decision("float32", "a CPU run is a check: fp32 as peft's prepare_model_for_kbit_training leaves them")
    compute_dtype = COMPUTE_DTYPES[policy]
    return Decision(compute_dtype, (f"the frozen embeddings, norms and head stay {compute_dtype}, as loaded: nothing "
                                    f"trains them, so peft's fp32 upcast would only double their memory and that of "
                                    f"the residual stream every layer saves"))


# ---- what the architecture allows ----------------------------------------------------------------------------------

def varlen_why_not(shape: ModelShape | None, max_length: int) -> str:
    """Why freetune's padding-free attention (freetune.speed.attention) cannot honour this model ('' where it can): its kernels
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
    """Why freetune.speed.cuda_graphs cannot replay this model's layers ('' where it can): it replays one set of keyword
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
    """Why freetune.speed.mlp cannot stand in for this model's MLP ('' where it can)."""
    from freetune.speed.mlp import MLP_MODEL_TYPES

    if shape is None or shape.model_type in MLP_MODEL_TYPES:
        return ""
    if shape.experts:
        return f"{shape.model_type}'s MLP is a mixture of {shape.experts} experts"
    return (f"{shape.model_type or shape.name}'s MLP is not one it knows ({', '.join(sorted(MLP_MODEL_TYPES))}: "
            f"separate gate, up and down projections with SiLU)")


def choose_attention(hardware: Hardware, policy: str, shape: ModelShape | None = None) -> Decision:
    """attn_implementation: sdpa by default, FlashAttention 2 where installed and sm80+, eager only if torch has no
    sdpa, or for soft-capped attention logits (transformers' sdpa drops the cap)."""
    if shape is not None and shape.attn_softcap:
        return Decision("eager", f"{shape.model_type or shape.name} soft-caps its attention logits "
                                 f"({shape.attn_softcap:g}): transformers' eager attention applies the cap, sdpa would "
                                 f"drop it")
    if not hardware.sdpa:
        return Decision("eager", "this torch has no scaled_dot_product_attention (torch < 2.0): eager")
    if (policy == "ampere" and hardware.flash_attn and hardware.gpus
            and all(g.capability >= (8, 0) for g in hardware.gpus)):
        return Decision("flash_attention_2", "flash-attn is installed and every GPU is sm80+: FlashAttention 2")
    if policy == "turing":
        return Decision("sdpa", "PyTorch's fused attention (memory-efficient kernel on Turing); never the seq x seq "
                                "matrix")
    if policy == "ampere":
        why = "PyTorch's fused attention (FlashAttention kernel on sm80+)"
        return Decision("sdpa", why + ("; pip install flash-attn to use FlashAttention 2 directly"
                                       if not hardware.flash_attn else ""))
    return Decision("sdpa", "PyTorch's fused attention, which also runs on a CPU")


def varlen_attention(probe: VarlenProbe) -> Decision:
    """The attention once padding-free batching chose freetune's varlen attention."""
    return Decision(probe.attention, f"padding-free rows through PyTorch's variable-length {probe.kernel} kernel "
                                     f"(freetune.speed.attention); anything else through sdpa")


def choose_layout(hardware: Hardware, asked: str = "auto", device: str = "cuda") -> Decision:
    """One GPU -> single, several -> DDP (make_plan's memory step may still shard them: FSDP), or the layout asked
    for. Its processes: world_size(hardware, layout)."""
    if asked not in LAYOUTS:
        raise FreetuneError(f"layout must be one of {LAYOUTS}, not {asked!r}.")
    machine = _machine_layout(hardware)
    if asked == "auto" or device == "cpu" and asked != "fsdp" or asked == machine.value:
        return machine
    return Decision(asked, f"{asked} as asked (layout={asked!r}), over {world_size(hardware, asked)} process(es)"
                    if asked != "single" else "single as asked (layout='single'): one process on one GPU")


def world_size(hardware: Hardware, layout: str) -> int:
    """The processes a layout runs on this machine: one per GPU (or per torchrun process) unless single."""
    if not hardware.gpus or layout == "single":
        return 1
    return hardware.torchrun_world_size or hardware.gpu_count


def _machine_layout(hardware: Hardware) -> Decision:
    """The layout from the machine alone."""
    if not hardware.gpus:
        return Decision("cpu", "no GPU")
    n = world_size(hardware, "auto")
    if n == 1:
        extra = (f" (torchrun started 1 process; {hardware.gpu_count} GPUs visible)"
                 if hardware.gpu_count > 1 else "")
        return Decision("single", "one GPU" + extra)
    return Decision("ddp", f"{n} GPUs: DDP, one full model copy per GPU, through torchrun --nproc_per_node={n}; one "
                           f"process seeing {n} GPUs would make the Trainer use nn.DataParallel, which SFTTrainer "
                           f"refuses")


# ---- the model, the budget and what was asked ------------------------------------------------------------------

def choose_shape(model_shape) -> Decision:
    """The model's shape (None where there is none), from its own config.json (a local folder, or the Hub's
    config.json alone, before any weights: freetune.plan.shapes.shape_of); the why says where it came from."""
    if model_shape is None:
        return Decision(None, "no model given")
    if isinstance(model_shape, ModelShape):
        return Decision(model_shape, "as given")
    return Decision(*shape_of(str(model_shape)))


def resolve_shape(model_shape) -> ModelShape | None:
    return choose_shape(model_shape).value


def choose_budget(hardware: Hardware, device: str, memory_budget_gib: float | None) -> Decision:
    """GiB the plan may fill: the smallest GPU's memory, or the CPU RAM available, unless set."""
    if device == "cuda":
        budget = memory_budget_gib or min(g.memory_gib for g in hardware.gpus)
        return Decision(budget, "set by memory_budget_gib" if memory_budget_gib else "the smallest GPU's memory")
    budget = memory_budget_gib or hardware.ram_available_gib or hardware.ram_total_gib
    return Decision(budget, "set by memory_budget_gib" if memory_budget_gib else "the CPU RAM available")


def choose_checkpointing(asked) -> Decision:
    """On, off, or None when the memory estimate decides it ("auto"), for the gradient_checkpointing asked."""
    if asked not in CHECKPOINTING:
        raise FreetuneError(f"gradient_checkpointing = {asked!r}: use 'auto' (on unless the batch fits "
                            f"without it), 'on' or 'off'.")
    if CHECKPOINTING[asked] is None:
        return Decision(None, "on: no model shape to check the memory against, so the safe side")
    return Decision(CHECKPOINTING[asked], "as given")


# ---- speed: kernels, batching, sampler ---------------------------------------------------------------------------

def choose_lora_kernel(device: str, layout: str) -> Decision:
    """"fused" on a GPU, peft's own layers elsewhere."""
    if device != "cuda":
        return Decision("peft", "a CPU run is a check: peft's layers, whose dropout draws match the plain stack's "
                                "(a CPU is bound by arithmetic, not by launches)")
    if layout == "fsdp":
        return Decision("peft", "FSDP flattens the 4-bit weights into its shards; peft's layers read them back from "
                                "there")
    return Decision("fused", "one autograd node per LoRA 4-bit layer instead of ~10 (freetune.speed.lora_kernel): the step of a "
                             "small model is bound by kernel launches, not by the GPU's arithmetic")


def choose_compile(compile_layers: str, device: str, layout: str, shape=None) -> Decision:
    """Compile each decoder layer? compile_layers is "auto", "on" or "off"."""
    if compile_layers not in ("auto", "on", "off"):
        raise FreetuneError(f"compile = {compile_layers!r}: use 'auto' (on a GPU), 'on' or 'off'.")
    if compile_layers != "auto":
        return Decision(compile_layers == "on", "as given")
    if device != "cuda":
        return Decision(False, "a CPU run is a check: eager, as the plain stack runs")
    if layout == "fsdp":
        return Decision(False, "FSDP: its flat parameters and compiled layers are not combined here")
    if shape is not None and shape.experts:
        # Measured on an H200 (reports/gpu/architectures_t4_emulated.json): dynamo breaks the graph at transformers'
        # grouped_mm fallback and recompiles peft's ParamWrapper per layer until its limit, 1,090 tok/s against 45,471
        # for the eager layers: the same gradients, 40x slower.
        return Decision(False, f"{shape.name} is a mixture of experts: torch.compile breaks its graph at the experts' "
                               f"grouped matmul and recompiles per layer (40x slower, measured): eager layers")
    return Decision(True, "torch.compile per decoder layer: its norms, rotary, SiLU-gate and casts fuse into a few "
                          "kernels, fewer launches and less activation memory; the first steps compile (a minute or "
                          "two)")


def needs_varlen_probe(policy: str, hardware: Hardware, micro_batch: int, shape: ModelShape | None,
                       max_length: int) -> bool:
    """Whether choose_batching would weigh the variable-length kernels: only then is this GPU's kernel probed."""
    return (micro_batch > 1 and policy in POLICIES and bool(hardware.gpus)
            and not varlen_why_not(shape, max_length))


def choose_batching(policy: str, micro_batch: int, shape: ModelShape | None = None, max_length: int = 0,
                    varlen: VarlenProbe | None = None) -> Decision:
    """How a micro-batch's rows are laid out for a policy ('turing', 'ampere', 'cpu'); varlen: this GPU's probe of
    its variable-length kernels (None: not probed, no GPU)."""
    if micro_batch <= 1:
        return Decision("padded", "one row per forward pass: nothing to pad")
    if policy == "cpu":
        # A CPU run is a check, not a training run: it keeps the plain stack's batches, so its losses can be
        # compared with the plain stack's row for row (LoRA dropout draws other masks for a packed row). On a
        # CPU sdpa would also compute a packed row's dense block-diagonal mask in full, as on a T4.
        return Decision("padded", "a CPU run is a check: the plain stack's padded batches, same rows, same dropout "
                                  "draws")
    if varlen_why_not(shape, max_length):
        return Decision("grouped", f"padded batches of similar length, little padding (padding-free attention steps "
                                   f"aside: {varlen_why_not(shape, max_length)})")
    if varlen is None:
        return Decision("grouped", "padded batches of similar length, little padding")
    if varlen.works:
        kernel = ("the memory-efficient variable-length attention kernel, which a T4 (sm75) runs too,"
                  if varlen.efficient else "variable-length FlashAttention")
        return Decision("padding_free", f"rows concatenated (padded to a multiple of 8 tokens only); {kernel} keeps "
                                        f"them apart ({varlen.why})")
    return Decision("grouped", f"padded batches of similar length, little padding (no padding-free kernel: "
                               f"{varlen.why})")


def choose_sampler(batching: str, processes: int) -> Decision:
    """Which rows each rank gets in each micro-batch."""
    if processes > 1:
        return Decision("rank_balanced", f"each optimizer step's rows dealt to the {processes} ranks by length, "
                                         f"equal tokens each: no rank waits for a longer one at the gradient "
                                         f"all-reduce")
    if batching == "grouped":
        return Decision("length_grouped", "rows of similar length share a padded micro-batch")
    return Decision("random", "rows in random order")
