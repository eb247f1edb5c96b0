"""torch's internals freetune reaches into: dynamo's and functorch's settings, compiled modules, cuBLAS workspaces,
dynamo's mark_static, the multi-tensor copy, the fused attention kernels' aten ops, a module's forward replaced on
the instance, and freetune's own state kept on another library's module. Written against torch 2.13.

torch's version is the platform's (Colab's and Kaggle's images), not a pin: a reach whose op is missing makes its
feature step aside (attention.varlen_works probes the attention ops before a run uses them)."""

from __future__ import annotations

import types

WRITTEN_AGAINST = {"torch": "2.13"}


def compile_settings() -> None:
    """The process-wide torch.compile settings freetune.speed.compiled_layers.compile_layers needs (torch 2.13's dynamo
    and functorch config). A layer dynamo cannot compile runs eagerly (suppress_errors) rather than stopping the run."""
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    # The fused function dequantises each weight again in its backward rather than keep a 16-bit copy (the whole
    # model's worth over a step without checkpointing, more than a 4 GiB card has spare). Common-subexpression
    # elimination of the joint forward-backward graph would merge the two
    # dequantisations into one whose output the forward then saves; without it the backward keeps its own.
    import torch._functorch.config

    torch._functorch.config.cse = False
    # With LoRA dropout 0 the fused function's backward reads its input itself (dropout > 0 reads input x mask), and
    # the partitioner never recomputes what a backward matmul reads: each compiled layer kept both norms' outputs and
    # the MLP's down-projection input (act(gate) x up) for its backward, 24 KB a token and layer more on
    # Qwen2.5-1.5B's widths (counted on a CPU) than the memory estimate counts. A T4-capped run with dropout 0 peaked
    # at 13.6 GiB, the same plan with dropout 0.05 (and fused AdamW's larger state) at 10.6 (docs/performance.md).
    # Recomputed instead, from the layer's input and the gate and up outputs it saves anyway: element-wise work, what
    # a layer with dropout > 0 does already.
    torch._functorch.config.ban_recompute_materialized_backward = False
    # One compiled graph serves every layer of a model (same code, different weights): the cache must hold at
    # least one entry per layer's guards.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # Under DDP, dynamo's DDPOptimizer cuts every compiled graph where a gradient bucket fills, so that each
    # bucket's all-reduce can start before the rest of the backward. The layers are compiled one by one, so DDP
    # already gets each layer's gradients as soon as its backward ends; the cut only split every layer into two
    # graphs (its first bucket is smaller than one LoRA layer's gradients): twice the compiled-graph calls per
    # step, host time that a launch-bound step pays in full, and more peak memory per GPU (docs/history.md).
    torch._dynamo.config.optimize_ddp = False
    # Python floats (the LoRA scaling, dropout's p, the attention scale, the norms' eps) as constants of the graph, not
    # as its inputs: as inputs each one was wrapped into a 0-dim float64 tensor and guarded on, at every call of every
    # layer (torch._as_tensor_fullprec, a few thousand calls a step in a sampled host profile). They never change
    # during a run; a changed one makes a new graph.
    torch._dynamo.config.specialize_float = True


def uncompile(module) -> bool:
    """torch 2.13: drop what nn.Module.compile installed on `module` (_compiled_call_impl); True if there was any."""
    if getattr(module, "_compiled_call_impl", None) is None:
        return False
    module._compiled_call_impl = None
    return True


def free_cublas_workspaces() -> bool:
    """torch 2.13: free the cuBLAS workspaces torch keeps per handle and stream (torch._C._cuda_clearCublasWorkspaces,
    after the GPU is done with them); the next matmul on a stream makes its own again. False where torch lacks it."""
    import torch

    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    torch.cuda.synchronize()
    clear()
    return True


def replace_forward(module, forward) -> None:
    """A module's forward replaced on the instance (peft 0.21's LoRA layers, a torch nn.Embedding): the class's own
    stays reachable as type(module).forward, which the replacement calls for everything it does not do itself."""
    module.forward = types.MethodType(forward, module)


def restore_forward(module) -> None:
    """Undo replace_forward: the class's own forward again."""
    module.__dict__.pop("forward", None)


def set_last_lrs(scheduler, rates) -> None:
    """torch 2.13: what an LRScheduler's get_last_lr() returns (its _last_lr), set to `rates` (one per parameter
    group) after freetune.trainer changed the learning rates under it."""
    scheduler._last_lr = list(rates)


def mark_static(tensor) -> None:
    """torch 2.13: torch._dynamo.mark_static: a tensor of fixed size, whose sizes a compiled graph must not take as
    dynamic (a token count equal to one of them would otherwise specialise a graph)."""
    import torch._dynamo

    torch._dynamo.mark_static(tensor)


def foreach_copy_(destinations, sources) -> None:
    """torch 2.13: torch._foreach_copy_: every source copied into its destination in one multi-tensor launch, where a
    loop of copy_ would launch once per tensor on a step bound by the host's launches."""
    import torch

    torch._foreach_copy_(destinations, sources)


# ---- the fused attention kernels' aten ops (freetune.speed.attention) ------------------------------------------------
# torch 2.13: the varlen flash kernel and the memory-efficient kernel's forward and backward, which
# scaled_dot_product_attention calls on padded batches only; freetune calls them on packed rows (cu_seqlens).

def flash_attention_forward(*args, **kwargs):
    """torch.ops.aten._flash_attention_forward (q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, causal, return_debug,
    scale=): (out, logsumexp, ...)."""
    import torch

    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def efficient_attention_forward(*args, **kwargs):
    """torch.ops.aten._efficient_attention_forward (q, k, v, bias, cu_q, cu_k, max_q, max_k, dropout_p,
    custom_mask_type, compute_logsumexp, scale=): (out, logsumexp, seed, offset, ...)."""
    import torch

    return torch.ops.aten._efficient_attention_forward(*args, **kwargs)


def efficient_attention_backward(*args, **kwargs):
    """torch.ops.aten._efficient_attention_backward (grad, q, k, v, bias, out, cu_q, cu_k, max_q, max_k, logsumexp,
    dropout_p, seed, offset, custom_mask_type, bias_requires_grad, scale=): (dq, dk, dv, dbias)."""
    import torch

    return torch.ops.aten._efficient_attention_backward(*args, **kwargs)


# ---- freetune's state kept on other libraries' modules (peft's LoRA layers, a model's MLPs and embeddings) -----------
# torch 2.13's nn.Module.__setattr__ keeps a value that is neither a Parameter, a buffer nor a Module in the instance's
# __dict__: state_dict, .to() and peft's adapter saving never see it (a tensor kept there does not move with the model,
# which is why the fused forward compares devices). Every such name starts with STASH_PREFIX, which no library uses.

STASH_PREFIX = "_freetune_"


def stash(module, name: str, value) -> None:
    """Keep `value` on `module` under `name` (one of freetune's STASH_PREFIX names, a constant beside its users)."""
    setattr(module, name, value)


def stashed(module, name: str, default=None):
    """What stash kept on `module` under `name`, else `default`."""
    return getattr(module, name, default)


def unstash(module, name: str) -> None:
    """Forget what stash kept on `module` under `name` (nothing if there is none)."""
    module.__dict__.pop(name, None)
