"""How much GPU memory a QLoRA run needs, before anything is loaded, and the largest batch that fits a card.

The estimate follows freetune's own training path (freetune.model + TRL's SFTTrainer):
- the base model's linear layers in 4-bit NF4 with double quantisation (bitsandbytes);
- everything else the base model has (embeddings, an untied lm_head, norms, biases) upcast to fp32 by
  peft's prepare_model_for_kbit_training: on a 150k vocabulary that is more memory than the 4-bit layers;
- LoRA weights in fp32, their fp32 gradients and the optimizer's state;
- activations: what autograd keeps per token for the backward, with or without gradient checkpointing;
- the loss head: TRL's SFTTrainer (>= 1.x) scores tokens in tiles (`add_fused_lm_head`) and never holds the
  (batch, seq, vocab) logits; a plain transformers loss does, in 16 and 32 bits (`loss_head="full"`);
- what torch's allocator cannot see: the CUDA context, and reserved-but-unused blocks.

The per-token activation coefficients below were counted, not guessed: autograd's saved tensors
(torch.autograd.graph.saved_tensors_hooks) for one decoder layer of the real stack (transformers 5.17, peft
0.21, bitsandbytes 0.50 whose fused 4-bit matmul saves no input copy, LoRA dropout 0.05), on a CPU under bf16
autocast and in fp32, on Qwen2, Qwen3 and Llama layers of several widths (CUDA's attention kernels save the same
q, k, v, output and logsumexp). What that cannot count (the gradient buffers alive during one layer's backward,
allocator rounding) is an assumption, marked as such.

Checked against the measurements of issue 8 (one H200, Qwen2.5-1.5B shape, NF4, LoRA r16 on all linear layers,
paged 8-bit AdamW, rows of 300-1,200 tokens cut at TRL's default max_length of 1,024): peak allocated 2.1 GiB
at batch 1 with checkpointing, 5.5 GiB at batch 8 with checkpointing, 44 GiB at batch 8 without. This
model gives 2.3, 6.0 and 53 GiB (tests/test_memory.py holds it within 30%). Those figures also show the loss
head was tiled: materialised logits (16-bit, their fp32 upcast and log-softmax) at batch 8 x 1,024 alone would
take 11.6 GiB.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from freetune.plan.shapes import ModelShape

GIB = 2**30

# NF4 stores two weights per byte. Double quantisation keeps one 8-bit absmax per block of 64 weights, plus one
# fp32 absmax per 256 of those blocks; single quantisation keeps one fp32 absmax per 64 weights.
NF4_BYTES_PER_PARAM = {True: 0.5 + 1 / 64 + 4 / (64 * 256), False: 0.5 + 4 / 64}

# Optimizer state bytes per trainable parameter. 8-bit AdamW (bitsandbytes) keeps two 1-byte moments; the
# paged variant may move them to CPU memory under pressure, so counting them on the GPU is the safe side.
OPTIMIZER_STATE_BYTES = {
    "paged_adamw_8bit": 2, "adamw_8bit": 2, "adamw_bnb_8bit": 2, "paged_lion_8bit": 1, "lion_8bit": 1,
    "paged_adamw_32bit": 8, "adamw_torch": 8, "adamw_torch_fused": 8, "adamw": 8, "adamw_hf": 8,
    "adafactor": 4, "sgd": 0,
}

# Saved-for-backward bytes per token per decoder layer, per unit of each dimension (see the module docstring
# for how they were counted). "16" is fp16/bf16 compute under autocast, "32" fp32 compute (a CPU run).
# hidden: the fp32 residual stream, norm inputs/outputs, the 16-bit inputs of the projections and LoRA
# dropout copies; intermediate: the MLP's gate/up/activation outputs; q/kv: attention inputs and output;
# lora_rank: each adapted projection keeps its LoRA-A output; heads: the attention kernel's fp32 logsumexp;
# qk_norm: Qwen3's per-head norms of q and k.
ACTIVATION_BYTES = {
    "16": dict(hidden=44, intermediate=18, q=4, kv=4, lora_rank=2, heads=4, qk_norm=6.3),
    "32": dict(hidden=56, intermediate=20, q=8, kv=8, lora_rank=4, heads=4, qk_norm=7.0),
}
# Assumption (not countable on a CPU): while one layer runs its backward, the gradients of its residual input
# and output (fp32) and of its MLP intermediate are alive besides the saved tensors.
BACKWARD_BYTES = dict(hidden=8, intermediate=8)
# TRL's tiled loss head (trl.trainer.utils.add_fused_lm_head): tiles of up to 4,096 tokens x 32,768 vocabulary
# entries in the compute dtype, a compute-dtype copy of that slice of the head's weight, and the fp32 hidden
# states plus their fp32 gradient.
TILE_TOKENS, TILE_VOCAB = 4096, 32768
# Outside torch's allocator (not in torch.cuda.max_memory_allocated): the CUDA context with cuBLAS/cuDNN
# handles, about 0.3-0.5 GiB depending on the card and CUDA version; and the caching allocator's reserved but
# unused blocks, about a tenth of what it hands out under a varying sequence length.
CUDA_CONTEXT_GIB = 0.45
ALLOCATOR_SLACK = 1.10


@dataclass
class MemoryEstimate:
    """Peak GPU memory of one training step, by part, in GiB. `peak_allocated_gib` is what
    torch.cuda.max_memory_allocated() would report; `total_gib` adds what the card loses outside torch."""

    weights_4bit_gib: float
    other_weights_gib: float
    lora_gib: float
    optimizer_gib: float
    activations_gib: float
    loss_head_gib: float
    peak_allocated_gib: float
    overhead_gib: float
    total_gib: float
    trainable_params: int
    settings: dict = field(default_factory=dict)
    budget_gib: float | None = None

    @property
    def fits(self) -> bool | None:
        return None if self.budget_gib is None else self.total_gib <= self.budget_gib

    def to_dict(self) -> dict:
        data = {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}
        return {**data, "fits": self.fits}

    def breakdown(self) -> str:
        """One line: where the memory goes."""
        parts = [("4-bit weights", self.weights_4bit_gib), ("other weights", self.other_weights_gib),
                 ("LoRA+grads", self.lora_gib), ("optimizer", self.optimizer_gib),
                 ("activations", self.activations_gib), ("loss head", self.loss_head_gib),
                 ("CUDA/allocator", self.overhead_gib)]
        return ", ".join(f"{name} {gib:.2f}" for name, gib in parts) + f" = {self.total_gib:.2f} GiB"


def _is_16bit(compute_dtype: str) -> bool:
    if compute_dtype in ("float16", "bfloat16", "fp16", "bf16"):
        return True
    if compute_dtype in ("float32", "fp32"):
        return False
    raise ValueError(f"compute_dtype must be float16, bfloat16 or float32, not {compute_dtype!r}")


def layer_activation_bytes(shape: ModelShape, *, lora_rank: int, lora_targets="all-linear",
                           compute_dtype: str = "bfloat16") -> float:
    """Bytes per token that autograd saves in one decoder layer for its backward."""
    c = ACTIVATION_BYTES["16" if _is_16bit(compute_dtype) else "32"]
    return (c["hidden"] * shape.hidden + c["intermediate"] * shape.intermediate + c["q"] * shape.q_dim
            + c["kv"] * shape.kv_dim + c["lora_rank"] * lora_rank * len(shape.lora_modules(lora_targets))
            + c["heads"] * shape.heads + (c["qk_norm"] * (shape.q_dim + shape.kv_dim) if shape.qk_norm else 0))


# freetune.model keeps the frozen non-4-bit weights in the compute dtype on a GPU (Plan.frozen_dtype), so the
# residual stream between layers, and each checkpointed layer's saved input, is 16-bit there.
# Checkpointed layers' inputs still on the GPU when offloaded (TRL's activation offloading): the ones whose copy to
# the host is in flight in the forward, and the ones fetched back ahead of their layer's backward.
OFFLOAD_RESIDENT_LAYERS = 3
# torch.compile'd decoder layers (freetune.speed.compiled_layers.compile_layers) save what the fused graph's backward needs, not
# every eager op's inputs: measured on an H200 (docs/performance.md), a compiled Qwen2.5-1.5B layer holds
# this share of the eager layer's counted bytes per token.
COMPILED_ACTIVATION_SHARE = 0.34
# freetune.speed.lora_kernel' fused LoRA layers save their input once (shared by the projections that read it) and dropout's
# 1-byte mask, where peft's layers keep each projection's dropped 16-bit copy: bytes per token less, per dimension.
FUSED_DROPOUT_SAVING = dict(hidden=10, q=2, intermediate=2)
# ... and, compiled, it saves each projection's dropout mask packed, 1 bit per input element instead of the byte these
# counts (and the compiled share) were measured with: this many bytes per input element less (LoRA dropout > 0
# assumed, as in the recipes; with dropout 0 a compiled layer keeps no mask and no more of anything else,
# freetune.reach.torch.compile_settings, so the estimate is then over by the masks).
PACKED_MASK_SAVING = 7 / 8


def packed_mask_saving(shape: ModelShape, lora_targets="all-linear") -> float:
    """Bytes per token per layer that freetune.speed.lora_kernel.pack_mask saves in a compiled layer: every adapted projection's
    mask, as bits."""
    dims = shape.linear_dims()
    return PACKED_MASK_SAVING * sum(dims[m][0] for m in shape.lora_modules(lora_targets))


# freetune.speed.mlp's chunked op's backward: g, u, the activation's gradient and one more chunk-sized tensor at a time.
MLP_CHUNK_BUFFERS = 4
# freetune.speed.mlp's traced function's backward: g and u for every token (d gate and d up take their place); the
# activation and its gradient a chunk at a time (mlp_chunk_bytes).
TRACED_MLP_BUFFERS = 2
TRACED_MLP_CHUNK_BUFFERS = 2


def mlp_chunk_bytes(shape: ModelShape, compute_dtype: str = "bfloat16", mlp_kernel: str = "chunked") -> float:
    """Bytes one layer's backward holds through freetune.speed.mlp whatever the token count: the chunked op, its
    chunk-sized intermediate tensors (MLP_CHUNK_BUFFERS of CHUNK_TOKENS x intermediate) and the three dequantised
    weights; the traced function, TRACED_MLP_CHUNK_BUFFERS chunks (the activation and its gradient) and the down
    projection's dequantised weight (its per-token part is in activation_bytes_per_token). 0 for the per-projection MLP."""
    if mlp_kernel not in ("chunked", "traced"):
        return 0.0
    from freetune.speed.mlp_ops import CHUNK_TOKENS  # only where the plan runs the fused MLP: it loads the kernels

    width = 2 if _is_16bit(compute_dtype) else 4
    if mlp_kernel == "chunked":
        return (MLP_CHUNK_BUFFERS * CHUNK_TOKENS + 3 * shape.hidden) * shape.intermediate * width
    return (TRACED_MLP_CHUNK_BUFFERS * CHUNK_TOKENS + shape.hidden) * shape.intermediate * width


