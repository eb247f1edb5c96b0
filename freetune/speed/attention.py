"""The fast default training path: more real tokens per kernel launch, fewer host round trips, same loss; and here,
its attention: variable-length kernels that keep a padding-free batch's rows apart.

What the plain stack (TRL's SFTTrainer, batch 1 x accumulation 8, padded batches) wastes, and where freetune
answers it (issue 8 has the measurements):
- Padding: padding-free batches, the rows concatenated (freetune.speed.batching), or, where the attention kernel would
  have to compute a packed row's mask densely (no variable-length kernel), `grouped`: padded batches of similar
  lengths (transformers' LengthGroupedSampler), which keeps the padding small and the rows apart.
- Ranks waiting for each other (DDP, FSDP): each optimizer step's rows dealt out with equal tokens per rank
  (freetune.speed.sampler).
- The attention kernel (this module). On sm80+ the packed rows go through PyTorch's variable-length
  FlashAttention-2 (aten._flash_attention_forward given TRL's cu_seq_lens, else torch.nn.attention.varlen.varlen_attn):
  each row attends only to itself, no mask is built into the kernel and nothing is computed across rows. It is
  checked against PyTorch's sdpa once per process (`varlen_works`) before the plan picks it; anywhere else the same
  registered attention falls back to sdpa with transformers' block-diagonal mask (correct; tests/test_fast_path.py
  runs it on a CPU).
- Host round trips. TRL's compute_loss calls .item() and gathers across ranks three times per micro-batch for its
  entropy / token-accuracy / token-count metrics: a device sync each time, which serialises the CPU with the GPU,
  and under DDP three extra collectives per micro-batch. freetune.trainer.FreetuneTrainer keeps the same sums on the
  GPU and reads them once per log step (same values in the log, a fraction of the syncs). The Trainer's other
  per-step syncs are off in freetune.sft_config.make_config (the blocking batch copy, the NaN filter) and
  freetune.checkpoint.StopAgreement (the ranks' stop flag, read a step late).
- The micro-batch and gradient checkpointing (freetune.plan.make_plan: checkpointing is dropped when the
  memory estimate fits the full batch without it, the recompute costing ~30% of the step); the LoRA layers
  (freetune.speed.lora_kernel).
- The loss head: TRL (>= 1.x) already scores tokens in tiles and never holds the (tokens x vocabulary) logits;
  nothing to add (Liger's fused linear cross-entropy is refused by TRL 1.16, which patches the same forward).

The loss stays the same: TRL divides the summed token losses of an optimizer step by the number of label
tokens in that step (num_items_in_batch), however the rows are split into micro-batches or concatenated.
tests/test_fast_path.py checks it against the plain path on the same rows.
"""

from __future__ import annotations

import inspect

from freetune.errors import FreetuneError
from freetune.reach.torch import flash_attention_forward
from freetune.speed.attention_efficient import efficient_op
from freetune.speed.feature import Feature

VARLEN_ATTENTION = "freetune_varlen"  # the name registered with transformers' AttentionInterface


# ---------------------------------------------------------------------------------------------- attention --

