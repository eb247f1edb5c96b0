"""A decoder layer's SwiGLU MLP over three fused 4-bit LoRA layers as one custom op, run in token chunks: its
(tokens x intermediate) activations never exist for the whole micro-batch at once.

Why: under a small memory budget (a 4 GB card, every layer checkpointed) the peak is one layer's recompute and
backward, and there the MLP's intermediate tensors dominate: gate and up outputs, the activation, its gradient and
the gate and up gradients, each tokens x intermediate (5,632 wide for TinyLlama, 3x the hidden size). A compiled layer
kept seven of them alive at the peak (a memory snapshot on the GPU, docs/performance.md). Here

    forward   for each chunk of tokens:  g = gate(x), u = up(x), a = silu(g) * u, out = down(a)
              saved: x (the layer saves it anyway), each LoRA-A output (tokens x r) and dropout's masks as bits
    backward  for each chunk: g and u recomputed (two 4-bit matmuls), then the down projection's gradient and the
              SwiGLU derivative written in place over g and u, then the gate and up projections' gradients

so the backward holds four chunk-sized intermediate tensors instead of seven whole ones, for two extra matmuls per
layer. The same function as peft's three layers (tests/test_fused_mlp.py: outputs and gradients of every adapter
weight and of the input, with and without dropout). A custom op (not an autograd.Function traced into the compiled
layer): inside torch.compile the partitioner decides what a traced function saves, and it kept g and u.

The price is speed: the op runs its chunks one after another, dozens of launches each, outside the compiled layer's
fused kernels; under a 4 GiB cap it trained at about half the tokens/s of the per-projection MLP (docs/performance.md).
So the plan takes it only where every layer is checkpointed and even one row of max_length would not fit otherwise
(freetune.choices.choose_mlp_kernel): long rows on a small card, which would else be cut.
"""

from __future__ import annotations

import warnings

from freetune import kernels, overrides

FUSED_MLP_ATTR = "_freetune_fused_mlp"
# Tokens per chunk: four chunk-sized tensors of this many tokens x intermediate in the backward (freetune.memory
# counts them); smaller chunks add launches to a step bound by them.
CHUNK_TOKENS = 2048

_OP: dict = {}  # "op": freetune::qlora_mlp, defined once per process


def _keep_scale(p: float) -> float:
    return 1.0 / (1.0 - p)


def _pointwise(fn):
    """`fn` (elementwise work over a chunk) as one fused kernel on a GPU, through torch.compile with dynamic shapes;
    as written on a CPU. Run eagerly op by op it was a dozen launches and passes over memory per chunk, which is what a
    launch-bound step (and a T4's memory bandwidth) cannot spare."""
    compiled: dict = {}

    def call(*args):
        if not args[0].is_cuda:
            return fn(*args)
        if "fn" not in compiled:
            import torch

            compiled["fn"] = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled["fn"](*args)
        except Exception as exc:  # a GPU or torch build inductor cannot compile for: the same arithmetic, eagerly
            if compiled["fn"] is fn:
                raise
            warnings.warn(f"freetune.fused_mlp: {fn.__name__} runs eagerly (torch.compile failed: {exc})")
            compiled["fn"] = fn
            return fn(*args)

    call.__name__ = call.__qualname__ = fn.__name__
    call.__doc__ = fn.__doc__
    return call


@_pointwise
def _pack(kept):
    """dropout's keep-mask as bits (freetune.kernels.pack_mask)."""
    return kernels.pack_mask(kept)


@_pointwise
def _dropped(x, packed, scale: float):
    """dropout's output again: x where the packed mask kept it, times 1 / (1 - p)."""
    return x * kernels.unpack_mask(packed, x.shape[-1], x.dtype) * scale


@_pointwise
def _add_dropped_(dx, lora, packed, scale: float):
    """dx += lora, dropped where the input was (in place)."""
    dx.add_(lora * kernels.unpack_mask(packed, lora.shape[-1], lora.dtype) * scale)


@_pointwise
def _silu_mul(g, u):
    """SwiGLU's activation: silu(g) * u."""
    import torch

    return torch.nn.functional.silu(g) * u


@_pointwise
def _swiglu_grads_(g, u, dact):
    """The gradients of silu(g) * u, written over g (d gate) and u (d up): silu'(g) = sig (1 + g (1 - sig))."""
    import torch

    sig = torch.sigmoid(g.float())
    silu = g.float() * sig
    d_up = dact.float() * silu
    d_gate = dact.float() * u.float() * (sig + silu * (1.0 - sig))
    g.copy_(d_gate)
    u.copy_(d_up)


def _project(x, w, a, b, s: float, p: float):
    """y = x W^T + s (dropout(x) A^T) B^T for one chunk; returns (y, A's output, dropout's packed mask or None)."""
    import torch

    y = x @ w.t()
    if p > 0.0:
        dropped, kept = torch.native_dropout(x, p, True)
    else:
        dropped, kept = x, None
    h = dropped @ a.t()
    y.addmm_(h, b.t(), alpha=s)
    return y, h, None if kept is None else _pack(kept)