def activation_bytes_per_token(shape: ModelShape, *, lora_rank: int, lora_targets="all-linear",
                               gradient_checkpointing: bool, compute_dtype: str = "bfloat16",
                               frozen_dtype: str = "float32", offload_activations: bool = False,
                               lora_kernel: str = "peft", compiled: bool = False, checkpoint_every: int = 1,
                               mlp_kernel: str = "layers") -> tuple[float, float]:
    """(resident, transient) bytes per token of the decoder layers: what stays alive from the forward until the layers'
    backward reaches it, and what one layer's backward adds on top (with checkpointing its recompute, too). The loss
    head runs between the two: the peak is resident + the larger of the head and the transient part.

    mlp_kernel "chunked" or "traced" (freetune.speed.mlp): the MLP saves only its down projection's dropout mask as bits
    per intermediate element; the chunked op's backward holds chunk-sized intermediate tensors (mlp_chunk_bytes,
    counted apart), the traced function's TRACED_MLP_BUFFERS of them per token."""
    c = ACTIVATION_BYTES["16" if _is_16bit(compute_dtype) else "32"]
    per_layer = layer_activation_bytes(shape, lora_rank=lora_rank, lora_targets=lora_targets,
                                       compute_dtype=compute_dtype)
    intermediate = c["intermediate"] * shape.intermediate  # the part of per_layer the chunked MLP does not save
    if lora_kernel == "fused":
        per_layer -= (FUSED_DROPOUT_SAVING["hidden"] * shape.hidden + FUSED_DROPOUT_SAVING["q"] * shape.q_dim
                      + FUSED_DROPOUT_SAVING["intermediate"] * shape.intermediate)
        intermediate -= FUSED_DROPOUT_SAVING["intermediate"] * shape.intermediate
    if compiled:
        per_layer *= COMPILED_ACTIVATION_SHARE
        intermediate *= COMPILED_ACTIVATION_SHARE
        if lora_kernel == "fused":
            per_layer -= packed_mask_saving(shape, lora_targets)
            intermediate -= PACKED_MASK_SAVING * shape.intermediate  # the down projection's mask
    backward = BACKWARD_BYTES["hidden"] * shape.hidden + BACKWARD_BYTES["intermediate"] * shape.intermediate
    if mlp_kernel in ("chunked", "traced"):
        per_layer += shape.intermediate / 8 - intermediate
        backward -= BACKWARD_BYTES["intermediate"] * shape.intermediate
    if mlp_kernel == "traced":
        backward += TRACED_MLP_BUFFERS * (2 if _is_16bit(compute_dtype) else 4) * shape.intermediate
    residual = 2 if _is_16bit(frozen_dtype) else 4
    # The embedding output and the final norm's input/output.
    outside_layers = 3 * residual * shape.hidden
    if not gradient_checkpointing:
        return shape.layers * per_layer + outside_layers, backward
    # A checkpointed layer keeps only its input, and one at a time is recomputed in full during the backward; with
    # checkpoint_every n, only every n-th layer is checkpointed (transformers' every_n_layers) and the others keep
    # all their activations.
    checkpointed = math.ceil(shape.layers / max(1, checkpoint_every))
    kept = min(checkpointed, OFFLOAD_RESIDENT_LAYERS) if offload_activations else checkpointed
    resident = (shape.layers - checkpointed) * per_layer + kept * residual * shape.hidden + outside_layers
    return resident, per_layer + backward


