"""The fast default training path: more real tokens per kernel launch, fewer host round trips, same loss.

What the plain stack (TRL's SFTTrainer, batch 1 x accumulation 8, padded batches) wastes, and what is done
about it here (issue 8 has the measurements):
- Padding. A batch of rows of 300-1,200 tokens padded to its longest row is ~30% pad tokens, each costing a
  full forward and backward. `padding_free`: the micro-batch's rows are concatenated into one sequence with
  position_ids restarting at 0 per row (TRL's collator does this and adds the row boundaries, cu_seq_lens).
  transformers (masking_utils.find_packed_sequence_indices) turns restarting position_ids into a
  block-diagonal causal mask, so no token attends across rows: the loss is the same as with padding.
  The concatenated row is padded to a multiple of 8 tokens by one row that trains nothing
  (`AlignedPaddingFree`): compiled layers recompile whenever the length's remainder mod 8 changes.
  Where the attention kernel would have to compute that mask densely over the whole packed row (a T4, or no
  variable-length kernel), `grouped` is chosen instead: padded batches of similar lengths
  (transformers' LengthGroupedSampler), which keeps the padding small and the rows apart.
- Ranks waiting for each other (DDP, FSDP). The gradients are averaged once per optimizer step, so every rank
  waits for the one with the most tokens. With 8 random rows of 300-1,200 tokens per rank, two ranks' token
  counts differ by ~15% of the mean, so the slower one has ~7% more; the 2-GPU run on an H200 reached 89% of
  twice one GPU's rate. `RankBalancedSampler` deals each optimizer step's rows (the same random rows any GPU
  count would take) out to the ranks so their token counts are equal to within a row, each micro-batch still
  holding exactly micro_batch rows (memory as planned).
- The attention kernel. On sm80+ the packed rows go through PyTorch's variable-length FlashAttention-2
  (aten._flash_attention_forward given TRL's cu_seq_lens, else torch.nn.attention.varlen.varlen_attn): each row
  attends only to itself, no mask is built into the kernel and nothing is computed across rows. It is checked
  against PyTorch's sdpa once per process (`varlen_works`) before the plan picks it; anywhere else the same
  registered attention falls back to sdpa with transformers' block-diagonal mask (correct; tests/test_fast_path.py
  runs it on a CPU).
- Host round trips. TRL's compute_loss calls .item() and gathers across ranks three times per micro-batch
  for its entropy / token-accuracy / token-count metrics: a device sync each time, which serialises the
  CPU with the GPU, and under DDP three extra collectives per micro-batch. `trainer_class` keeps the same
  sums on the GPU and reads them once per log step (same values in the log, a fraction of the syncs). The
  Trainer's other per-step syncs are off in freetune.train.make_config (the blocking batch copy, the NaN filter)
  and freetune.checkpoint.StopAgreement (the ranks' stop flag, read a step late).
- The micro-batch (freetune.preflight.make_plan) and gradient checkpointing (dropped when the plan's memory
  estimate fits the full batch without it: the recompute costs ~30% of the step).
- The loss head: TRL (>= 1.x) already scores tokens in tiles and never holds the (tokens x vocabulary) logits;
  nothing to add (Liger's fused linear cross-entropy is refused by TRL 1.16, which patches the same forward).

The loss stays the same: TRL divides the summed token losses of an optimizer step by the number of label
tokens in that step (num_items_in_batch), however the rows are split into micro-batches or concatenated.
tests/test_fast_path.py checks it against the plain path on the same rows.
"""

from __future__ import annotations

import functools
import inspect

VARLEN_ATTENTION = "freetune_varlen"  # the name registered with transformers' AttentionInterface
BATCHING = ("padding_free", "grouped", "padded")


# ---------------------------------------------------------------------------------------------- attention --

# What every attention call reads runs inside the compiled decoder layers (freetune.kernels.compile_layers), so it
# reads plain module dicts filled beforehand, never a functools.cache'd function: dynamo ignores the cache and
# traces the function itself: calling the cached probe from the attention function ran the whole probe (a forward
# and backward on test tensors, and a graph break) in every attention call of every step.
_CHOSEN: dict = {}   # GPU index -> (backend or "", why): set by varlen_works, eagerly (plan, train)
_VARLEN: dict = {}   # "fn": torch.nn.attention.varlen.varlen_attn or None, "params": its keyword names


