"""Grouped-query causal attention within each row through PyTorch's memory-efficient kernel, as custom ops
(freetune::varlen_efficient and its backward): the "efficient" and "efficient_copied" backends of
freetune.speed.attention, for GPUs without FlashAttention-2 (a T4).
"""

from __future__ import annotations

from freetune.reach.torch import efficient_attention_backward, efficient_attention_forward

# Grouped-query attention through the memory-efficient kernel, which takes equal head counts. Two layouts, checked
# against sdpa in this order by `varlen_works` (the probe picks the first that agrees on this GPU), and a third the
# plan picks where memory allows:
#   "efficient"         one kernel call per kv head with its q heads: q read as a head-slice view, k and v as a
#                       stride-0 view repeated for the q heads (no copy); the backward copies only what its kernel
#                       cannot read strided (the output slice: the kernel takes its row stride as heads x dim; the
#                       incoming gradient, copied inside the aten op) and sums the repeated heads' gradients straight
#                       into the kv heads' slices.
#   "efficient_copied"  the layout before it: up to KV_HEAD_PARTS parts of whole kv heads, k and v repeated into
#                       copies, q, the gradient and the output copied per part. More launches a step (seven copies per
#                       part in the backward, docs/performance.md), kept as the proven fallback.
#   "whole"             every head in one call, k and v repeated into copies: fewer, fuller kernel launches (issue 49,
#                       scripts/attention_gpu.py: TinyLlama's 32 q / 4 kv heads, 8 x 1,024 tokens on an H200, 1.70 ms of
#                       kernels a layer against 2.16 a kv head at a time), at the memory of the copies and of every q
#                       head's k and v gradients (freetune.plan.memory.whole_heads_attention_bytes) in a layer's
#                       backward. The plan asks for it (Kernels.attention_whole_heads) where that fits its budget;
#                       once, a 4 GiB card's peak was those tensors (a memory snapshot on the GPU, docs/performance.md).
KV_HEAD_PARTS = 4
LAYOUTS = ("strided", "copied", "whole")

_EFFICIENT: dict = {}  # "op": the freetune::varlen_efficient custom op, defined once per process


def efficient_op():
    """freetune::varlen_efficient(q, k, v, cu_seq, max_len, scale, layout): causal attention within each row through
    PyTorch's memory-efficient kernel (aten._efficient_attention_forward / _backward with cumulative row lengths), as a
    custom op with its own autograd; `layout` is one of LAYOUTS (above: "strided" is the "efficient" backend's,
    "copied" the "efficient_copied" backend's, "whole" all heads in one call). Why not
    the aten ops directly: their backward's meta function (torch 2.11 and 2.13) takes its arguments shifted by one ("got
    multiple values for argument 'scale'"), so a compiled decoder layer that calls them falls back to eager as a whole;
    a custom op stays one node of the layer's graph, its shapes given here. Grouped-query heads are repeated inside the
    op, so that only the unrepeated k and v are saved for the backward."""
    if "op" in _EFFICIENT:
        return _EFFICIENT["op"]
    import torch

    # Schemas spelled out: this module's annotations are strings (from __future__ import annotations).
    @torch.library.custom_op("freetune::varlen_efficient", mutates_args=(),
                             schema="(Tensor q, Tensor k, Tensor v, Tensor cu, SymInt max_len, float? scale, "
                                    "str layout) -> (Tensor, Tensor)")
    def op(q, k, v, cu, max_len, scale, layout):
        return _forward_4d(q, k, v, cu, max_len, scale, layout)

    op.register_fake(_forward_4d)  # the forward's own meta function gives the shapes, the logsumexp's included
    backward_op = torch.library.custom_op(
        "freetune::varlen_efficient_backward", _backward_4d, mutates_args=(),
        schema="(Tensor grad, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu, SymInt max_len, "
               "float? scale, str layout) -> (Tensor, Tensor, Tensor)")

    @backward_op.register_fake
    def _(grad, q, k, v, out, lse, cu, max_len, scale, layout):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        q, k, v, cu, max_len, scale, layout = inputs
        ctx.save_for_backward(q, k, v, *output, cu)
        ctx.max_len, ctx.scale, ctx.layout = max_len, scale, layout

    def backward(ctx, grad, _lse_grad):
        q, k, v, out, lse, cu = ctx.saved_tensors
        dq, dk, dv = backward_op(grad, q, k, v, out, lse, cu, ctx.max_len, ctx.scale, ctx.layout)
        return dq, dk, dv, None, None, None, None

    op.register_autograd(backward, setup_context=setup_context)
    _EFFICIENT["op"] = lambda q, k, v, cu, max_len, scale, layout="strided": op(q, k, v, cu, max_len, scale, layout)[0]
    return _EFFICIENT["op"]