def whole_heads_attention_bytes(shape: ModelShape, compute_dtype: str = "bfloat16") -> float:
    """Bytes per token a layer's backward holds on top when the memory-efficient attention takes its grouped-query heads
    in one call (freetune.speed.attention_efficient's "whole" layout) instead of a kv head at a time: k and v repeated
    for every q head, their gradients per q head, and the kernel's fp32 accumulator of dq for all heads, where a part at
    a time holds 1 / kv_heads of the last two (its k and v are stride-0 views). Counted whole, on top of the layer's
    other backward tensors: on TinyLlama's long rows the measured peak rose 30 MiB of the 160 counted
    (docs/performance.md). 0 without grouped-query heads (one call either way)."""
    if shape.kv_heads >= shape.heads:
        return 0.0
    width = 2 if _is_16bit(compute_dtype) else 4
    per_part_share = 1 - 1 / shape.kv_heads
    return shape.q_dim * (2 * width + (2 * width + 4) * per_part_share)


def loss_head_bytes(shape: ModelShape, tokens: int, *, compute_dtype: str = "bfloat16",
                    loss_head: str = "chunked", tile_tokens: int = 0) -> float:
    """Peak bytes of the lm_head projection and the cross-entropy for `tokens` tokens (tile_tokens: tokens per tile of
    the chunked head, 0 for TRL's TILE_TOKENS)."""
    width = 2 if _is_16bit(compute_dtype) else 4
    if loss_head == "chunked":
        tile = min(tokens, tile_tokens or TILE_TOKENS) * min(shape.vocab, TILE_VOCAB) * width
        weight_slice = min(shape.vocab, TILE_VOCAB) * shape.hidden * width if width == 2 else 0
        return tile + weight_slice + tokens * shape.hidden * 4 * 2
    if loss_head == "full":
        # transformers' ForCausalLMLoss: the logits in the compute dtype, their fp32 upcast, and log_softmax's
        # fp32 output saved for the backward (in fp32 compute the upcast is the same tensor).
        per_element = (width + 4 + 4) if width == 2 else 8
        return tokens * shape.vocab * per_element
    raise ValueError(f"loss_head must be 'chunked' or 'full', not {loss_head!r}")


