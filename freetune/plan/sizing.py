"""The decisions that weigh the memory estimate (freetune.plan.memory): which layers are checkpointed, offloading,
the optimizer, the MLP kernel, the loss head's tiles, the input embeddings' place, CUDA graphs. Each returns a
Decision(value, why); MemorySettings is the estimate's settings as the plan has decided them so far, a frozen record
each step replaces one value of."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from freetune.plan.decisions import Decision, graphs_why_not, mlp_why_not
from freetune.plan.memory import (TILE_TOKENS, MemoryEstimate, embedding_bytes, estimate,
                                  whole_heads_attention_bytes)
from freetune.plan.shapes import ModelShape


@dataclass(frozen=True)
class MemorySettings:
    """freetune.plan.memory.estimate's keywords besides the shape and the batch, as decided so far."""

    lora_rank: int = 16
    lora_targets: str | list[str] = "all-linear"
    gradient_checkpointing: bool = True
    optimizer: str = "paged_adamw_8bit"
    compute_dtype: str = "bfloat16"
    device: str = "cuda"
    world_size: int = 1
    loss_head: str = "chunked"
    lora_kernel: str = "peft"
    frozen_dtype: str = "float32"
    compiled: bool = False
    checkpoint_every: int = 1
    offload_activations: bool = False
    mlp_kernel: str = "layers"
    loss_tile_tokens: int = 0
    embeddings_on_host: bool = False
    cuda_graphs: bool = False
    shards: int = 1
    attention_whole_heads: bool = False

    def estimate(self, shape: ModelShape, max_length: int, micro_batch: int, budget_gib: float | None = None,
                 **changed) -> MemoryEstimate:
        """The estimate at micro_batch rows of max_length tokens with these settings (some `changed`)."""
        est = estimate(shape, max_length=max_length, micro_batch=micro_batch, **{**asdict(self), **changed})
        est.budget_gib = budget_gib
        return est

    @property
    def every_layer_checkpointed(self) -> bool:
        """The plan's sign that memory is tight."""
        return self.gradient_checkpointing and self.checkpoint_every == 1


def every_layer_checkpointed(settings: MemorySettings) -> bool:
    return settings.every_layer_checkpointed


# Partial checkpointing keeps every other layer's activations, sized from an estimate: it must fit with this margin.
PARTIAL_CHECKPOINT_MARGIN = 1.10