def _parts(q, k, layout: str):
    """(q heads, kv heads) slices, one kernel call each: all heads at once without grouped-query attention or in the
    "whole" layout; else one kv head per part ("strided") or up to KV_HEAD_PARTS parts of whole kv heads ("copied")."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, not {layout!r}")
    groups = q.shape[1] // k.shape[1]
    if groups == 1 or layout == "whole":
        return [(slice(None), slice(None))]
    count = k.shape[1] if layout == "strided" else max(
        c for c in range(1, min(KV_HEAD_PARTS, k.shape[1]) + 1) if k.shape[1] % c == 0)
    per = k.shape[1] // count
    return [(slice(i * per * groups, (i + 1) * per * groups), slice(i * per, (i + 1) * per)) for i in range(count)]


def _repeated(t, groups: int, layout: str):
    """k or v (tokens, kv heads, dim) with each head repeated for the `groups` q heads that read it: a stride-0
    view of one kv head ("strided"), else a copy."""
    if groups == 1:
        return t
    return t.expand(-1, groups, -1) if layout == "strided" else t.repeat_interleave(groups, dim=1)


def _forward_4d(q, k, v, cu, max_len, scale, layout):
    import torch

    groups = q.shape[1] // k.shape[1]
    outs, lses = [], []
    for qs, ks in _parts(q, k, layout):
        # q's heads of this part as a view, not a copy: the forward kernel reads the strides it is given (the
        # own-logits GPU test checks it); every copy is a launch on a launch-bound step.
        qp, kp, vp = q[:, qs], _repeated(k[:, ks], groups, layout), _repeated(v[:, ks], groups, layout)
        # (1, tokens, heads, dim), as the kernel takes batches; custom_mask_type 1: causal from each row's start.
        # The logsumexp is what the backward needs; the dropout seeds are not (no dropout in attention).
        out, lse = efficient_attention_forward(qp[None], kp[None], vp[None], None, cu, cu, max_len, max_len, 0.0,
                                               1, True, scale=scale)[:2]
        outs.append(out[0])
        lses.append(lse)
    if len(outs) == 1:
        # The kernel's own new tensor, returned as a view, not a copy: torch checks that a custom op's outputs share
        # no storage with its inputs (torch.library's check_aliasing_constraint, torch 2.10-2.13), which a view of a
        # tensor made here does not. The copy was 25 MB a layer on the T4 long rows (docs/performance.md).
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def _backward_4d(grad, q, k, v, out, lse, cu, max_len, scale, layout):
    """The op's backward: the gradients of q, k and v, a part of the heads at a time as in the forward."""
    import torch

    unused = torch.empty((), dtype=torch.long)  # dropout's seed and offset, read only when dropout_p > 0
    grad = grad.contiguous()
    if q.shape[1] == k.shape[1]:
        dq, dk, dv, _ = efficient_attention_backward(
            grad[None], q[None], k[None], v[None], None, out[None], cu, cu, max_len, max_len, lse, 0.0, unused,
            unused, 1, False, scale=scale)
        return dq[0].contiguous(), dk[0].contiguous(), dv[0].contiguous()
    groups = q.shape[1] // k.shape[1]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    dqs = []
    for qs, ks in _parts(q, k, layout):
        kp, vp = _repeated(k[:, ks], groups, layout), _repeated(v[:, ks], groups, layout)
        # The kernel reads q's strides; the incoming gradient the aten op copies itself; the output's row stride
        # the kernel takes as heads x dim (o_strideM in PyTorch's kernel_backward.h), so that slice is always
        # copied. (Views of all three gave wrong gradients on the GPU: gpu_tests_strided_backward_failed.log.)
        qp, gp, outp, lp = q[:, qs], grad[:, qs], out[:, qs].contiguous(), lse[:, qs]
        if layout == "copied":
            qp, gp = qp.contiguous(), gp.contiguous()
        dqp, dkp, dvp, _ = efficient_attention_backward(
            gp[None], qp[None], kp[None], vp[None], None, outp[None], cu, cu, max_len, max_len, lp, 0.0, unused,
            unused, 1, False, scale=scale)
        dqs.append(dqp[0])
        # the repeated heads' gradients summed back onto each key/value head, written in place
        torch.sum(dkp[0].unflatten(1, (-1, groups)), dim=2, out=dk[:, ks])
        torch.sum(dvp[0].unflatten(1, (-1, groups)), dim=2, out=dv[:, ks])
    # one part (the "whole" layout): no torch.cat, which copies even one tensor; contiguous as cat's output was
    # (a no-op for the kernel's own contiguous gradient)
    return (dqs[0].contiguous() if len(dqs) == 1 else torch.cat(dqs, dim=1)), dk, dv
