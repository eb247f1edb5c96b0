"""A decoder layer's SwiGLU MLP over three fused 4-bit LoRA layers as one unit whose backward recomputes gate and up
instead of keeping them: as one autograd node traced into the compiled layer ("traced"), or as one custom op over token
chunks ("chunked").

Why: under a small memory budget (a 4 GB card, every layer checkpointed) the peak is one layer's recompute and
backward, and there the MLP's intermediate tensors dominate: gate and up outputs, the activation, its gradient and
the gate and up gradients, each tokens x intermediate (5,632 wide for TinyLlama, 3x the hidden size). A compiled layer
with a fused LoRA node per projection kept seven of them alive at the peak (a memory snapshot on the GPU,
docs/performance.md). Both kernels here:

    forward   g = gate(x), u = up(x), a = silu(g) * u, out = down(a)
              saved: x (the layer saves it anyway), each LoRA-A output (tokens x r) and dropout's masks as bits
    backward  g and u recomputed (two more 4-bit matmuls), then the down projection's gradient and the SwiGLU
              derivative written in place over g and u, then the gate and up projections' gradients

The same function as peft's three layers (tests/test_fused_mlp.py: outputs and gradients of every adapter weight and
of the input, with and without dropout).

"traced" (QLoRAMLP, the plan's choice wherever every layer is checkpointed): the compiled layer traces the function
into its graph, so its element-wise work fuses with the layer's and no launch is added beyond the two matmuls (on a
GPU that waits for the host anyway: the same tokens/s as the per-projection MLP, measured). Its backward keeps two
tokens x intermediate tensors (g and u, their LoRA terms added in place) and two chunks of them instead of seven; the
middle of it is one custom op (swiglu_backward_) that mutates g and u, because traced as plain code the compiler fused
and reordered it into kernels that kept five alive (and each addmm_ became a new tensor), and its forward and backward
dequantise from different copies of the absmax values (or of their table) so that common-subexpression elimination
cannot merge the backward's gate and up with the forward's (the partitioner would then save them).

"chunked" (qlora_mlp): the whole MLP as one op over chunks of CHUNK_TOKENS tokens, so that not even g and u exist for
the whole micro-batch; it runs its chunks one after another, dozens of eager launches each, at about half the
tokens/s. The plan takes it only where even one row of max_length would not fit with the traced function
(freetune.choices.choose_mlp_kernel): long rows on a small card, which would else be cut.
"""

from __future__ import annotations

from freetune.distributed import print0
from freetune.reach import transformers as transformers_reach
from freetune.reach.torch import replace_forward, stash, stashed
from freetune.speed import lora_kernel, nf4
from freetune.speed.feature import Feature

# What a fused MLP carries (freetune.reach.torch.stash): that it is fused, its kernel and its chunk of tokens.
FUSED_MLP_ATTR = "_freetune_fused_mlp"
MLP_KERNEL_ATTR = "_freetune_mlp_kernel"
CHUNK_ATTR = "_freetune_chunk"
# The architectures (config.json's model_type) whose MLP class is one of freetune.reach.transformers.SWIGLU_MLPS:
# separate gate, up and down projections with SiLU. The plan takes the fused MLP only for these
# (freetune.choices.mlp_why_not): for any other (Phi-3's fused gate_up_proj, Gemma's GELU, a mixture of experts) it
# would fuse nothing, so it must not count its memory saving either.
MLP_MODEL_TYPES = {"llama": "LlamaMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP", "mistral": "MistralMLP"}
# Tokens per chunk: four chunk-sized tensors of this many tokens x intermediate in the backward (freetune.memory
# counts them); smaller chunks add launches to a step bound by them.
CHUNK_TOKENS = 2048

_OP: dict = {}  # "op": freetune::qlora_mlp, defined once per process


def _keep_scale(p: float) -> float:
    return 1.0 / (1.0 - p)


