"""The traced MLP (QLoRAMLP): a SwiGLU MLP over three fused 4-bit LoRA layers as one autograd node whose backward
recomputes gate and up, traced by torch.compile into the decoder layer's graph (freetune.speed.mlp says where the plan
takes it).
"""

from __future__ import annotations

from freetune.speed import dropout, lora_kernel, mlp_ops, nf4, recompute

_TRACED = None  # the QLoRAMLP classes (the full node, the recompute's), built once, eagerly (as
# freetune.speed.lora_kernel's QLoRALinear: dynamo cannot trace a class body)


def _dequantized(packed, absmax, table, spec, copy: bool = False):
    """The 16-bit weight; `copy` dequantises from a fresh copy of the fp32 absmax values (or of their table:
    nf4.quant_args) (x * 1): the traced graph's common-subexpression elimination would otherwise merge the
    backward's dequantisation (and then its matmuls) with the forward's, and the partitioner would save the
    forward's gate and up outputs."""
    if copy and table is None:
        absmax = absmax * 1.0
    elif copy:
        table = table * 1.0
    return nf4._dequantize(packed, absmax, spec, table)


def _project(inp, packed, absmax, table, spec, a, b, s, p: float, hs: list, masks: list):
    """One projection's forward, x W^T + s (dropout(x) A^T) B^T; its A output and dropout's mask (bits) appended to
    hs and masks, for the backward."""
    import torch

    y = torch.nn.functional.linear(inp, _dequantized(packed, absmax, table, spec))
    kept = None
    if p > 0.0:
        h, kept = dropout.lora_a_of_dropped(inp, a, p)
    else:
        h = inp @ a.t()
    y = lora_kernel.plus_product(y, h, b.t(), s, widening=y.shape[-1] > inp.shape[-1])
    hs.append(h)
    masks.append(kept)
    return y


def _gate_up_grads(x2, d_gate, d_up, saved: tuple, p: float) -> tuple[list, object]:
    """(the LoRA gradients of gate and up: d A, d B each, the input gradient through both), from d gate and d up.
    saved: per projection (its A output, its mask, A, B, scaling, packed weight, absmax, table, spec)."""
    grads, dx = [], None
    for d, (h, mask, a, b, s, packed, absmax, table, spec) in zip((d_gate, d_up), saved):
        dh = (d @ b).mul_(s)
        grads += [dh.t() @ x2 if mask is None else dropout.lora_a_grad_of_dropped(dh, x2, mask, p),
                  (d.t() @ h).mul_(s)]
        part = nf4.times_dequantized(d, packed, absmax, spec, table)
        if mask is None:
            part = lora_kernel.plus_product(part, dh, a, phase="backward")
        else:
            part = dropout.add_dropped_lora_grad_(part, dh, a, mask, p)
        dx = part if dx is None else dx + part
    return grads, dx


def _backward(ctx, dout):
    """Both classes' backward: gate and up again, the down projection's and SwiGLU's gradients in one op, then gate's
    and up's. hd, the down projection's saved A output, is None where the forward skipped it (the op then computes
    d B from each chunk's activation)."""
    (x2, hg, hu, hd, mg, mu, md, gw, gabs, gtab, uw, uabs, utab, dw, dabs, dtab, ga, gb, ua, ub, da,
     db) = ctx.saved_tensors
    specs, (gs, us, ds), p = ctx.specs, ctx.scalings, ctx.p
    compute = specs[0][3]
    shape = dout.shape
    dy = dout.reshape(-1, shape[-1]).to(compute)
    # gate and up again (their LoRA terms, from the saved A outputs, added by the op below)
    g = x2 @ _dequantized(gw, gabs, gtab, specs[0], copy=True).t()
    u = x2 @ _dequantized(uw, uabs, utab, specs[1], copy=True).t()
    # The down projection's gradients and SwiGLU's, in one op that writes d gate and d up over g and u
    # (mlp_ops._swiglu_backward_op): traced, the compiler fused and reordered this part into kernels that kept
    # five or more tokens x intermediate tensors alive at once.
    dh = (dy @ db).mul_(ds)
    spec = specs[2]
    grad_da, grad_db = mlp_ops._swiglu_backward_op()(g, u, hg, gb, hu, ub, dy, dh, dw, dabs, dtab, da, md, hd, spec[0],
                                                     spec[1], list(spec[2]), spec[3], [gs, us, ds], p)
    d_gate, d_up = g, u
    del g, u
    grads, dx = _gate_up_grads(x2, d_gate, d_up, ((hg, mg, ga, gb, gs, gw, gabs, gtab, specs[0]),
                                                  (hu, mu, ua, ub, us, uw, uabs, utab, specs[1])), p)
    grads += [grad_da, grad_db]
    grads = [g.to(t) for g, t in zip(grads, ctx.lora_dtypes)]
    dx = dx.reshape(*shape[:-1], dx.shape[-1]).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
    return (dx, *grads, *[None] * 12)


def _inputs(x, adapters: tuple, compute):
    """Both classes' forward inputs in the compute dtype: x as tokens x hidden, the six LoRA weights."""
    return x.reshape(-1, x.shape[-1]).to(compute), [t.to(compute) for t in adapters]


