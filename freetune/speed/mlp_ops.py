"""The fused MLP's element-wise parts (dropout, SwiGLU and their gradients: one Triton launch each on a GPU where
Triton is, freetune.speed.triton_kernels; as written elsewhere) and the backward op both MLP kernels share
(freetune::swiglu_backward_), for freetune.speed.mlp (chunked) and freetune.speed.mlp_traced (traced).
"""

from __future__ import annotations

from freetune.speed import lora_kernel, nf4

# Tokens per chunk: four chunk-sized tensors of this many tokens x intermediate in the backward (freetune.plan.memory
# counts them); smaller chunks add launches to a step bound by them.
CHUNK_TOKENS = 2048


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


def _swiglu_backward_impl(g, u, hg, gb, hu, ub, dy, dh, dw, dabs, dtab, da, md, hd, blocksize: int, quant_type: str,
                          shape: list[int], compute, scalings: list[float], p: float):
    """gate and up completed, then the down projection's A gradient and input gradient and SwiGLU's, for one MLP's
    backward: returns d A and d B of the down projection and leaves d gate in g and d up in u. d B reads the down
    projection's A output hd where the forward saved it; where it is None (a recompute that skipped the MLP's output,
    freetune.speed.recompute), each chunk's activation times A^T, the product the forward would have saved. g and u
    come as the base projections x W^T; their LoRA terms (s h B^T, from the saved A outputs h) are added here, in
    place: written in the compiled graph, each addmm_ became a new tokens x intermediate tensor beside the one it adds
    to (a memory snapshot on the GPU: three of them alive at the MLP's peak). Then a chunk of tokens at a time, so the
    tensors of tokens x intermediate alive at once are g and u and two chunks: the (dropped) activation, for d A, and
    the activation's gradient (dy W + the LoRA term, its dropout mask applied to the product), which dies into d gate
    and d up."""
    g.addmm_(hg, gb.t(), alpha=scalings[0])
    u.addmm_(hu, ub.t(), alpha=scalings[1])
    scale = 0.0 if md is None else _keep_scale(p)
    w = nf4._dequantize(dw, dabs, (blocksize, quant_type, tuple(shape), compute), dtab)
    grad_da = grad_db = None
    if hd is not None:
        grad_db = (dy.t() @ hd).mul_(scalings[2])
    for start, end in _chunks(g.shape[0], CHUNK_TOKENS):
        mask = None if md is None else md[start:end]
        act = _activation(g[start:end], u[start:end], mask, scale)
        part = dh[start:end].t() @ act
        grad_da = part if grad_da is None else grad_da.add_(part)
        if hd is None:
            part = dy[start:end].t() @ (act @ da.t())
            grad_db = part if grad_db is None else grad_db.add_(part)
        del act
        dact = dy[start:end] @ w
        if mask is None:
            dact.addmm_(dh[start:end], da)
        else:
            _add_dropped_(dh[start:end] @ da, mask, scale, dact)
        _swiglu_grads_(g[start:end], u[start:end], dact)
    if hd is None:
        grad_db.mul_(scalings[2])
    return grad_da, grad_db


_SWIGLU_BACKWARD: dict = {}  # "op": freetune::swiglu_backward_, defined once per process


def _swiglu_backward_op():
    """freetune::swiglu_backward_ (_swiglu_backward_impl): a custom op that mutates g and u, so that the compiled
    graph runs it as written, in place, instead of fusing and reordering its parts."""
    if "op" not in _SWIGLU_BACKWARD:
        import torch

        schema = ("(Tensor(a!) g, Tensor(b!) u, Tensor hg, Tensor gb, Tensor hu, Tensor ub, Tensor dy, Tensor dh, "
                  "Tensor dw, Tensor dabs, Tensor? dtab, Tensor da, Tensor? md, Tensor? hd, int blocksize, "
                  "str quant_type, int[] shape, ScalarType compute, float[] scalings, float p) -> (Tensor, Tensor)")
        op = torch.library.custom_op("freetune::swiglu_backward_", _swiglu_backward_impl, mutates_args=("g", "u"),
                                     schema=schema)
        op.register_fake(lambda g, u, hg, gb, hu, ub, dy, dh, dw, dabs, dtab, da, *rest:
                         (torch.empty_like(da, dtype=g.dtype), dy.new_empty(dy.shape[1], da.shape[0])))
        _SWIGLU_BACKWARD["op"] = op
    return _SWIGLU_BACKWARD["op"]