def _varlen_fn():
    if "fn" not in _VARLEN:
        try:
            from torch.nn.attention.varlen import varlen_attn
        except ImportError:  # torch < 2.10
            varlen_attn = None
        _VARLEN["fn"] = varlen_attn
        _VARLEN["params"] = frozenset(inspect.signature(varlen_attn).parameters) if varlen_attn else frozenset()
    return _VARLEN["fn"]


# The variable-length kernels, tried in this order by `varlen_works` among those the plan's policy allows:
#   "flash"         torch.ops.aten._flash_attention_forward with the rows' cumulative lengths: FlashAttention-2 as
#                   PyTorch builds it (differentiable; grouped-query heads natively, no copies of k and v). sm80+;
#   "torch_varlen"  torch.nn.attention.varlen.varlen_attn. On an H200 with torch 2.11 it runs cuDNN, which was
#                   measured at 2.7x the GPU time of FlashAttention-2 on these rows and ~3 ms of host time per
#                   call (a graph built per new set of lengths), and it needs k and v repeated for GQA. sm80+;
#   "efficient"     torch.ops.aten._efficient_attention_forward with the same cumulative lengths: the memory-efficient
#                   (xformers/CUTLASS) kernel PyTorch builds for sm50 and newer, so the one a T4 (sm75) can run;
#                   causal inside each row, nothing across rows. It takes equal head counts: k and v are repeated
#                   for grouped-query attention (a copy of each per layer, small next to the MLP's activations).
VARLEN_BACKENDS = ("flash", "torch_varlen", "efficient")
# What each precision policy may use: a T4 (Turing, sm75) has no FlashAttention-2 kernel in PyTorch, and the T4
# emulation on a bigger GPU holds to what a T4 can run.
POLICY_BACKENDS = {"ampere": VARLEN_BACKENDS, "turing": ("efficient",)}
VARLEN_KERNEL_NAMES = {"flash": "FlashAttention-2", "torch_varlen": "varlen_attn",
                       "efficient": "memory-efficient (sm50+, a T4 included)"}


def _varlen_call(q, k, v, cu_seq, max_len: int, scale, backend: str = "flash"):
    """Causal variable-length attention on (tokens, heads, dim) tensors, rows given by cu_seq (int32)."""
    import torch

    if backend == "flash":
        return torch.ops.aten._flash_attention_forward(q, k, v, cu_seq, cu_seq, max_len, max_len, 0.0, True, False,
                                                       scale=scale)[0]
    if backend == "efficient":
        return _efficient_op()(q, k, v, cu_seq, max_len, scale)
    fn, params = _VARLEN["fn"], _VARLEN["params"]  # set by the probe, which ran before any call of this backend
    kwargs = {}
    if "is_causal" in params:       # torch 2.10/2.11
        kwargs["is_causal"] = True
    else:                           # later: causal is a (-1, 0) window
        kwargs["window_size"] = (-1, 0)
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:  # grouped-query attention without kernel support: repeat the kv heads (a copy per layer)
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if scale is not None and "scale" in params:
        kwargs["scale"] = scale
    return fn(q, k, v, cu_seq, cu_seq, max_len, max_len, **kwargs)


_EFFICIENT: dict = {}  # "op": the freetune::varlen_efficient custom op, defined once per process