def _keep(ctx, x, x2, hs: list, masks: list, weights: tuple, adapters: tuple, lora: list, specs, scalings,
          p: float) -> None:
    """What both classes' backward reads (_backward); adapters: the LoRA weights as given (their gradients' dtypes)."""
    ctx.save_for_backward(x2, *hs, *masks, *weights, *lora)
    ctx.specs, ctx.scalings, ctx.p = specs, scalings, p
    ctx.x_dtype = x.dtype
    ctx.lora_dtypes = [t.dtype for t in adapters]


def _traced_function():
    import torch

    class QLoRAMLP(torch.autograd.Function):
        """down(silu(gate(x)) * up(x)) over three fused 4-bit LoRA layers as one autograd node, traced into the
        compiled decoder layer (no op boundary: its elementwise work fuses with the layer's). The forward saves the
        input, the LoRA-A outputs (tokens x r) and dropout's masks as bits; the backward computes gate
        and up again (two more 4-bit matmuls, on a GPU that waits for the host anyway) and lets them die into their
        own gradients, so the wide tensors alive at once are those of one step of the backward, not the forward's
        gate and up outputs kept beside all of them."""

        @staticmethod
        def forward(ctx, x, ga, gb, ua, ub, da, db, gw, gabs, gtab, uw, uabs, utab, dw, dabs, dtab, specs, scalings,
                    p: float):
            shape = x.shape
            x2, lora = _inputs(x, (ga, gb, ua, ub, da, db), specs[0][3])
            hs, masks = [], []
            g = _project(x2, gw, gabs, gtab, specs[0], lora[0], lora[1], scalings[0], p, hs, masks)
            u = _project(x2, uw, uabs, utab, specs[1], lora[2], lora[3], scalings[1], p, hs, masks)
            act = torch.nn.functional.silu(g) * u
            del g, u
            out = _project(act, dw, dabs, dtab, specs[2], lora[4], lora[5], scalings[2], p, hs, masks)
            _keep(ctx, x, x2, hs, masks, (gw, gabs, gtab, uw, uabs, utab, dw, dabs, dtab), (ga, gb, ua, ub, da, db),
                  lora, specs, scalings, p)
            out = out.reshape(*shape[:-1], out.shape[-1])
            return out if out.dtype == x.dtype else out.to(x.dtype)

        @staticmethod
        def backward(ctx, dout):
            return _backward(ctx, dout)

    class QLoRAMLPRecompute(torch.autograd.Function):
        """The same node in a checkpoint's recompute whose output nobody reads (freetune.speed.recompute; no dropout):
        its forward computes only what the backward reads, the LoRA-A outputs of gate and up (tokens x r), and
        returns zeros of the output's shape. Gate, up and down of the recompute are three 4-bit matmuls the
        backward never used (it computes gate and up again itself); d B of the down projection comes from the
        backward's own activation."""

        @staticmethod
        def forward(ctx, x, ga, gb, ua, ub, da, db, gw, gabs, gtab, uw, uabs, utab, dw, dabs, dtab, specs, scalings,
                    p: float):
            x2, lora = _inputs(x, (ga, gb, ua, ub, da, db), specs[0][3])
            hs = [x2 @ lora[0].t(), x2 @ lora[2].t(), None]
            _keep(ctx, x, x2, hs, [None, None, None], (gw, gabs, gtab, uw, uabs, utab, dw, dabs, dtab),
                  (ga, gb, ua, ub, da, db), lora, specs, scalings, p)
            return x.new_zeros(*x.shape[:-1], specs[2][2][0])

        @staticmethod
        def backward(ctx, dout):
            return _backward(ctx, dout)

    return QLoRAMLP, QLoRAMLPRecompute


def traced_mlp(x, projections, dropout_p: float):
    """down(silu(gate(x)) * up(x)) for three fused LoRA layers (lora_kernel.fused_call_args of gate, up, down), as one
    autograd.Function that compiled layers trace into their graph."""
    full, skipping = traced_class()
    # In freetune's checkpoint's recompute (its output thrown away) the MLP computes only what its backward reads.
    fn = skipping if recompute.RECOMPUTING and dropout_p == 0.0 else full
    gate, up, down = projections
    return fn.apply(x, gate["lora_a"], gate["lora_b"], up["lora_a"], up["lora_b"], down["lora_a"], down["lora_b"],
                    gate["weight"], gate["absmax"], gate["table"], up["weight"], up["absmax"], up["table"],
                    down["weight"], down["absmax"], down["table"],
                    (gate["spec"], up["spec"], down["spec"]), (gate["scaling"], up["scaling"], down["scaling"]),
                    float(dropout_p))


def traced_class():
    """The QLoRAMLP classes (the full node, the recompute's) and the op their backward calls, made once, eagerly
    (dynamo cannot trace their making)."""
    global _TRACED
    if _TRACED is None:
        mlp_ops._swiglu_backward_op()
        nf4._dequantized_mm_op()
        dropout.make_ops()
        _TRACED = _traced_function()
    return _TRACED