def _elementwise(kernel: str):
    """`fn` (element-wise work over a chunk) as one Triton kernel launch where it can run one
    (freetune.speed.triton_kernels: `kernel`, on contiguous tensors), as written elsewhere (a CPU). Run op by op it is a
    dozen launches and passes over memory per chunk, which is what a launch-bound step (and a T4's memory bandwidth)
    cannot spare; a torch.compile'd helper, as before, cost a dynamo call per chunk."""
    def wrap(fn):
        def call(*args):
            fast = nf4.triton_for(args[0])
            if fast is not None and fast.contiguous(*(a for a in args if hasattr(a, "is_contiguous"))):
                out = fast.run(kernel, *args)
                if out is not None:
                    return out
            return fn(*args)

        call.__name__ = call.__qualname__ = fn.__name__
        call.__doc__ = fn.__doc__
        call.eager = fn  # the code as written (tests compare the two)
        return call

    return wrap


@_elementwise("pack")
def _pack(kept):
    """dropout's keep-mask as bits (freetune.speed.lora_kernel.pack_mask)."""
    return lora_kernel.pack_mask(kept)


@_elementwise("dropped")
def _dropped(x, packed, scale: float):
    """dropout's output again: x where the packed mask kept it, times 1 / (1 - p)."""
    return x * lora_kernel.unpack_mask(packed, x.shape[-1], x.dtype) * scale


@_elementwise("dropped")
def _add_dropped_(lora, packed, scale: float, dx):
    """dx += lora, dropped where the input was (in place); returns dx."""
    return dx.add_(lora * lora_kernel.unpack_mask(packed, lora.shape[-1], lora.dtype) * scale)


@_elementwise("activation")
def _activation(g, u, packed, scale: float):
    """SwiGLU's activation silu(g) * u, dropped where the packed mask did not keep it (no mask: as it is)."""
    import torch

    act = torch.nn.functional.silu(g) * u
    return act if packed is None else act * lora_kernel.unpack_mask(packed, act.shape[-1], act.dtype) * scale


@_elementwise("swiglu_grads_")
def _swiglu_grads_(g, u, dact):
    """The gradients of silu(g) * u, written over g (d gate) and u (d up): silu'(g) = sig (1 + g (1 - sig)); returns
    g."""
    import torch

    sig = torch.sigmoid(g.float())
    silu = g.float() * sig
    d_up = dact.float() * silu
    d_gate = dact.float() * u.float() * (sig + silu * (1.0 - sig))
    g.copy_(d_gate)
    u.copy_(d_up)
    return g


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
    _add_dropped_(dh @ a, packed, _keep_scale(p), dx)
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
            return nf4._dequantize(weight, absmax, (blocksize, quant_type, shape, compute))

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
            act = _activation(g, u, None, 0.0)
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
            act = _activation(g, u, None, 0.0)                    # the down projection's input
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


def _swiglu_backward_impl(g, u, hg, gb, hu, ub, dy, dh, dw, dabs, dtab, da, md, blocksize: int, quant_type: str,
                          shape: list[int], compute, scalings: list[float], p: float):
    """gate and up completed, then the down projection's A gradient and input gradient and SwiGLU's, for one MLP's
    backward: returns d A of the down projection and leaves d gate in g and d up in u. g and u come as the base
    projections x W^T; their LoRA terms (s h B^T, from the saved A outputs h) are added here, in place: written in the
    compiled graph, each addmm_ became a new tokens x intermediate tensor beside the one it adds to (a memory snapshot
    on the GPU: three of them alive at the MLP's peak). Then a chunk of tokens at a time, so the tensors of tokens x
    intermediate alive at once are g and u and two chunks: the (dropped) activation, for d A, and the activation's
    gradient (dy W + the LoRA term, its dropout mask applied to the product), which dies into d gate and d up."""
    g.addmm_(hg, gb.t(), alpha=scalings[0])
    u.addmm_(hu, ub.t(), alpha=scalings[1])
    scale = 0.0 if md is None else _keep_scale(p)
    w = nf4._dequantize(dw, dabs, (blocksize, quant_type, tuple(shape), compute), dtab)
    grad_da = None
    for start, end in _chunks(g.shape[0], CHUNK_TOKENS):
        mask = None if md is None else md[start:end]
        part = dh[start:end].t() @ _activation(g[start:end], u[start:end], mask, scale)
        grad_da = part if grad_da is None else grad_da.add_(part)
        dact = dy[start:end] @ w
        if mask is None:
            dact.addmm_(dh[start:end], da)
        else:
            _add_dropped_(dh[start:end] @ da, mask, scale, dact)
        _swiglu_grads_(g[start:end], u[start:end], dact)
    return grad_da