# What every attention call reads runs inside the compiled decoder layers
# (freetune.speed.compiled_layers.compile_layers), so it reads plain module dicts filled beforehand, never a
# functools.cache'd function: dynamo ignores the cache and traces the function itself: calling the cached probe from the
# attention function ran the whole probe (a forward and backward on test tensors, and a graph break) in every attention
# call of every step.
_CHOSEN: dict = {}   # GPU index -> (backend or "", why): set by varlen_works, eagerly (plan, train)
_VARLEN: dict = {}   # "fn": torch.nn.attention.varlen.varlen_attn or None, "params": its keyword names
# GPU index -> True where the plan puts a layer's grouped-query heads through the memory-efficient kernel in one call
# (Kernels.attention_whole_heads, freetune.speed.attention_efficient's "whole" layout); set with the probe (_probe_now)
_WHOLE_HEADS: dict = {}


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
#                   causal inside each row, nothing across rows. It takes equal head counts: grouped-query heads are
#                   handled a kv head at a time (freetune.speed.attention_efficient);
#   "efficient_copied"  the same kernel, with the heads copied into parts (freetune.speed.attention_efficient):
#                       the fallback.
# Either efficient backend takes every head in one call instead where the plan says the copies fit
# (Kernels.attention_whole_heads); the probe checks that layout too.
EFFICIENT_BACKENDS = ("efficient", "efficient_copied")  # the memory-efficient kernel's two layouts
VARLEN_BACKENDS = ("flash", "torch_varlen", *EFFICIENT_BACKENDS)
# What each precision policy may use: a T4 (Turing, sm75) has no FlashAttention-2 kernel in PyTorch, and the T4
# emulation on a bigger GPU holds to what a T4 can run.
POLICY_BACKENDS = {"ampere": VARLEN_BACKENDS, "turing": EFFICIENT_BACKENDS}
VARLEN_KERNEL_NAMES = {"flash": "FlashAttention-2", "torch_varlen": "varlen_attn",
                       "efficient": "memory-efficient (sm50+, a T4 included)",
                       "efficient_copied": "memory-efficient (sm50+, a T4 included; heads copied per part)"}


def _varlen_call(q, k, v, cu_seq, max_len: int, scale, backend: str = "flash", whole_heads: bool = False):
    """Causal variable-length attention on (tokens, heads, dim) tensors, rows given by cu_seq (int32). whole_heads:
    the memory-efficient backends take every head in one call (k and v copied), not a part at a time."""
    if backend == "flash":
        return flash_attention_forward(q, k, v, cu_seq, cu_seq, max_len, max_len, 0.0, True, False, scale=scale)[0]
    if backend in EFFICIENT_BACKENDS:
        layout = "whole" if whole_heads else "strided" if backend == "efficient" else "copied"
        return efficient_op()(q, k, v, cu_seq, max_len, scale, layout)
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
        max_len = kwargs.get("max_length_q") or int(cu.diff().max())
        refuse_what_varlen_drops(module, int(max_len), kwargs)
        q = query[0].transpose(0, 1).to(dtype)  # (batch 1, heads, tokens, dim) -> (tokens, heads, dim)
        k = key[0].transpose(0, 1).to(dtype)
        v = value[0].transpose(0, 1).to(dtype)
        out = _varlen_call(q, k, v, cu.to(device=q.device, dtype=torch.int32), int(max_len), scaling, backend,
                           _WHOLE_HEADS.get(query.device.index or 0, False))
        return out.unsqueeze(0), None  # (1, tokens, heads, dim), as sdpa_attention_forward returns
    if attention_mask is None and query.shape[0] == 1 and query.shape[2] > 1:
        attention_mask = rows_mask(kwargs.get("position_ids"), query.shape[2], query.device)  # varlen_mask skipped it
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def refuse_what_varlen_drops(module, longest_row: int, kwargs: dict) -> None:
    """Raise where the variable-length kernels would compute something else than the model asks: they take the rows'
    boundaries only, no sliding window (harmless only where no row is longer) and no soft-capped logits. The plan steps
    aside for such models (freetune.plan.decisions.varlen_why_not); this is the check that nothing else got here."""
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if softcap or (window and window < longest_row):
        what = f"soft-capped logits ({softcap})" if softcap else f"a sliding window of {window} tokens"
        raise FreetuneError(f"{type(module).__name__} asks for {what}, which freetune's variable-length attention "
                            f"cannot honour; plan this model with freetune.plan.make_plan(model_shape=<its "
                            f"model_id>), which steps padding-free batches aside for it")