def _efficient_op():
    """freetune::varlen_efficient(q, k, v, cu_seq, max_len, scale): causal attention within each row through PyTorch's
    memory-efficient kernel (aten._efficient_attention_forward / _backward with cumulative row lengths), as a custom op
    with its own autograd. Why not the aten ops directly: their backward's meta function (torch 2.11 and 2.13) takes
    its arguments shifted by one ("got multiple values for argument 'scale'"), so a compiled decoder layer that calls
    them falls back to eager as a whole; a custom op stays one node of the layer's graph, its shapes given here.
    Grouped-query heads are repeated inside the op, so that only the unrepeated k and v are saved for the backward."""
    if "op" in _EFFICIENT:
        return _EFFICIENT["op"]
    import torch

    def repeat_kv(q, k, v):
        groups = q.shape[1] // k.shape[1]
        return (k, v) if groups == 1 else (k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1))

    def forward_4d(q, k, v, cu, max_len, scale):
        k, v = repeat_kv(q, k, v)
        # (1, tokens, heads, dim), as the kernel takes batches; custom_mask_type 1: causal from each row's start.
        # The logsumexp is what the backward needs; the dropout seeds are not (no dropout in attention).
        out, lse = torch.ops.aten._efficient_attention_forward(q[None], k[None], v[None], None, cu, cu, max_len,
                                                               max_len, 0.0, 1, True, scale=scale)[:2]
        return out[0].clone(), lse  # a custom op's outputs must not be views

    # Schemas spelled out: this module's annotations are strings (from __future__ import annotations).
    @torch.library.custom_op("freetune::varlen_efficient", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, Tensor cu, SymInt max_len, float? scale) "
                                    "-> (Tensor, Tensor)")
    def op(q, k, v, cu, max_len, scale):
        return forward_4d(q, k, v, cu, max_len, scale)

    op.register_fake(forward_4d)  # the forward's own meta function gives the shapes, the logsumexp's included

    @torch.library.custom_op("freetune::varlen_efficient_backward", mutates_args=(),
                             schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu, "
                                    "SymInt max_len, float? scale) -> (Tensor, Tensor, Tensor)")
    def backward_op(grad, q, k, v, out, lse, cu, max_len, scale):
        kr, vr = repeat_kv(q, k, v)
        unused = torch.empty((), dtype=torch.long)  # dropout's seed and offset, read only when dropout_p > 0
        dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
            grad.contiguous()[None], q[None], kr[None], vr[None], None, out[None], cu, cu, max_len, max_len, lse, 0.0,
            unused, unused, 1, False, scale=scale)
        dq, dk, dv = dq[0], dk[0], dv[0]
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # the repeated heads' gradients summed back onto each key/value head
            dk = dk.unflatten(1, (k.shape[1], groups)).sum(2)
            dv = dv.unflatten(1, (v.shape[1], groups)).sum(2)
        return dq.contiguous(), dk.contiguous(), dv.contiguous()

    @backward_op.register_fake
    def _(grad, q, k, v, out, lse, cu, max_len, scale):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu, max_len, scale = inputs
        ctx.save_for_backward(q, k, v, *output, cu)
        ctx.max_len, ctx.scale = max_len, scale

    def backward(ctx, grad, _lse_grad):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = backward_op(grad, q, k, v, out, lse, cu, ctx.max_len, ctx.scale)
        return dq, dk, dv, None, None, None

    op.register_autograd(backward, setup_context=setup_context)
    _EFFICIENT["op"] = lambda q, k, v, cu, max_len, scale: op(q, k, v, cu, max_len, scale)[0]
    return _EFFICIENT["op"]


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                             is_causal=None, **kwargs):
    """transformers attention function: varlen FlashAttention for a padding-free batch on a GPU where it was
    checked, sdpa (with transformers' mask, block-diagonal for packed rows) for everything else."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu = kwargs.get("cu_seq_lens_q")
    backend = varlen_backend(query.device.index or 0) if cu is not None and query.is_cuda else ""
    dtype = kernel_dtype(query)
    if backend and query.shape[0] == 1 and dropout == 0.0 and dtype is not None:
        q = query[0].transpose(0, 1).to(dtype)  # (batch 1, heads, tokens, dim) -> (tokens, heads, dim)
        k = key[0].transpose(0, 1).to(dtype)
        v = value[0].transpose(0, 1).to(dtype)
        max_len = kwargs.get("max_length_q") or int(cu.diff().max())
        out = _varlen_call(q, k, v, cu.to(device=q.device, dtype=torch.int32), int(max_len), scaling, backend)
        return out.unsqueeze(0), None  # (1, tokens, heads, dim), as sdpa_attention_forward returns
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def kernel_dtype(query):
    """The 16-bit dtype FlashAttention runs `query` in, or None (then sdpa). A 4-bit model's residual stream is
    fp32 (prepare_model_for_kbit_training upcasts the norms and embeddings, and bitsandbytes' layers return their
    input's dtype), so under mixed precision q, k and v arrive in fp32: autocast would cast them to its 16-bit
    dtype inside sdpa, and the same cast is done here for the varlen kernel, which autocast does not know.
    Without it every padding-free batch went to sdpa with a dense block-diagonal mask (on an H200 cuDNN's kernel:
    the whole (tokens x tokens) square, and ~3 ms of host time per call), seen in a GPU profile."""
    import torch

    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    device = query.device.type
    if query.dtype == torch.float32 and torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        if dtype in (torch.float16, torch.bfloat16):
            return dtype
    return None


def register_attention() -> str:
    """Register freetune's attention with transformers (idempotent); returns its attn_implementation name.

    Its mask is sdpa's: correct for padded, packed and plain batches alike (the varlen kernel ignores it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, sdpa_mask)
    return VARLEN_ATTENTION


def varlen_backend(device_index: int = 0) -> str:
    """The kernel `varlen_works` chose for this GPU, or "". Called in every attention layer: a dict lookup once the
    GPU is probed (the plan and train() probe, for the run's policy, before the layers compile)."""
    return _CHOSEN.get(device_index, ("", ""))[0]


def varlen_works(device_index: int = 0, policy: str = "ampere") -> tuple[bool, str]:
    """(usable, why): run the policy's variable-length kernels, in order, forward and backward on two short rows with
    grouped-query heads, and compare with sdpa row by row; the first that agrees is this GPU's for the process (any
    error or mismatch means the next; none: the plan groups by length). Once per process, GPU and policy."""
    backends = POLICY_BACKENDS.get(policy, ())
    key = (device_index, backends)
    if key not in _PROBED:
        _PROBED[key] = _probe(device_index, backends)
    _CHOSEN[device_index] = _PROBED[key]
    backend, why = _CHOSEN[device_index]
    return bool(backend), why


_PROBED: dict = {}  # (GPU index, backends allowed) -> (backend or "", why)


def _probe(device_index: int, backends: tuple = VARLEN_BACKENDS) -> tuple[str, str]:
    """(backend or "", why)."""
    import torch

    if not torch.cuda.is_available():
        return "", "no CUDA"
    if not backends:
        return "", "no variable-length kernel for this precision policy"
    major, minor = torch.cuda.get_device_capability(device_index)
    failures = []
    for backend in backends:
        if backend != "efficient" and major < 8:
            failures.append(f"{backend}: sm_{major}{minor}, PyTorch builds it for sm80+")
            continue
        if backend == "torch_varlen" and _varlen_fn() is None:
            failures.append(f"torch {torch.__version__} has no torch.nn.attention.varlen (needs >= 2.10)")
            continue
        problem = _check_against_sdpa(device_index, backend)
        if not problem:
            return backend, f"{backend}: checked against sdpa, forward and backward"
        failures.append(f"{backend}: {problem}")
    return "", "; ".join(failures)


def _check_against_sdpa(device_index: int, backend: str) -> str:
    """'' when `backend` agrees with sdpa on two packed rows (output, dq, dk), else what went wrong."""
    import torch

    try:
        device = torch.device("cuda", device_index)
        gen = torch.Generator(device=device).manual_seed(0)
        lengths, heads, kv_heads, dim = [37, 91], 4, 2, 64
        total = sum(lengths)
        dtype = torch.bfloat16 if backend != "efficient" and torch.cuda.is_bf16_supported() else torch.float16
        # The model hands over (1, heads, tokens, dim) views; probe the same layout.
        q = torch.randn(1, heads, total, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        k = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        v = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        cu = torch.tensor([0, lengths[0], total], device=device, dtype=torch.int32)
        out = _varlen_call(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, max(lengths),
                           dim ** -0.5, backend)
        out.float().square().sum().backward()
        got = (out.detach().float(), q.grad.float(), k.grad.float())
        q.grad = k.grad = v.grad = None
        refs = []
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            kk = k[:, :, start:end].repeat_interleave(heads // kv_heads, dim=1)
            vv = v[:, :, start:end].repeat_interleave(heads // kv_heads, dim=1)
            refs.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, start:end], kk, vv, is_causal=True).transpose(1, 2)[0])
        ref = torch.cat(refs, dim=0)
        ref.float().square().sum().backward()
        want = (ref.detach().float(), q.grad.float(), k.grad.float())
        for name, a, b in zip(("output", "dq", "dk"), got, want):
            err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
            if err > 2e-2:
                return f"disagrees with sdpa ({name} relative error {err:.3f})"
    except Exception as exc:  # noqa: BLE001 - any failure of the probe means: do not use it
        return f"failed its check: {type(exc).__name__}: {str(exc)[:160]}"
    return ""


# ------------------------------------------------------------------------------------------------ sampler --

def step_rows(order: list[int], lengths: list[int], ranks: int, grad_accum: int) -> list[list[list[int]]]:
    """One optimizer step's rows, `order` (dataset indices), dealt out as [rank][micro-batch] -> indices.

    Longest first, tier by tier (one row per rank per tier), the rank with the fewest tokens so far takes the
    tier's longest row: every rank ends within one row's length of the others. Each rank's rows are then cut into
    grad_accum micro-batches in that order, so a micro-batch holds rows of similar length (little padding), the
    same micro-batch of every rank holds rows of the same tiers, and every micro-batch has the same number of rows
    (len(order) / (ranks * grad_accum), the planned micro-batch)."""
    by_length = sorted(order, key=lambda i: (-lengths[i], i))
    rows = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for start in range(0, len(by_length), ranks):
        takers = sorted(range(ranks), key=lambda r: (tokens[r], r))
        for index, rank in zip(by_length[start:start + ranks], takers):
            rows[rank].append(index)
            tokens[rank] += lengths[index]
    out = []
    for mine in rows:
        cuts = [round(k * len(mine) / grad_accum) for k in range(grad_accum + 1)]
        out.append([mine[a:b] for a, b in zip(cuts, cuts[1:])])
    return out


@functools.cache
def _rank_balanced_sampler_class():
    # A subclass of transformers' BatchRebalanceSampler: the Trainer hands that class to the DataLoader as its
    # batch_sampler and keeps accelerate from sharding it again (it is rank-aware already). Its own assignment
    # sizes micro-batches by a padded-cost model (more rows where rows are short), which would break the plan's
    # memory budget; this one keeps every micro-batch at micro_batch rows.
    import math

    import torch
    from transformers.trainer_pt_utils import BatchRebalanceSampler, get_length_grouped_indices

    class RankBalancedSampler(BatchRebalanceSampler):
        """Every rank draws the same random permutation (same seed, no communication) and takes its share of each
        optimizer step's rows from `step_rows`. group_by_length: the permutation is length-grouped first (padded
        batches on GPUs without a variable-length kernel), so a step's rows have similar lengths."""

        def __init__(self, *args, group_by_length: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.group_by_length = group_by_length

        def __iter__(self):
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            n = len(self.lengths)
            if self.group_by_length:
                order = get_length_grouped_indices(self.lengths, self.effective_batch_size, generator=g)
            elif self.shuffle:
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            size = self.effective_batch_size
            for step in range(self.num_global_batches):
                rows = order[step * size:(step + 1) * size]
                short = self.dp_size * self.grad_accum - len(rows)
                if short > 0:  # the last, partial step (drop_last off): at least one row per micro-batch
                    rows = rows + (order * math.ceil(short / n))[:short]
                yield from self._yield_global_batch(rows)

        def _assign(self, indices, lengths):
            # step_rows looks lengths up by dataset index (a padded last step may repeat an index).
            return step_rows(list(indices), self.lengths, self.dp_size, self.grad_accum)

    return RankBalancedSampler


def rank_balanced_sampler(dataset, args, group_by_length: bool = False):
    """The sampler for a Trainer's training set under torchrun (args: its TrainingArguments)."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    world = max(1, args.world_size)
    return _rank_balanced_sampler_class()(
        lengths=lengths, effective_batch_size=args.train_batch_size * args.gradient_accumulation_steps * world,
        dp_size=world, grad_accum=args.gradient_accumulation_steps, rank=args.process_index,
        seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
        group_by_length=group_by_length)


# ------------------------------------------------------------------------------------------------ trainer --

def apply_batching(trainer, batching: str) -> None:
    """Switch an SFTTrainer's collator to padding-free. TRL refuses padding_free=True with max_length at
    construction (its check predates its own truncation step), yet truncates rows to max_length during dataset
    preparation whenever packing is off: so the trainer is built padded, with rows truncated, and only the
    collator is switched. "grouped" is set in the config (train_sampling_strategy). The padding-free batches carry
    PAD_KEY, which `trainer_class`'s trainer takes out before the model is called."""
    if batching != "padding_free":
        return
    collator = trainer.data_collator
    if isinstance(collator, AlignedPaddingFree):
        return
    if not hasattr(collator, "padding_free"):
        raise TypeError(f"padding-free batching needs TRL's DataCollatorForLanguageModeling, not {type(collator)}")
    collator.padding_free = True
    trainer.padding_free = True
    trainer.data_collator = AlignedPaddingFree(collator)


PAD_TO = 8  # padding-free sequences are padded to a multiple of this many tokens (AlignedPaddingFree)
PAD_KEY = "freetune_pad_tokens"  # batch key: how many of a padding-free batch's tokens are that padding


class AlignedPaddingFree:
    """TRL's padding-free collator, its one flat sequence padded to a multiple of PAD_TO tokens by one extra row
    that trains nothing (labels -100, positions restarting at 0, its own cu_seq_lens entry: attention keeps it
    apart). Why: compiled layers (torch.compile with dynamic shapes) guard on the token count's divisibility by 8
    (inductor's alignment assumptions), so an unaligned count meets a graph compiled for an aligned one and
    recompiles, mid-run, 10-20 s each (seen on an H200: one step in four at 200-4,500 tokens/s instead of 15,000).
    Always aligned, one graph serves every step. TRL's own pad_to_multiple_of pads with position 0 only, which
    makes every pad token a row of its own. At most PAD_TO - 1 tokens a micro-batch; their count travels in the
    batch under PAD_KEY for the token metrics; the trainer takes it out before the model sees the batch."""

    def __init__(self, collator, multiple: int = PAD_TO):
        self.collator, self.multiple = collator, multiple

    def __getattr__(self, name):  # padding_free, pad_token_id, ...: what callers read from TRL's collator
        if name == "collator" or name.startswith("__"):  # not set yet (a copy or unpickling): no endless lookup
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, examples):
        import torch

        out = self.collator(examples)
        length = out["input_ids"].size(1)
        pad = -length % self.multiple
        out[PAD_KEY] = pad
        if pad == 0:
            return out

        def extend(key, values):
            out[key] = torch.cat([out[key], values.to(out[key].dtype).reshape(1, -1)], dim=1)

        extend("input_ids", torch.full((pad,), self.collator.pad_token_id))
        extend("labels", torch.full((pad,), -100))
        extend("position_ids", torch.arange(pad))
        if "seq_idx" in out:
            extend("seq_idx", torch.full((pad,), int(out["seq_idx"].max()) + 1))
        if "cu_seq_lens_q" in out:
            cu = torch.cat([out["cu_seq_lens_q"], out["cu_seq_lens_q"].new_tensor([length + pad])])
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
            out["max_length_q"] = out["max_length_k"] = max(out["max_length_q"], pad)
        return out


def trainer_class(base):
    """`base` (TRL's SFTTrainer or a subclass) with the per-micro-batch metric syncs moved to log steps."""
    import torch

    class FastMetricsTrainer(base):
        _sums = None  # device tensor: label tokens, entropy sum, top-1 hits, real input tokens (padded batches)
        _host = (0, 0)  # counts known without asking the GPU: real tokens of padding-free batches, computed tokens

        def _fast_loss_applies(self) -> bool:
            pc = getattr(self.accelerator, "parallelism_config", None)
            return (self.model.training and self.compute_loss_func is None and self.label_smoother is None
                    and self.args.loss_type == "nll" and not self.aux_loss_enabled
                    and not (pc is not None and getattr(pc, "sp_enabled", False)))

        _pad_tokens = 0  # AlignedPaddingFree's count for the batch being computed (metrics only)

        def _prepare_inputs(self, inputs):
            # Every path to the model (training step, evaluation, with or without labels) comes through here:
            # the count leaves the batch before any model call could receive it as an argument.
            self._pad_tokens = inputs.pop(PAD_KEY, 0) if hasattr(inputs, "pop") else 0
            return super()._prepare_inputs(inputs)

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            pad, self._pad_tokens = self._pad_tokens, 0
            if not self._fast_loss_applies():
                return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                            num_items_in_batch=num_items_in_batch)
            # TRL's own nll branch, line for line, without its .item() calls and gathers.
            inputs["use_cache"] = False
            outputs = model(**inputs, fused_lm_head=True)
            per_token_loss = -outputs.log_probs  # zero on ignored positions
            num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
            loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            with torch.no_grad():
                # No torch.tensor(python number, device=cuda) here: a host-to-device copy waits for the GPU too.
                padded = "attention_mask" in inputs
                seen = inputs["attention_mask"].sum() if padded else outputs.label_mask.new_zeros(())
                sums = torch.stack([outputs.label_mask.sum().float(), outputs.entropy.detach().sum().float(),
                                    outputs.is_top1.sum().float(), seen.float()])
                self._sums = sums if self._sums is None else self._sums + sums
                host_seen = 0 if padded else inputs["position_ids"].size(1) - pad
                self._host = (self._host[0] + host_seen, self._host[1] + inputs["input_ids"].numel())
            return (loss, outputs) if return_outputs else loss

        def _get_train_sampler(self, train_dataset=None):
            dataset = self.train_dataset if train_dataset is None else train_dataset
            if getattr(self.args, "freetune_sampler", "") == "rank_balanced" and "input_ids" in getattr(
                    dataset, "column_names", ()):
                return rank_balanced_sampler(dataset, self.args,
                                             group_by_length=getattr(self.args, "freetune_batching", "") == "grouped")
            return super()._get_train_sampler(train_dataset)

        def log(self, logs, start_time=None):
            if self._sums is not None and self.model.training:
                # One gather and one device sync per log step, instead of four per micro-batch.
                sums = torch.cat([self._sums, self._sums.new_tensor(self._host)])  # one small copy per log step
                if self.accelerator.num_processes > 1:
                    sums = self.accelerator.reduce(sums, reduction="sum")
                valid, entropy, correct, seen_padded, seen_free, computed = sums.tolist()
                seen = seen_padded + seen_free
                self._sums, self._host = None, (0, 0)
                self._total_train_tokens += int(seen) // self._tp_size
                metrics = self._metrics["train"]
                metrics["entropy"] = [entropy / valid if valid > 0 else 0.0]
                metrics["mean_token_accuracy"] = [correct / valid if valid > 0 else 0.0]
                metrics["num_tokens"] = [self._total_train_tokens]
                # Share of the tokens run through the model that were padding (0 when padding-free).
                metrics["pad_fraction"] = [1 - seen / computed if computed else 0.0]
            return super().log(logs, start_time)

    return FastMetricsTrainer


def padding_stats(batch) -> dict:
    """Real and pad tokens of one collated batch (what a forward pass computes on)."""
    ids = batch["input_ids"]
    computed = int(ids.numel())
    if "attention_mask" in batch:
        real = int(batch["attention_mask"].sum())
    else:  # padding-free: one row, its alignment padding counted by AlignedPaddingFree
        real = computed - int(batch.get(PAD_KEY, 0))
    return {"computed_tokens": computed, "real_tokens": real, "pad_tokens": computed - real}