_SWIGLU_BACKWARD: dict = {}  # "op": freetune::swiglu_backward_, defined once per process


def _swiglu_backward_op():
    """freetune::swiglu_backward_ (_swiglu_backward_impl): a custom op that mutates g and u, so that the compiled
    graph runs it as written, in place, instead of fusing and reordering its parts."""
    if "op" not in _SWIGLU_BACKWARD:
        import torch

        schema = ("(Tensor(a!) g, Tensor(b!) u, Tensor hg, Tensor gb, Tensor hu, Tensor ub, Tensor dy, Tensor dh, "
                  "Tensor dw, Tensor dabs, Tensor? dtab, Tensor da, Tensor? md, int blocksize, str quant_type, "
                  "int[] shape, ScalarType compute, float[] scalings, float p) -> Tensor")
        op = torch.library.custom_op("freetune::swiglu_backward_", _swiglu_backward_impl, mutates_args=("g", "u"),
                                     schema=schema)
        op.register_fake(lambda g, u, hg, gb, hu, ub, dy, dh, dw, dabs, dtab, da, *rest:
                         torch.empty_like(da, dtype=g.dtype))
        _SWIGLU_BACKWARD["op"] = op
    return _SWIGLU_BACKWARD["op"]


def _traced_function():
    import torch

    def dequantized(packed, absmax, table, spec, copy: bool = False):
        """The 16-bit weight; `copy` dequantises from a fresh copy of the fp32 absmax values (or of their table:
        nf4.quant_args) (x * 1): the traced graph's common-subexpression elimination would otherwise merge the
        backward's dequantisation (and then its matmuls) with the forward's, and the partitioner would save the
        forward's gate and up outputs."""
        if copy and table is None:
            absmax = absmax * 1.0
        elif copy:
            table = table * 1.0
        return nf4._dequantize(packed, absmax, spec, table)

    def masked(t, packed, p: float):
        """t where dropout kept it (its mask saved as bits), times 1 / (1 - p)."""
        return t * lora_kernel.unpack_mask(packed, t.shape[-1], t.dtype) * _keep_scale(p)

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
            compute = specs[0][3]
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).to(compute)
            lora = [t.to(compute) for t in (ga, gb, ua, ub, da, db)]
            hs, masks = [], []

            def project(inp, packed, absmax, table, spec, a, b, s):
                y = torch.nn.functional.linear(inp, dequantized(packed, absmax, table, spec))
                kept = None
                if p > 0.0:
                    dropped, kept = torch.native_dropout(inp, p, True)
                    kept = lora_kernel.pack_mask(kept)
                else:
                    dropped = inp
                h = dropped @ a.t()
                y.addmm_(h, b.t(), alpha=s)
                hs.append(h)
                masks.append(kept)
                return y

            g = project(x2, gw, gabs, gtab, specs[0], lora[0], lora[1], scalings[0])
            u = project(x2, uw, uabs, utab, specs[1], lora[2], lora[3], scalings[1])
            act = torch.nn.functional.silu(g) * u
            del g, u
            out = project(act, dw, dabs, dtab, specs[2], lora[4], lora[5], scalings[2])
            ctx.save_for_backward(x2, *hs, *masks, gw, gabs, gtab, uw, uabs, utab, dw, dabs, dtab, *lora)
            ctx.specs, ctx.scalings, ctx.p = specs, scalings, p
            ctx.x_dtype = x.dtype
            ctx.lora_dtypes = [t.dtype for t in (ga, gb, ua, ub, da, db)]
            out = out.reshape(*shape[:-1], out.shape[-1])
            return out if out.dtype == x.dtype else out.to(x.dtype)

        @staticmethod
        def backward(ctx, dout):
            (x2, hg, hu, hd, mg, mu, md, gw, gabs, gtab, uw, uabs, utab, dw, dabs, dtab, ga, gb, ua, ub, da,
             db) = ctx.saved_tensors
            specs, (gs, us, ds), p = ctx.specs, ctx.scalings, ctx.p
            compute = specs[0][3]
            shape = dout.shape
            dy = dout.reshape(-1, shape[-1]).to(compute)
            # gate and up again (their LoRA terms, from the saved A outputs, added by the op below)
            g = x2 @ dequantized(gw, gabs, gtab, specs[0], copy=True).t()
            u = x2 @ dequantized(uw, uabs, utab, specs[1], copy=True).t()
            # The down projection's gradients and SwiGLU's, in one op that writes d gate and d up over g and u
            # (_swiglu_backward_op): traced, the compiler fused and reordered this part into kernels that kept five
            # or more tokens x intermediate tensors alive at once.
            dh = (dy @ db).mul_(ds)
            grad_db = (dy.t() @ hd).mul_(ds)
            spec = specs[2]
            grad_da = _swiglu_backward_op()(g, u, hg, gb, hu, ub, dy, dh, dw, dabs, dtab, da, md, spec[0], spec[1],
                                            list(spec[2]), spec[3], [gs, us], p)
            d_gate, d_up = g, u
            del g, u
            grads, dx = [], None
            for d, h, mask, a, b, s, packed, absmax, table, spec in (
                    (d_gate, hg, mg, ga, gb, gs, gw, gabs, gtab, specs[0]),
                    (d_up, hu, mu, ua, ub, us, uw, uabs, utab, specs[1])):
                dh = (d @ b).mul_(s)
                grads += [dh.t() @ (x2 if mask is None else masked(x2, mask, p)), (d.t() @ h).mul_(s)]
                part = nf4.times_dequantized(d, packed, absmax, spec, table)
                part = part.addmm_(dh, a) if mask is None else part + masked(dh @ a, mask, p)
                dx = part if dx is None else dx + part
            grads += [grad_da, grad_db]
            grads = [g.to(t) for g, t in zip(grads, ctx.lora_dtypes)]
            dx = dx.reshape(*shape[:-1], dx.shape[-1]).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
            return (dx, *grads, *[None] * 12)

    return QLoRAMLP


