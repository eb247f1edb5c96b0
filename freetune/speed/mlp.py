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
cannot merge the backward's gate and up with the forward's (the partitioner would then save them). Under freetune's
own checkpoint (the CUDA graphs' layers, freetune.speed.layer_graphs) the recompute's output is thrown away, and
there the node computes only the LoRA-A outputs its backward reads (freetune.speed.recompute): 3 + 5 base-weight
matmuls per layer and step instead of 3 + 3 + 5 (issue 49: +11% tokens/s on Qwen2.5-1.5B's long rows,
docs/performance.md).

"chunked" (qlora_mlp): the whole MLP as one op over chunks of CHUNK_TOKENS tokens, so that not even g and u exist for
the whole micro-batch; it runs its chunks one after another, dozens of eager launches each, at about half the
tokens/s. The plan takes it only where even one row of max_length would not fit with the traced function
(freetune.plan.sizing.choose_mlp_kernel): long rows on a small card, which would else be cut.
"""

from __future__ import annotations

from freetune.distributed import print0
from freetune.reach import transformers as transformers_reach
from freetune.reach.torch import replace_forward, stash, stashed
from freetune.speed import lora_kernel, mlp_ops, nf4
from freetune.speed.feature import Feature
from freetune.speed.mlp_ops import CHUNK_TOKENS
from freetune.speed.mlp_traced import traced_class, traced_mlp

# What a fused MLP carries (freetune.reach.torch.stash): that it is fused, its kernel and its chunk of tokens.
FUSED_MLP_ATTR = "_freetune_fused_mlp"
MLP_KERNEL_ATTR = "_freetune_mlp_kernel"
CHUNK_ATTR = "_freetune_chunk"
# The architectures (config.json's model_type) whose MLP class is one of freetune.reach.transformers.SWIGLU_MLPS:
# separate gate, up and down projections with SiLU. The plan takes the fused MLP only for these
# (freetune.plan.decisions.mlp_why_not): for any other (Phi-3's fused gate_up_proj, Gemma's GELU, a mixture of experts) it
# would fuse nothing, so it must not count its memory saving either.
MLP_MODEL_TYPES = {"llama": "LlamaMLP", "qwen2": "Qwen2MLP", "qwen3": "Qwen3MLP", "mistral": "MistralMLP"}
_OP: dict = {}  # "op": freetune::qlora_mlp, defined once per process

def _define():
    """freetune::qlora_mlp and its backward op, with the autograd that joins them (made once: qlora_mlp)."""
    import torch

    schema = ("(Tensor x, Tensor gw, Tensor gabs, Tensor ga, Tensor gb, Tensor uw, Tensor uabs, Tensor ua, Tensor ub, "
              "Tensor dw, Tensor dabs, Tensor da, Tensor db, int blocksize, str quant_type, ScalarType compute, "
              "float[] scalings, float p, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    op = torch.library.custom_op("freetune::qlora_mlp", _forward, mutates_args=(), schema=schema)
    op.register_fake(_fake)

    backward_schema = ("(Tensor dout, Tensor x, Tensor gw, Tensor gabs, Tensor ga, Tensor gb, Tensor uw, Tensor uabs, "
                       "Tensor ua, Tensor ub, Tensor dw, Tensor dabs, Tensor da, Tensor db, Tensor hg, Tensor hu, "
                       "Tensor hd, Tensor mg, Tensor mu, Tensor md, int blocksize, str quant_type, ScalarType compute, "
                       "float[] scalings, float p, int chunk, bool need_x) "
                       "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)")
    backward_op = torch.library.custom_op("freetune::qlora_mlp_backward", _backward_impl, mutates_args=(),
                                          schema=backward_schema)
    backward_op.register_fake(_backward_fake)
    _OP["backward"] = backward_op  # what _backward calls

    op.register_autograd(_backward, setup_context=_setup_context)
    return op


def _weights(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute):
    """The three 16-bit weights (dequantised once per call, used by every chunk) and the six LoRA matrices in the
    compute dtype."""
    hidden, inter = x.shape[1], gb.shape[0]

    def dequantized(weight, absmax, shape):
        return nf4._dequantize(weight, absmax, (blocksize, quant_type, shape, compute))

    return (dequantized(gw, gabs, (inter, hidden)), dequantized(uw, uabs, (inter, hidden)),
            dequantized(dw, dabs, (hidden, inter)), [t.to(compute) for t in (ga, gb, ua, ub, da, db)])


def _forward(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute, scalings,
            p, chunk):
    import torch

    tokens, hidden = x.shape
    inter = gb.shape[0]
    gs, us, ds = scalings
    wg, wu, wd, lora = _weights(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type,
                               compute)
    x = x.to(compute)
    out = x.new_empty(tokens, hidden)
    hs = [x.new_empty(tokens, t.shape[0]) for t in (ga, ua, da)]
    masks = [torch.empty(mlp_ops.mask_shape(tokens, n, p), dtype=torch.uint8, device=x.device)
             for n in (hidden, hidden, inter)]
    for start, end in mlp_ops._chunks(tokens, chunk):
        xc = x[start:end]
        g, hs[0][start:end], mg = mlp_ops._project(xc, wg, lora[0], lora[1], gs, p)
        u, hs[1][start:end], mu = mlp_ops._project(xc, wu, lora[2], lora[3], us, p)
        act = mlp_ops._activation(g, u, None, 0.0)
        del g, u
        out[start:end], hs[2][start:end], md = mlp_ops._project(act, wd, lora[4], lora[5], ds, p)
        del act
        for packed, bits in zip(masks, (mg, mu, md)):
            if bits is not None:
                packed[start:end] = bits
    return out, *hs, *masks


def _fake(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute, scalings,
         p, chunk):
    import torch

    tokens, hidden = x.shape
    inter = gb.shape[0]
    out = x.new_empty(tokens, hidden, dtype=compute)
    hs = [x.new_empty(tokens, t.shape[0], dtype=compute) for t in (ga, ua, da)]
    masks = [x.new_empty(mlp_ops.mask_shape(tokens, n, p), dtype=torch.uint8) for n in (hidden, hidden, inter)]
    return out, *hs, *masks


def _backward_impl(dout, x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, hg, hu, hd, mg, mu, md,
                  blocksize, quant_type, compute, scalings, p, chunk, need_x):
    import torch

    tokens, hidden = x.shape
    gs, us, ds = scalings
    wg, wu, wd, lora = _weights(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type,
                               compute)
    x, dout = x.to(compute), dout.to(compute)
    # LoRA gradients summed over the chunks in fp32 (the adapter's dtype), each chunk's product in the compute
    # dtype.
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in (ga, gb, ua, ub, da, db)]
    dx = x.new_empty(tokens, hidden) if need_x else x.new_empty(0, hidden)
    for start, end in mlp_ops._chunks(tokens, chunk):
        xc, dy = x[start:end], dout[start:end]
        mask_g, mask_u, mask_d = (None if p == 0.0 else m[start:end] for m in (mg, mu, md))
        # g and u again (their A outputs were saved, with the forward's masks)
        g = xc @ wg.t()
        g.addmm_(hg[start:end], lora[1].t(), alpha=gs)
        u = xc @ wu.t()
        u.addmm_(hu[start:end], lora[3].t(), alpha=us)
        act = mlp_ops._activation(g, u, None, 0.0)                    # the down projection's input
        dh = mlp_ops._lora_grads(dy, act, mask_d, hd[start:end], lora[5], ds, p, grads, 4)
        del act
        dact = mlp_ops._input_grad(dy, dh, mask_d, wd, lora[4], p)
        mlp_ops._swiglu_grads_(g, u, dact)                            # g, u := d gate, d up
        del dact
        dh_g = mlp_ops._lora_grads(g, xc, mask_g, hg[start:end], lora[1], gs, p, grads, 0)
        dh_u = mlp_ops._lora_grads(u, xc, mask_u, hu[start:end], lora[3], us, p, grads, 2)
        dxc = mlp_ops._input_grad(g, dh_g, mask_g, wg, lora[0], p)
        dxc.add_(mlp_ops._input_grad(u, dh_u, mask_u, wu, lora[2], p))
        del g, u
        if need_x:
            dx[start:end] = dxc
    return dx, *grads


def _backward_fake(dout, x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, hg, hu, hd, mg, mu, md,
                  blocksize, quant_type, compute, scalings, p, chunk, need_x):
    import torch

    dx = x.new_empty(x.shape[0] if need_x else 0, x.shape[1], dtype=compute)
    return dx, *(torch.empty_like(t, dtype=torch.float32) for t in (ga, gb, ua, ub, da, db))


def _setup_context(ctx, inputs, output):
    (x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, blocksize, quant_type, compute, scalings, p,
     chunk) = inputs
    ctx.save_for_backward(x, gw, gabs, ga, gb, uw, uabs, ua, ub, dw, dabs, da, db, *output[1:])
    ctx.constants = (blocksize, quant_type, compute, scalings, p, chunk)
    ctx.x_dtype = x.dtype


def _backward(ctx, dout, *_unused):
    saved = ctx.saved_tensors
    need_x = ctx.needs_input_grad[0]
    dx, *grads = _OP["backward"](dout, *saved, *ctx.constants, need_x)
    ga, gb, ua, ub, da, db = saved[3:5] + saved[7:9] + saved[11:13]
    grads = [g.to(t.dtype) for g, t in zip(grads, (ga, gb, ua, ub, da, db))]
    return (dx.to(ctx.x_dtype) if need_x else None, None, None, grads[0], grads[1], None, None, grads[2],
            grads[3], None, None, grads[4], grads[5], None, None, None, None, None, None)


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
    projections = [lora_kernel.fused_call_args(getattr(self, name), x)
                   for name in ("gate_proj", "up_proj", "down_proj")]
    ps = {p["dropout_p"] for p in projections if p is not None}
    if args or kwargs or any(p is None for p in projections) or len(ps) != 1:
        return type(self).forward(self, x, *args, **kwargs)
    if stashed(self, MLP_KERNEL_ATTR) == "traced":
        return traced_mlp(x, projections, ps.pop())
    return qlora_mlp(x, projections, ps.pop(), stashed(self, CHUNK_ATTR))


def use_fused_mlp(model, chunk: int = CHUNK_TOKENS, kernel: str = "chunked") -> tuple[int, int]:
    """Give every SwiGLU MLP of `model` whose gate, up and down projections are fused LoRA layers (run
    lora_kernel.use_fused_lora first) the fused forward: kernel "traced" (QLoRAMLP) or "chunked" (qlora_mlp, in chunks
    of `chunk` tokens); returns (fused MLPs, MLPs seen). Idempotent; the module's own forward takes over for evaluation
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
            traced_class()  # now, eagerly: the compiled layers only read it
        if not stashed(module, FUSED_MLP_ATTR, False):
            replace_forward(module, _fused_mlp_forward)
            stash(module, FUSED_MLP_ATTR, True)
        fused += 1
    return fused, seen


def _applies(plan, trainer) -> tuple[bool, str]:
    return plan.kernels.mlp in ("chunked", "traced"), ""


def _install(trainer, plan) -> None:
    fused, seen = use_fused_mlp(trainer.model, kernel=plan.kernels.mlp)
    how = (f"in chunks of {CHUNK_TOKENS} tokens" if plan.kernels.mlp == "chunked"
           else "as one node each, gate and up recomputed in the backward")
    print0(f"MLP kernel: {fused} of {seen} MLPs {how} (freetune.speed.mlp).")


FEATURE = Feature("MLP kernel", _applies, _install)