def embedding_bytes(shape: ModelShape, frozen_dtype: str = "float32") -> int:
    """The input embedding table's bytes (vocab x hidden in the frozen weights' dtype)."""
    return shape.vocab * shape.hidden * (2 if _is_16bit(frozen_dtype) else 4)


def keeps_8bit_absmax(lora_kernel: str, compiled: bool, mlp_kernel: str) -> bool:
    """Whether the fused LoRA layers keep double-quantised weights' absmax values 8-bit (freetune.speed.nf4.quant_args:
    compiled layers decode them inside their dequantisation kernels), rather than an fp32 copy: where every use is
    in a compiled layer. The chunked MLP op runs outside the graph and reads fp32 values."""
    return lora_kernel == "fused" and compiled and mlp_kernel != "chunked"


def dequantises_backward_in_graph(lora_kernel: str, compiled: bool, mlp_kernel: str, cuda_graphs: bool) -> bool:
    """Whether the compiled layers' backward dequantises its input gradients' weights in its own graph
    (freetune.speed.nf4.times_dequantized), not through freetune::dequantized_mm: where the absmax values stay 8-bit
    (keeps_8bit_absmax) and the layers are not replayed as CUDA graphs (those take the op's host cost away, on the
    tight budgets that choose them). It costs one layer's 16-bit weights at the backward's peak (estimate)."""
    return keeps_8bit_absmax(lora_kernel, compiled, mlp_kernel) and not cuda_graphs