def _lora_grads(dy, x, packed, h, b, s: float, p: float, grads: list, i: int):
    """One chunk's A and B gradients of a projection added to grads[i], grads[i + 1]; returns s * dy B (tokens x r)."""
    dh = (dy @ b).mul_(s)
    grads[i + 1].add_(dy.t() @ h, alpha=s)
    grads[i].add_(dh.t() @ (x if packed is None else _dropped(x, packed, _keep_scale(p))))
    return dh


def _input_grad(dy, dh, packed, w, a, p: float):
    """One chunk's gradient of a projection's input: dy W + s (dy B) A, dropped where its input was."""
    dx = dy @ w
    if packed is None:
        return dx.addmm_(dh, a)
    _add_dropped_(dx, dh @ a, packed, _keep_scale(p))
    return dx


def mask_shape(tokens: int, width: int, p: float) -> tuple[int, int]:
    """The shape of one projection's packed dropout mask (pack_mask's bits); empty without dropout."""
    return (tokens, -(-width // 8)) if p > 0 else (0, 0)


def _chunks(tokens: int, chunk: int):
    return [(start, min(start + chunk, tokens)) for start in range(0, tokens, chunk)]


def _define():
    import torch

    def weights(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute):
        """The three 16-bit weights (dequantised once per call, used by every chunk) and the six LoRA matrices in the
        compute dtype."""
        hidden, inter = x.shape[1], gb.shape[0]

        def dequantized(weight, absmax, shape):
            return kernels._dequantize(weight, absmax, (blocksize, quant_type, shape, compute))

        return (dequantized(gw, gabs, (inter, hidden)), dequantized(uw, uabs, (inter, hidden)),
                dequantized(dw, dabs, (hidden, inter)), [t.to(compute) for t in (ga, gb, ua, ub, da, db)])

    def forward(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute, scalings,
                p, chunk):
        tokens, hidden = x.shape
        inter = gb.shape[0]
        gs, us, ds = scalings
        wg, wu, wd, lora = weights(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type,
                                   compute)
        x = x.to(compute)
        out = x.new_empty(tokens, hidden)
        hs = [x.new_empty(tokens, t.shape[0]) for t in (ga, ua, da)]
        masks = [torch.empty(mask_shape(tokens, n, p), dtype=torch.uint8, device=x.device)
                 for n in (hidden, hidden, inter)]
        for start, end in _chunks(tokens, chunk):
            xc = x[start:end]
            g, hs[0][start:end], mg = _project(xc, wg, lora[0], lora[1], gs, p)
            u, hs[1][start:end], mu = _project(xc, wu, lora[2], lora[3], us, p)
            act = _silu_mul(g, u)
            del g, u
            out[start:end], hs[2][start:end], md = _project(act, wd, lora[4], lora[5], ds, p)
            del act
            for packed, bits in zip(masks, (mg, mu, md)):
                if bits is not None:
                    packed[start:end] = bits
        return out, *hs, *masks

    def fake(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute, scalings,
             p, chunk):
        tokens, hidden = x.shape
        inter = gb.shape[0]
        out = x.new_empty(tokens, hidden, dtype=compute)
        hs = [x.new_empty(tokens, t.shape[0], dtype=compute) for t in (ga, ua, da)]
        masks = [x.new_empty(mask_shape(tokens, n, p), dtype=torch.uint8) for n in (hidden, hidden, inter)]
        return out, *hs, *masks

    schema = ("(Tensor x, Tensor gw, Tensor gabs, Tensor ga, Tensor gb, Tensor uw, Tensor uabs, Tensor ua, Tensor ub, "
              "Tensor dw, Tensor dabs, Tensor da, Tensor db, int blocksize, str quant_type, ScalarType compute, "
              "float[] scalings, float p, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    op = torch.library.custom_op("freetune::qlora_mlp", forward, mutates_args=(), schema=schema)
    op.register_fake(fake)

    def backward_impl(dout, x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, hg, hu, hd, mg, mu, md,
                      blocksize, quant_type, compute, scalings, p, chunk, need_x):
        tokens, hidden = x.shape
        gs, us, ds = scalings
        wg, wu, wd, lora = weights(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type,
                                   compute)
        x, dout = x.to(compute), dout.to(compute)
        # LoRA gradients summed over the chunks in fp32 (the adapter's dtype), each chunk's product in the compute
        # dtype.
        grads = [torch.zeros_like(t, dtype=torch.float32) for t in (ga, gb, ua, ub, da, db)]
        dx = x.new_empty(tokens, hidden) if need_x else x.new_empty(0, hidden)
        for start, end in _chunks(tokens, chunk):
            xc, dy = x[start:end], dout[start:end]
            mask_g, mask_u, mask_d = (None if p == 0.0 else m[start:end] for m in (mg, mu, md))
            # g and u again (their A outputs were saved, with the forward's masks)
            g = xc @ wg.t()
            g.addmm_(hg[start:end], lora[1].t(), alpha=gs)
            u = xc @ wu.t()
            u.addmm_(hu[start:end], lora[3].t(), alpha=us)
            act = _silu_mul(g, u)                                 # the down projection's input
            dh = _lora_grads(dy, act, mask_d, hd[start:end], lora[5], ds, p, grads, 4)
            del act
            dact = _input_grad(dy, dh, mask_d, wd, lora[4], p)
            _swiglu_grads_(g, u, dact)                            # g, u := d gate, d up
            del dact
            dh_g = _lora_grads(g, xc, mask_g, hg[start:end], lora[1], gs, p, grads, 0)
            dh_u = _lora_grads(u, xc, mask_u, hu[start:end], lora[3], us, p, grads, 2)
            dxc = _input_grad(g, dh_g, mask_g, wg, lora[0], p)
            dxc.add_(_input_grad(u, dh_u, mask_u, wu, lora[2], p))
            del g, u
            if need_x:
                dx[start:end] = dxc
        return dx, *grads

    def backward_fake(dout, x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, hg, hu, hd, mg, mu, md,
                      blocksize, quant_type, compute, scalings, p, chunk, need_x):
        dx = x.new_empty(x.shape[0] if need_x else 0, x.shape[1], dtype=compute)
        return dx, *(torch.empty_like(t, dtype=torch.float32) for t in (ga, gb, ua, ub, da, db))

    backward_schema = ("(Tensor dout, Tensor x, Tensor gw, Tensor gabs, Tensor ga, Tensor gb, Tensor uw, Tensor uabs, "
                       "Tensor ua, Tensor ub, Tensor dw, Tensor dabs, Tensor da, Tensor db, Tensor hg, Tensor hu, "
                       "Tensor hd, Tensor mg, Tensor mu, Tensor md, int blocksize, str quant_type, ScalarType compute, "
                       "float[] scalings, float p, int chunk, bool need_x) "
                       "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    backward_op = torch.library.custom_op("freetune::qlora_mlp_backward", backward_impl, mutates_args=(),
                                          schema=backward_schema)
    backward_op.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        (x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute, scalings, p,
         chunk) = inputs
        ctx.save_for_backward(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, *output[1:])
        ctx.constants = (blocksize, quant_type, compute, scalings, p, chunk)
        ctx.x_dtype = x.dtype

    def backward(ctx, dout, *_unused):
        saved = ctx.saved_tensors
        need_x = ctx.needs_input_grad[0]
        dx, *grads = backward_op(dout, *saved, *ctx.constants, need_x)
        ga, gb, ua, ub, da, db = saved[3:5] + saved[7:9] + saved[11:13]
        grads = [g.to(t.dtype) for g, t in zip(grads, (ga, gb, ua, ub, da, db))]
        return (dx.to(ctx.x_dtype) if need_x else None, None, None, grads[0], grads[1], None, None, grads[2],
                grads[3], None, None, grads[4], grads[5], None, None, None, None, None, None)

    op.register_autograd(backward, setup_context=setup_context)
    return op


def qlora_mlp(x, projections, dropout_p: float, chunk: int = CHUNK_TOKENS):
    """down(silu(gate(x)) * up(x)) for three fused LoRA layers (kernels.fused_call_args of gate, up, down)."""
    if "op" not in _OP:
        _OP["op"] = _define()
    shape = x.shape
    gate, up, down = projections
    spec = gate["spec"]
    args = [x.reshape(-1, shape[-1])]
    for p in (gate, up, down):
        args += [p["weight"], p["absmax"], p["lora_a"], p["lora_b"]]
    out = _OP["op"](*args, spec[0], spec[1], spec[3], [gate["scaling"], up["scaling"], down["scaling"]],
                    float(dropout_p), int(chunk))[0]
    out = out.reshape(*shape[:-1], out.shape[-1])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _fused_mlp_forward(self, x, *args, **kwargs):
    """Replacement forward of one SwiGLU MLP whose three projections are fused LoRA layers (use_fused_mlp)."""
    projections = [kernels.fused_call_args(getattr(self, name), x) for name in ("gate_proj", "up_proj", "down_proj")]
    ps = {p["dropout_p"] for p in projections if p is not None}
    if args or kwargs or any(p is None for p in projections) or len(ps) != 1:
        return type(self).forward(self, x, *args, **kwargs)
    return qlora_mlp(x, projections, ps.pop(), self._freetune_chunk)


def use_fused_mlp(model, chunk: int = CHUNK_TOKENS) -> tuple[int, int]:
    """Give every SwiGLU MLP of `model` whose gate, up and down projections are fused LoRA layers (run
    kernels.use_fused_lora first) the chunked forward; returns (fused MLPs, MLPs seen). Idempotent; the module's own
    forward takes over for evaluation and anything else the op does not do."""
    fused = seen = 0
    for module in model.modules():
        why = overrides.fusable_mlp(module)
        if why is None:
            continue
        seen += 1
        if why or not all(getattr(getattr(module, n), kernels.FUSED_ATTR, False)
                          for n in ("gate_proj", "up_proj", "down_proj")):
            continue
        module._freetune_chunk = int(chunk)
        if not getattr(module, FUSED_MLP_ATTR, False):
            overrides.replace_forward(module, _fused_mlp_forward)
            setattr(module, FUSED_MLP_ATTR, True)
        fused += 1
    return fused, seen