def choose_checkpoint_every(shape: ModelShape, budget_gib: float, max_length: int, micro_batch: int,
                            settings: MemorySettings) -> Decision:
    """Checkpoint only every n-th decoder layer (transformers' every_n_layers), the largest n whose estimate fits the
    budget with PARTIAL_CHECKPOINT_MARGIN to spare; 1 (every layer) when none does. The layers left out keep their
    activations and skip the recompute: memory the card has spare, spent on speed. Every n up to the layer count is
    tried, not only a few: Qwen2.5-1.5B's 8 x 1,024 tokens under a 14.5 GiB budget fit every 5 (6 layers recomputed),
    where trying 8, 4, 3, 2 settled for every 4 (7 layers; issue 49, docs/performance.md)."""
    for every in range(max(2, shape.layers), 1, -1):
        est = settings.estimate(shape, max_length, micro_batch, gradient_checkpointing=True, checkpoint_every=every)
        if est.total_gib * PARTIAL_CHECKPOINT_MARGIN <= budget_gib:
            checkpointed = -(-shape.layers // every)
            return Decision(every, f"on for {checkpointed} of {shape.layers} layers (every {every}): all of them off "
                                   f"would need more than {budget_gib:.1f} GiB; this way ~{est.total_gib:.1f} GiB, and "
                                   f"only those layers are recomputed in the backward")
    return Decision(1, "")


# Checkpointed layers' inputs are offloaded to host memory when they take more than this share of the memory budget.
OFFLOAD_MIN_SHARE = 0.10


def choose_offload(shape: ModelShape, budget_gib: float, max_length: int, micro_batch: int,
                   settings: MemorySettings) -> Decision:
    """Offload the checkpointed layers' inputs to pinned host memory? The copies overlap with the layers' compute
    (TRL's activation offloading, on a stream of its own); worth it when those inputs are a real share of the budget:
    what they free goes to a larger micro-batch, longer rows, or headroom on a small card."""
    kept = settings.estimate(shape, max_length, micro_batch, gradient_checkpointing=True)
    offloaded = settings.estimate(shape, max_length, micro_batch, gradient_checkpointing=True,
                                  offload_activations=True)
    freed = kept.activations_gib - offloaded.activations_gib
    if freed > OFFLOAD_MIN_SHARE * budget_gib:
        return Decision(True, f"the layers' saved inputs ({freed:.2f} GiB at {micro_batch} x {max_length} tokens) "
                              f"wait in pinned host memory until their backward, copied alongside the compute")
    return Decision(False, f"the layers' saved inputs stay on the GPU ({freed:.2f} GiB, under "
                           f"{OFFLOAD_MIN_SHARE:.0%} of {budget_gib:.1f} GiB)")


# Fused AdamW's fp32 state (8 bytes per LoRA weight, 2 for paged 8-bit) is taken when the difference stays under
# this share of the GPU memory budget.
FUSED_ADAMW_MAX_SHARE = 0.02


def choose_optimizer(optimizer: str, device: str, shape, budget_gib: float | None, lora_rank: int,
                     lora_targets) -> Decision:
    """The Trainer's optim name."""
    if device == "cpu" and ("8bit" in optimizer or "paged" in optimizer or optimizer == "auto"):
        # bitsandbytes' 8-bit optimisers need CUDA; the CPU run uses plain AdamW.
        return Decision("adamw_torch", "a CPU run: PyTorch's AdamW (bitsandbytes' 8-bit optimizers need CUDA)")
    if optimizer != "auto":
        return Decision(optimizer, "as given")
    if shape is None or not budget_gib:
        return Decision("paged_adamw_8bit", "paged 8-bit AdamW: no model shape to size the fp32 state against")
    extra_gib = shape.lora_params(lora_rank, lora_targets) * 6 / 2**30
    if extra_gib <= FUSED_ADAMW_MAX_SHARE * budget_gib:
        return Decision("adamw_torch_fused", f"fused AdamW: fp32 moments (no 8-bit rounding), in one launch; they "
                                             f"cost {extra_gib * 1024:.0f} MiB more, <= {FUSED_ADAMW_MAX_SHARE:.0%} "
                                             f"of {budget_gib:.1f} GiB")
    return Decision("paged_adamw_8bit", f"paged 8-bit AdamW: fp32 state would cost {extra_gib * 1024:.0f} MiB more, "
                                        f"over {FUSED_ADAMW_MAX_SHARE:.0%} of {budget_gib:.1f} GiB")


# With CUDA graphs the loss head's tiles are smaller: the graphs' buffers are paid for there (and by 8-bit AdamW).
GRAPHS_LOSS_TILE_TOKENS = 512
# Fused AdamW measured +5-7% tokens/s with the graphs (GPU-bound long rows, docs/performance.md, issue 49), but its
# ~72 MiB more state for TinyLlama put the 4 GiB plan over Unsloth's peak on bench.py's default rows: 8-bit AdamW stays.
# Not paged either, where a tight budget chose paged 8-bit AdamW: the same 2 bytes per LoRA value in the estimate, but
# bitsandbytes updates paged state a weight at a time after a sync (26 ms of a 320 ms GPU-bound step against 7 ms in
# one launch, Qwen2.5-1.5B's long rows at the peer's memory, issue 49's fifth session of 2026-12-05).
GRAPHS_OPTIMIZER = Decision("adamw_8bit", "8-bit AdamW, not paged: a quarter of fused AdamW's state, which pays for "
                                          "the CUDA graphs' buffers; a launch per 16 MiB of LoRA weights updates them "
                                          "(freetune.speed.optimizer), where paged state is updated a weight at a time")
GRAPHS_LOSS_TILE = Decision(GRAPHS_LOSS_TILE_TOKENS, f"{GRAPHS_LOSS_TILE_TOKENS:,} tokens per tile: the CUDA graphs' "
                                                     f"buffers are paid for here")


def choose_mlp_kernel(shape: ModelShape, budget_gib: float, max_length: int, settings: MemorySettings) -> Decision:
    """The MLP kernel, where every layer is checkpointed (memory is tight): "traced" (freetune.speed.mlp: the SwiGLU
    MLP as one autograd node in the compiled layer; its backward recomputes gate and up, two more 4-bit matmuls per
    layer on a GPU that waits for the host anyway (under the CUDA graphs' checkpoint the recompute skips the MLP's own
    gate, up and down instead: freetune.speed.recompute), and holds two tokens x intermediate tensors instead of seven,
    and two chunks of them);
    "chunked" (the same as one op over token chunks) only where not even one row of max_length fits with the traced
    function, so that rows are not cut: it is host-bound, at about half the tokens/s (docs/performance.md). "layers"
    (each projection a fused LoRA layer) where not every layer is checkpointed: the gate and up outputs are then
    kept from the forward, not computed twice."""
    if settings.lora_kernel != "fused":
        return Decision("layers", "each projection on its own, as peft runs it (the fused MLP is for GPU runs, over "
                                  "fused LoRA layers)")
    if mlp_why_not(shape):
        return Decision("layers", f"each projection on its own: the fused MLP steps aside, {mlp_why_not(shape)}")
    if not settings.every_layer_checkpointed:
        return Decision("layers", "not every layer is checkpointed: there is memory to spare")
    one_row = settings.estimate(shape, max_length, 1, mlp_kernel="traced")
    if one_row.total_gib <= budget_gib:
        return Decision("traced", "every layer is checkpointed: the MLP's backward recomputes gate and up instead of "
                                  "keeping them and holds 2 instead of 7 tokens x intermediate tensors "
                                  "(freetune.speed.mlp), for a larger micro-batch in the same memory")
    chunked = settings.estimate(shape, max_length, 1, mlp_kernel="chunked")
    return Decision("chunked", f"one row of {max_length} tokens needs ~{one_row.total_gib:.1f} GiB with the MLP as one "
                               f"node, ~{chunked.total_gib:.1f} with its backward in chunks of tokens "
                               f"(freetune.speed.mlp), of {budget_gib:.1f} GiB: rows need not be cut")


# Tokens per tile of TRL's chunked loss head where every layer is checkpointed (memory is tight): a tile holds this many
# tokens x 32,768 logits in the compute dtype, recomputed in the backward; smaller tiles are only more, smaller matmuls.
TIGHT_LOSS_TILE_TOKENS = 1024


def choose_loss_tile(settings: MemorySettings) -> Decision:
    """Tokens per tile of TRL's chunked loss head, 0 for TRL's own."""
    if settings.device != "cuda" or settings.loss_head != "chunked" or not settings.every_layer_checkpointed:
        return Decision(0, f"TRL's {TILE_TOKENS:,} tokens per tile")
    return Decision(TIGHT_LOSS_TILE_TOKENS, f"{TIGHT_LOSS_TILE_TOKENS:,} tokens per tile, not TRL's {TILE_TOKENS:,}: "
                                            f"every layer is checkpointed, and a tile of logits is a real share of "
                                            f"the memory")


def choose_cuda_graphs(settings: MemorySettings, layout: str, lora_dropout: float | None,
                       shape: ModelShape | None = None) -> Decision:
    """Replay the checkpointed decoder layers as CUDA graphs? freetune.speed.cuda_graphs, where every layer is
    checkpointed in one CUDA process with fused, compiled LoRA layers, padding-free rows and no dropout.
    lora_dropout None: no padding-free rows on this machine."""
    if settings.device != "cuda":
        return Decision(False, "off: a CPU run")
    if graphs_why_not(shape):
        return Decision(False, f"off (they step aside): {graphs_why_not(shape)}")
    needs = [(lora_dropout is not None, "padding-free rows (a variable-length attention kernel)"),
             (layout == "single" and settings.world_size == 1, "one process"),
             (settings.every_layer_checkpointed, "every layer checkpointed"),
             (settings.lora_kernel == "fused", "fused LoRA layers"),
             (settings.compiled, "compiled layers"),
             (not lora_dropout, "LoRA dropout 0 (a replayed recompute would draw other random numbers)")]
    missing = [what for ok, what in needs if not ok]
    if missing:
        return Decision(False, "off: they need " + ", ".join(missing))
    return Decision(True, "each checkpointed layer's forward and backward recorded once per token count and replayed: "
                          "one launch for a layer's work, where the small model's step was bound by the host's "
                          "launches; padding-free batches padded to a multiple of a few hundred tokens for it; "
                          f"{GRAPHS_LOSS_TILE_TOKENS}-token loss tiles (and 8-bit AdamW, where the optimizer is auto) "
                          "pay for its buffers")


def graph_tokens(micro_batch: int, max_length: int) -> int:
    """The multiple of tokens padding-free batches are padded to for CUDA graphs: an eighth of the largest batch
    (at most eight token counts, each recorded once), at least 256, in steps of 64."""
    eighth = -(-micro_batch * max_length // 8)
    return max(256, -(-eighth // 64) * 64)


def graph_buffer_tokens(micro_batch: int, max_length: int, multiple: int) -> int:
    """The largest padded batch the CUDA graphs' buffers hold: micro_batch rows of max_length tokens, rounded up to the
    multiple the batches are padded to."""
    return -(-micro_batch * max_length // multiple) * multiple


def choose_embeddings(shape: ModelShape, settings: MemorySettings, layout: str) -> Decision:
    """Keep the input embedding table in host RAM? On one GPU where every layer is checkpointed (memory is tight),
    unless the lm_head shares the table (freetune.speed.host_embeddings)."""
    size = embedding_bytes(shape, settings.frozen_dtype) / 2**20
    if settings.device != "cuda":
        return Decision(False, "a CPU run: the whole model is in host RAM already")
    if shape.tied_embeddings:
        return Decision(False, f"on the GPU: the lm_head shares the table ({size:,.0f} MiB), and the loss needs it "
                               f"there")
    if layout != "single":
        return Decision(False, "on the GPUs: DDP and FSDP keep every weight of the model on each rank's GPU")
    if not settings.every_layer_checkpointed:
        return Decision(False, f"on the GPU ({size:,.0f} MiB): not every layer is checkpointed, there is memory to "
                               f"spare")
    return Decision(True, f"in host RAM, {size:,.0f} MiB off the GPU: each micro-batch's tokens are looked up there "
                          f"and only their rows copied to the GPU (the lm_head is a weight of its own and stays)")


SHARDED = dict(offload_activations=False,  # FSDP's own path; not combined with TRL's offloading here
               compiled=False,  # FSDP runs eagerly (decisions.choose_compile)
               embeddings_on_host=False, cuda_graphs=False)


def sharded(settings: MemorySettings, world: int) -> MemorySettings:
    """The settings under FSDP over `world` GPUs."""
    return replace(settings, shards=max(world, 1), **SHARDED)


def choose_attention_heads(shape: ModelShape, budget_gib: float, length: int, micro_batch: int,
                           settings: MemorySettings) -> tuple[Decision, MemoryEstimate]:
    """The memory-efficient attention (a T4's variable-length kernel) with a layer's grouped-query heads in one call
    (freetune.speed.attention_efficient's "whole" layout) where the batch the plan chose still fits with the copies
    that takes; a kv head at a time otherwise. The batch is never made smaller for it. Returns the decision and the
    estimate it was weighed with."""
    whole = settings.estimate(shape, length, micro_batch, budget_gib, attention_whole_heads=True)
    extra_mib = micro_batch * length * whole_heads_attention_bytes(shape, settings.compute_dtype) / 2**20
    if whole.fits:
        return Decision(True, f"{shape.heads} q heads in one call of the kernel, k and v copied for them "
                              f"(~{extra_mib:.0f} MiB more in a layer's backward, ~{whole.total_gib:.2f} of "
                              f"{budget_gib:.2f} GiB): fewer, fuller launches than a kv head at a time"), whole
    return Decision(False, f"a kv head at a time: all {shape.heads} q heads in one call would need "
                           f"~{extra_mib:.0f} MiB more (~{whole.total_gib:.2f} of {budget_gib:.2f} GiB)"), whole