def estimate(shape: ModelShape, *, max_length: int, micro_batch: int, lora_rank: int = 16,
             lora_targets: str | list[str] = "all-linear", gradient_checkpointing: bool = True,
             optimizer: str = "paged_adamw_8bit", compute_dtype: str = "bfloat16", device: str = "cuda",
             world_size: int = 1, double_quant: bool = True, loss_head: str = "chunked",
             shards: int = 1, lora_kernel: str = "peft", frozen_dtype: str = "float32",
             offload_activations: bool = False, compiled: bool = False, checkpoint_every: int = 1,
             mlp_kernel: str = "layers", loss_tile_tokens: int = 0,
             embeddings_on_host: bool = False, cuda_graphs: bool = False,
             attention_whole_heads: bool = False) -> MemoryEstimate:
    """Peak memory of one training step at micro_batch rows of max_length tokens (every row padded to it: the
    worst batch of a run decides whether it fits).

    shards > 1: FSDP over that many GPUs (freetune.model's FSDP path): weights, LoRA gradients and optimizer state
    are split between them, the non-4-bit weights stay in the compute dtype (FSDP needs one dtype per wrapped
    unit, so they are not upcast to fp32), and each GPU also holds what FSDP gathers to compute: the root unit
    (embeddings, lm_head, final norm) and two decoder layers (the one running and the one prefetched).

    lora_kernel "fused" (freetune.speed.lora_kernel, never under FSDP): each double-quantised weight keeps its absmax values
    8-bit where keeps_8bit_absmax, else dequantised once to fp32 (4 bytes per 64 weights). mlp_kernel "chunked" or
    "traced": freetune.speed.mlp. embeddings_on_host: an untied input embedding table in host RAM
    (freetune.speed.host_embeddings), off the GPU. cuda_graphs: freetune.speed.cuda_graphs' three buffers of the largest
    batch's hidden states (two in turn for the layers, one for the gradient), held for the whole run.
    attention_whole_heads: the memory-efficient attention's heads in one call (whole_heads_attention_bytes).
    Where dequantises_backward_in_graph, inductor dequantises a layer's weights at the top of its backward graph: one
    layer's linear weights in 16 bits on top of its backward.
    """
    tokens = micro_batch * max_length
    # Fused layers that are not compiled keep a double-quantised weight's absmax values in fp32 instead
    # (freetune.speed.nf4.quant_args): its memory is then a single-quantised one's.
    fp32_absmax = lora_kernel == "fused" and shards == 1 and not keeps_8bit_absmax(lora_kernel, compiled, mlp_kernel)
    weights_4bit = shape.quantized_params * NF4_BYTES_PER_PARAM[double_quant and not fp32_absmax]
    # frozen_dtype float32: peft's prepare_model_for_kbit_training casts every non-4-bit parameter to fp32, whatever
    # dtype it loaded in; 16-bit: freetune keeps them as loaded (Plan.frozen_dtype).
    other_weights = shape.other_params * (2 if _is_16bit(frozen_dtype) else 4)
    if embeddings_on_host and shards == 1 and not shape.tied_embeddings:
        other_weights -= embedding_bytes(shape, frozen_dtype)
    trainable = shape.lora_params(lora_rank, lora_targets)
    # fp32 LoRA weights and fp32 gradients; under DDP the gradient buckets hold one more copy of the gradients; in one
    # process the fused layers' 16-bit copies of the weights, alive over each forward and backward
    # (freetune.speed.lora_kernel.cast_adapters_once_per_forward).
    cast_once = lora_kernel == "fused" and world_size == 1 and shards == 1
    lora = trainable * (4 + 4 + (4 if world_size > 1 else 0) + (2 if cast_once else 0))
    state_bytes = OPTIMIZER_STATE_BYTES.get(optimizer.lower(), 8)  # unknown optimizers: AdamW's 8, the safe side
    # The one-launch 8-bit AdamW (freetune.speed.optimizer) concatenates the gradients during its step, 16 MiB at a
    # time: then the activations, the loss head and the 16-bit copies are gone, so the backward's peak, which this
    # estimate is, stays the larger (all at once, 4 bytes per LoRA weight, it was not on Qwen3-8B's shape).
    optimizer_state = trainable * state_bytes
    if shards > 1:
        width = 2 if _is_16bit(compute_dtype) else 4
        weights_4bit = weights_4bit / shards + 2 * weights_4bit / shape.layers
        other_weights = shape.other_params * width  # the root unit, gathered for the whole step
        lora = trainable * (4 + 4) / shards
        optimizer_state = optimizer_state / shards
    resident, transient = activation_bytes_per_token(shape, lora_rank=lora_rank, lora_targets=lora_targets,
                                                      gradient_checkpointing=gradient_checkpointing,
                                                      compute_dtype=compute_dtype, frozen_dtype=frozen_dtype,
                                                      offload_activations=offload_activations,
                                                      lora_kernel=lora_kernel, compiled=compiled,
                                                      checkpoint_every=checkpoint_every, mlp_kernel=mlp_kernel)
    head = loss_head_bytes(shape, tokens, compute_dtype=compute_dtype, loss_head=loss_head,
                           tile_tokens=loss_tile_tokens)
    layer_backward = tokens * transient + mlp_chunk_bytes(shape, compute_dtype, mlp_kernel)
    if attention_whole_heads:
        layer_backward += tokens * whole_heads_attention_bytes(shape, compute_dtype)
    if shards == 1 and dequantises_backward_in_graph(lora_kernel, compiled, mlp_kernel, cuda_graphs):
        layer_backward += shape.quantized_params // shape.layers * (2 if _is_16bit(compute_dtype) else 4)
    activations = tokens * resident + max(0.0, layer_backward - head)  # the head's part is counted apart
    if cuda_graphs:
        activations += 3 * tokens * shape.hidden * (2 if _is_16bit(compute_dtype) else 4)
    allocated = weights_4bit + other_weights + lora + optimizer_state + activations + head
    on_gpu = device == "cuda"
    total = allocated * ALLOCATOR_SLACK + CUDA_CONTEXT_GIB * GIB if on_gpu else allocated
    settings = dict(model=shape.name, max_length=max_length, micro_batch=micro_batch, lora_rank=lora_rank,
                    lora_targets=lora_targets, gradient_checkpointing=gradient_checkpointing, optimizer=optimizer,
                    compute_dtype=compute_dtype, device=device, world_size=world_size, loss_head=loss_head,
                    shards=shards, lora_kernel=lora_kernel, frozen_dtype=frozen_dtype,
                    offload_activations=offload_activations, compiled=compiled, checkpoint_every=checkpoint_every,
                    mlp_kernel=mlp_kernel, loss_tile_tokens=loss_tile_tokens, embeddings_on_host=embeddings_on_host,
                    cuda_graphs=cuda_graphs, attention_whole_heads=attention_whole_heads)
    return MemoryEstimate(
        weights_4bit_gib=weights_4bit / GIB, other_weights_gib=other_weights / GIB, lora_gib=lora / GIB,
        optimizer_gib=optimizer_state / GIB, activations_gib=activations / GIB, loss_head_gib=head / GIB,
        peak_allocated_gib=allocated / GIB, overhead_gib=(total - allocated) / GIB, total_gib=total / GIB,
        trainable_params=trainable, settings=settings)