def rows_mask(position_ids, tokens: int, device):
    """The block-diagonal causal mask (1, 1, tokens, tokens) of one padding-free sequence whose positions restart at 0
    for each row (TRL's and AlignedPaddingFree's), for sdpa where varlen_mask left it out; None without positions (then
    one row: sdpa's is_causal is right)."""
    import torch

    if position_ids is None:
        return None
    row = (position_ids[0] == 0).cumsum(0)
    causal = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril_()
    return (causal & (row[:, None] == row[None, :]).to(device))[None, None]


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                attention_mask=None, device="cpu", **kwargs):
    """freetune_varlen's mask function (transformers' AttentionMaskInterface): none at all for a training batch of one
    padding-free sequence on a GPU whose variable-length kernel was chosen (the kernel reads the rows' boundaries;
    transformers' dense block-diagonal mask, tokens x tokens, would stay alive for every checkpointed layer unread);
    sdpa's mask for everything else. Where a layer still falls back to sdpa, varlen_attention_forward rebuilds the mask
    from the positions (rows_mask)."""
    import torch
    from transformers.masking_utils import sdpa_mask

    place = torch.device(device)
    if (attention_mask is None and batch_size == 1 and q_offset == 0 and kv_offset == 0 and q_length == kv_length
            and place.type == "cuda" and varlen_backend(place.index or 0) and torch.is_grad_enabled()):
        return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset=q_offset, kv_offset=kv_offset,
                     attention_mask=attention_mask, device=device, **kwargs)


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

    Its mask is sdpa's, except for a padding-free training batch on a GPU with a variable-length kernel
    (varlen_mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    AttentionMaskInterface.register(VARLEN_ATTENTION, varlen_mask)
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
        if backend not in EFFICIENT_BACKENDS and major < 8:
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
    """'' when `backend` agrees with sdpa on two packed rows (output, dq, dk, dv), else what went wrong."""
    import torch

    try:
        device = torch.device("cuda", device_index)
        gen = torch.Generator(device=device).manual_seed(0)
        lengths, heads, kv_heads, dim = [37, 91], 4, 2, 64
        total = sum(lengths)
        bf16 = backend not in EFFICIENT_BACKENDS and torch.cuda.is_bf16_supported()
        dtype = torch.bfloat16 if bf16 else torch.float16
        # The model hands over (1, heads, tokens, dim) views; probe the same layout.
        q = torch.randn(1, heads, total, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        k = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        v = torch.randn(1, kv_heads, total, dim, device=device, dtype=dtype, generator=gen).requires_grad_()
        cu = torch.tensor([0, lengths[0], total], device=device, dtype=torch.int32)
        results = {}
        # the memory-efficient backends in their own layout and with every head in one call (the plan's choice)
        for whole in (False, True) if backend in EFFICIENT_BACKENDS else (False,):
            out = _varlen_call(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, max(lengths),
                               dim ** -0.5, backend, whole)
            out.float().square().sum().backward()
            results[whole] = (out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float())
            q.grad = k.grad = v.grad = None
        refs = []
        for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
            kk = k[:, :, start:end].repeat_interleave(heads // kv_heads, dim=1)
            vv = v[:, :, start:end].repeat_interleave(heads // kv_heads, dim=1)
            refs.append(torch.nn.functional.scaled_dot_product_attention(
                q[:, :, start:end], kk, vv, is_causal=True).transpose(1, 2)[0])
        ref = torch.cat(refs, dim=0)
        ref.float().square().sum().backward()
        want = (ref.detach().float(), q.grad.float(), k.grad.float(), v.grad.float())
        for whole, got in results.items():
            for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
                err = (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
                if err > 2e-2:
                    heads_how = ", every head in one call" if whole else ""
                    return f"disagrees with sdpa ({name} relative error {err:.3f}{heads_how})"
    except Exception as exc:  # noqa: BLE001 - any failure of the probe means: do not use it
        return f"failed its check: {type(exc).__name__}: {str(exc)[:160]}"
    return ""


def _probe_applies(plan, trainer) -> tuple[bool, str]:
    import torch

    # A CPU run has no kernel to probe; padded batches run transformers' own attention.
    return torch.cuda.is_available() and plan.batch.batching == "padding_free", ""


def _probe_now(trainer, plan) -> None:
    """Probed now, eagerly, in this process (a torchrun rank too): the attention layers only read the result, and
    the plan's layout of the grouped-query heads."""
    import torch

    device = torch.cuda.current_device()
    varlen_works(device, plan.precision.policy)
    _WHOLE_HEADS[device] = plan.kernels.attention_whole_heads


FEATURE = Feature("Attention", _probe_applies, _probe_now)