_TRACED = None  # the QLoRAMLP class, built once, eagerly (as freetune.speed.lora_kernel's QLoRALinear: dynamo cannot trace a
# class body)


def traced_mlp(x, projections, dropout_p: float):
    """down(silu(gate(x)) * up(x)) for three fused LoRA layers (lora_kernel.fused_call_args of gate, up, down), as one
    autograd.Function that compiled layers trace into their graph."""
    fn = _traced_class()
    gate, up, down = projections
    return fn.apply(x, gate["lora_a"], gate["lora_b"], up["lora_a"], up["lora_b"], down["lora_a"], down["lora_b"],
                    gate["weight"], gate["absmax"], gate["table"], up["weight"], up["absmax"], up["table"],
                    down["weight"], down["absmax"], down["table"],
                    (gate["spec"], up["spec"], down["spec"]), (gate["scaling"], up["scaling"], down["scaling"]),
                    float(dropout_p))


def _traced_class():
    """The QLoRAMLP class and the op its backward calls, made once, eagerly (dynamo cannot trace either's making)."""
    global _TRACED
    if _TRACED is None:
        _swiglu_backward_op()
        nf4._dequantized_mm_op()
        _TRACED = _traced_function()
    return _TRACED


def qlora_mlp(x, projections, dropout_p: float, chunk: int = CHUNK_TOKENS):
    """down(silu(gate(x)) * up(x)) for three fused LoRA layers (lora_kernel.fused_call_args of gate, up, down)."""
    if "op" not in _OP:
        _OP["op"] = _define()
    shape = x.shape
    gate, up, down = projections
    spec = gate["spec"]
    args = [x.reshape(-1, shape[-1])]
    for p in (gate, up, down):
        # The op takes fp32 absmax values: 8-bit ones (nf4.quant_args) are decoded for the call.
        absmax = p["absmax"] if p["table"] is None else nf4.decoded_absmax(p["absmax"], p["table"])
        args += [p["weight"], absmax, p["lora_a"], p["lora_b"]]
    out = _OP["op"](*args, spec[0], spec[1], spec[3], [gate["scaling"], up["scaling"], down["scaling"]],
                    float(dropout_p), int(chunk))[0]
    out = out.reshape(*shape[:-1], out.shape[-1])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def _fused_mlp_forward(self, x, *args, **kwargs):
    """Replacement forward of one SwiGLU MLP whose three projections are fused LoRA layers (use_fused_mlp)."""
    projections = [lora_kernel.fused_call_args(getattr(self, name), x) for name in ("gate_proj", "up_proj", "down_proj")]
    ps = {p["dropout_p"] for p in projections if p is not None}
    if args or kwargs or any(p is None for p in projections) or len(ps) != 1:
        return type(self).forward(self, x, *args, **kwargs)
    if stashed(self, MLP_KERNEL_ATTR) == "traced":
        return traced_mlp(x, projections, ps.pop())
    return qlora_mlp(x, projections, ps.pop(), stashed(self, CHUNK_ATTR))