def fit(shape: ModelShape, budget_gib: float, *, max_length: int = 1024, max_micro_batch: int = 16,
        min_length: int = 256, **settings) -> tuple[int, int, MemoryEstimate, str]:
    """The largest micro-batch (a power of two up to max_micro_batch) that fits budget_gib at max_length.

    settings: estimate()'s other keywords (lora_rank, gradient_checkpointing, optimizer, compute_dtype, ...).
    Returns (micro_batch, max_length, estimate, reason). If even one row of max_length tokens does not fit,
    the longest max_length (halving, not below min_length) at which one row fits is returned instead, and the
    reason says so; if nothing fits, (1, max_length) with `estimate.fits` False and a reason saying what to change.
    """
    def at(batch: int, length: int) -> MemoryEstimate:
        est = estimate(shape, max_length=length, micro_batch=batch, **settings)
        est.budget_gib = budget_gib
        return est

    best = None
    batch = 1
    while batch <= max(1, max_micro_batch):
        est = at(batch, max_length)
        if not est.fits:
            break
        best = (batch, est)
        batch *= 2
    if best is not None:
        batch, est = best
        if batch * 2 > max_micro_batch:
            limit = f"{batch} is the most asked for"
        else:
            limit = f"{batch * 2} would need ~{at(batch * 2, max_length).total_gib:.1f} GiB"
        return batch, max_length, est, (f"{batch} x {max_length} tokens needs ~{est.total_gib:.1f} of "
                                        f"{budget_gib:.1f} GiB; {limit}")
    length = max_length // 2
    while length >= min_length:
        est = at(1, length)
        if est.fits:
            return 1, length, est, (f"one row of {max_length} tokens needs ~{at(1, max_length).total_gib:.1f} GiB, "
                                    f"more than {budget_gib:.1f} GiB: max_length lowered to {length} "
                                    f"(~{est.total_gib:.1f} GiB); longer rows are cut")
        length //= 2
    est = at(1, max_length)
    return 1, max_length, est, (
        f"does not fit: even one row of {max_length} tokens needs ~{est.total_gib:.1f} GiB and this GPU has "
        f"{budget_gib:.1f} GiB. Pick a smaller model, a lower lora_rank or max_length, or a bigger GPU")