def use_fused_mlp(model, chunk: int = CHUNK_TOKENS, kernel: str = "chunked") -> tuple[int, int]:
    """Give every SwiGLU MLP of `model` whose gate, up and down projections are fused LoRA layers (run
    lora_kernel.use_fused_lora first) the fused forward: kernel "traced" (QLoRAMLP) or "chunked" (qlora_mlp, in chunks of
    `chunk` tokens); returns (fused MLPs, MLPs seen). Idempotent; the module's own forward takes over for evaluation
    and anything else the fused one does not do."""
    fused = seen = 0
    for module in model.modules():
        why = transformers_reach.fusable_mlp(module)
        if why is None:
            continue
        seen += 1
        if why or not all(stashed(getattr(module, n), lora_kernel.FUSED_ATTR, False)
                          for n in ("gate_proj", "up_proj", "down_proj")):
            continue
        if kernel not in ("chunked", "traced"):
            raise ValueError(f"MLP kernel {kernel!r}: 'chunked' or 'traced'")
        stash(module, CHUNK_ATTR, int(chunk))
        stash(module, MLP_KERNEL_ATTR, kernel)
        if kernel == "traced":
            _traced_class()  # now, eagerly: the compiled layers only read it
        if not stashed(module, FUSED_MLP_ATTR, False):
            replace_forward(module, _fused_mlp_forward)
            stash(module, FUSED_MLP_ATTR, True)
        fused += 1
    return fused, seen


def _applies(plan, trainer) -> tuple[bool, str]:
    return plan.mlp_kernel in ("chunked", "traced"), ""


def _install(trainer, plan) -> None:
    fused, seen = use_fused_mlp(trainer.model, kernel=plan.mlp_kernel)
    how = (f"in chunks of {CHUNK_TOKENS} tokens" if plan.mlp_kernel == "chunked"
           else "as one node each, gate and up recomputed in the backward")
    print0(f"MLP kernel: {fused} of {seen} MLPs {how} (freetune.speed.mlp).")


FEATURE = Feature("MLP kernel", _applies, _install)
