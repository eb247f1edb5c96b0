"""One autograd node per LoRA-wrapped 4-bit linear layer: the QLoRA forward and backward with fewer launches.

Why: a QLoRA step on a small model is bound by the host, not the GPU. peft's LoRA layer over a bitsandbytes
Linear4bit runs, per projection and micro-batch, bitsandbytes' own autograd function, a defensive clone, the
dropout module, two nn.Linear calls (each with autocast's casts), a multiply and an add: ~25 ATen calls and
~10 autograd nodes forward, as many backward. A 28-layer model has 196 such projections, so a forward and
backward costs ~35,000 ATen calls (counted with torch.profiler on a CPU); at a few microseconds of Python and
dispatch each, the GPU waits. `QLoRALinear` computes the same thing in one autograd.Function:

    forward   y = x W^T (+ bias) + s * ((dropout(x) A^T) B^T)        W = dequantize(NF4 weight)
    backward  dx = dy W + s * mask * ((dy B) A)                       (mask: dropout's, scaled by 1/(1-p))
              dA = s * (dy B)^T dropout(x),  dB = s * dy^T (dropout(x) A^T)

with W dequantized again in the backward (as bitsandbytes does: nothing of the 16-bit weight is kept), the
small LoRA products in the compute dtype, and the LoRA gradients returned in the adapter's dtype (fp32,
see freetune.model.adapter_dtype_guard). It is the same function as peft's: tests/test_kernels.py compares
outputs and gradients with peft's layer on the same weights and inputs.

Where it applies (`use_fused_lora`): plain LoRA (no DoRA or other variant), one active adapter, not merged,
a bitsandbytes Linear4bit base with its quantisation state, not under FSDP (which flattens the weight).
Any other layer keeps peft's forward. Dropout draws its mask with torch.native_dropout, the kernel that
nn.Dropout itself runs on a GPU; on a CPU nn.Dropout draws another way, so a CPU run keeps peft's path by
default (the plan's choice), and its losses match the plain stack's draw for draw.
"""

from __future__ import annotations

from freetune.distributed import print0
from freetune.reach import peft_bnb as peft_bnb_reach
# Which layers qualify reads peft's and bitsandbytes' internals: freetune.reach.peft_bnb.fusable.
from freetune.reach.peft_bnb import fusable
from freetune.reach.torch import foreach_copy_, mark_static, replace_forward, stash, stashed, unstash
from freetune.speed import dropout, nf4
from freetune.speed.feature import Feature

# What a fused layer carries (freetune.reach.torch.stash): that it is fused; the packed 4-bit weight as a plain tensor
# and its quantisation state as quant_args gives them (absmax values, their table, the spec).
FUSED_ATTR = "_freetune_fused_lora"
PACKED_ATTR = "_freetune_packed"
ABSMAX_ATTR = "_freetune_absmax"
ABSMAX_TABLE_ATTR = "_freetune_absmax_table"
SPEC_ATTR = "_freetune_spec"
# On a fused layer during one training forward and its backward: its LoRA (A, B) already in the compute dtype
# (cast_adapters_once_per_forward).
ADAPTER_16BIT_ATTR = "_freetune_lora_16bit"
# On the model while its fused layers' LoRA weights are cast once per forward (FEATURE; CUDA graphs need it).
CAST_ONCE_ATTR = "_freetune_cast_once"



def pack_mask(kept):
    """Dropout's keep-mask (tokens, n) as bits: (tokens, ceil(n / 8)) uint8, 1 bit per element instead of a byte.

    Every LoRA projection draws its own mask and the fused layer saves each one for its backward: as bytes they were a
    quarter of a compiled layer's saved activations (seven masks, the MLP's intermediate one the widest; a memory
    snapshot at the peak on a GPU, docs/performance.md). Used inside compiled layers, where it fuses into the dropout
    kernel."""
    import torch

    tokens, n = kept.shape
    pad = -n % 8
    bits = kept.to(torch.uint8)
    if pad:
        bits = torch.nn.functional.pad(bits, (0, pad))
    # The bit weights made on the device (arange), not copied there from a Python list: outside a compiled graph that
    # copy waits for the GPU (freetune.speed.mlp packs eagerly, several times per layer).
    shifts = torch.arange(8, dtype=torch.uint8, device=kept.device)
    return bits.view(tokens, -1, 8).bitwise_left_shift(shifts).sum(-1, dtype=torch.uint8)


def unpack_mask(packed, n: int, dtype):
    """pack_mask's bits back as a 0/1 mask of `dtype`, (tokens, n)."""
    import torch

    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = packed.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and_(1)
    return bits.view(packed.shape[0], -1)[:, :n].to(dtype)


# Where compiled layers write a LoRA sum as a product and an add (plus_product), by phase; the backward's stay in place
# through freetune::add_product_ (as fast and 0.14 GiB lower than out of place on the T4 long rows, issue 49).
# scripts/bench_experiments.py's addmm_sums and out_of_place_backward_sums replace this dict.
_OUT_OF_PLACE_SUMS = {"forward": True, "backward": False}


# Whether compiled layers add an in-place LoRA sum through freetune::add_product_ (on) or through a traced addmm_ (off:
# bench's experiment traced_addmm, which measures the copy that the op takes away).
_IN_PLACE_SUMS = {"op": True}
_ADD_PRODUCT: dict = {}  # "op": freetune::add_product_, defined once per process


def _add_product_op():
    """freetune::add_product_: y += alpha * (m1 @ m2) in place (y.addmm_), as a custom op that mutates y.

    Why: traced, an in-place addmm_ is functionalised into an out-of-place addmm whose cuBLAS call copies y into a new
    buffer first. A custom op that declares its mutation is put back in place by inductor's reinplacing pass wherever y
    dies there (a projection's fresh output or input gradient): one kernel, no copy, no new tensor. Made eagerly, with
    the fused layer's function (dynamo cannot trace its making)."""
    if "op" not in _ADD_PRODUCT:
        import torch

        def impl(y, m1, m2, alpha: float) -> None:
            y.addmm_(m1, m2, alpha=alpha)

        op = torch.library.custom_op("freetune::add_product_", impl, mutates_args=("y",),
                                     schema="(Tensor(a!) y, Tensor m1, Tensor m2, float alpha) -> ()")
        op.register_fake(lambda y, m1, m2, alpha: None)
        _ADD_PRODUCT["op"] = op
    return _ADD_PRODUCT["op"]


def plus_product(y, m1, m2, alpha: float = 1.0, phase: str = "forward", widening: bool = False):
    """y + alpha * (m1 @ m2): a fused layer's LoRA term (s h B^T) added to its base product, or (s dy B) A to its input
    gradient without dropout. m1 is thin (tokens x r): a small matmul with a wide output.

    Eager, in place (`addmm_`): one kernel, no new tensor. Traced into compiled layers, an in-place addmm_ becomes an
    out-of-place `addmm` into a new buffer, which cuBLAS fills with a copy of y first (a device-to-device copy of the
    projection's output per forward, and of its input gradient per backward). Two ways round it: written as a product
    and an add, inductor leaves the two unfused on a GPU where every user of the sum is element-wise and fuses the add
    into that user (the LoRA product is rounded once more, as in peft's own layer; where a user is not element-wise it
    makes the same addmm); kept in place, the sum goes through freetune::add_product_ (_add_product_op), which inductor
    runs on y's own buffer. The backward's sums stay in place: out of place, its products stayed alive until the
    add's user ran, 0.13-0.14 GiB more for no kernel time (_OUT_OF_PLACE_SUMS; docs/performance.md, issue 49).
    `widening` (an output wider than the input: the traced MLP's gate and up; the fused layer's are one product,
    base_plus_lora) keeps the sum in place: their one user reads both, and the unfused sums would hold two more
    tokens x intermediate tensors until it runs.
    `* alpha`, not torch.add's alpha=: inductor's mm-plus-add pattern drops an add's alpha (torch 2.10-2.13 on a CPU:
    a wrong sum)."""
    import torch

    if not torch.compiler.is_compiling():
        return y.addmm_(m1, m2, alpha=alpha)
    if widening or not _OUT_OF_PLACE_SUMS[phase]:
        if _IN_PLACE_SUMS["op"]:
            _add_product_op()(y, m1, m2, float(alpha))
            return y
        return y.addmm_(m1, m2, alpha=alpha)
    product = m1 @ m2
    return y + (product if alpha == 1.0 else product * alpha)


# Whether a compiled widening projection computes x W^T + s h B^T as one product (base_plus_lora); off: bench's
# experiment widening_addmm.
_ONE_PRODUCT = {"widening": True}


def base_plus_lora(x, w, bias, h, b, scaling: float):
    """x W^T (+ bias) + s * h B^T: a fused layer's output from its input x (tokens, in), its 16-bit weight w (out, in),
    its LoRA-A output h (tokens, r) and B (out, r).

    Traced into a compiled layer, a widening projection (out > in: an MLP's gate and up, 4-6 times wider than their
    input) makes it one product, [x | h] [W | s B]^T: the LoRA sum was a pass over the projection's whole output
    (tokens x out values read and written again; issue 49 in docs/performance.md), the join is one tokens x (in + r)
    write, and the weight's dequantisation writes into the joined weight (inductor fuses the two). Only where in + r
    keeps the rows 16-byte aligned (tensor cores' fast path). Elsewhere (eager, narrower outputs): the product and
    plus_product's sum. The one product rounds once where the sum rounded the base product first."""
    import torch

    widening = w.shape[0] > x.shape[-1]
    if (widening and _ONE_PRODUCT["widening"] and torch.compiler.is_compiling()
            and (x.shape[-1] + h.shape[-1]) * x.element_size() % 16 == 0):
        return torch.nn.functional.linear(torch.cat([x, h], dim=1), torch.cat([w, b * scaling], dim=1), bias)
    return plus_product(torch.nn.functional.linear(x, w, bias), h, b.t(), scaling, widening=widening)


def _function():
    import torch

    class QLoRALinear(torch.autograd.Function):
        @staticmethod
        # x, A and B (the inputs a gradient can flow to) first, then the frozen 4-bit weight, its absmax values
        # (and their table: quant_args) and the constants.
        def forward(ctx, x, lora_a, lora_b, weight, absmax, table, bias, spec, scaling: float, dropout_p: float):
            compute = spec[3]
            out_dtype = x.dtype  # bitsandbytes' Linear4bit returns its input's dtype; so does this
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).to(compute)
            a, b = lora_a.to(compute), lora_b.to(compute)
            mask = None
            if dropout_p > 0.0 and torch.compiler.is_compiling():
                # The mask packed as bits for the backward (freetune.speed.dropout: one kernel that draws, packs and
                # multiplies by A; inductor's draws under bench's dropout_inductor)
                h, mask = dropout.lora_a_of_dropped(x2, a, dropout_p)
            else:
                xd = x2
                if dropout_p > 0.0:
                    # An eager layer keeps torch's dropout and its bool mask (packing would add a dozen launches
                    # per projection to a launch-bound step).
                    xd, mask = torch.native_dropout(x2, dropout_p, True)
                h = xd @ a.t()                               # (tokens, r)
            y = base_plus_lora(x2, nf4._dequantize(weight, absmax, spec, table),
                               None if bias is None else bias.to(compute), h, b, scaling)   # x W^T + s * h B^T
            # The input, not its dropped copy, is saved (with the mask): q, k, v (and gate, up)
            # read the same input, which is then kept once for all of them instead of one 16-bit copy per
            # projection; the backward drops it again. Under checkpointing that is the largest part of a layer's
            # recompute memory.
            ctx.save_for_backward(weight, absmax, table, x2, mask, h, a, b)
            ctx.spec = spec
            ctx.scaling, ctx.dropout_p = scaling, dropout_p
            ctx.x_dtype, ctx.a_dtype, ctx.b_dtype = x.dtype, lora_a.dtype, lora_b.dtype
            y = y.reshape(*shape[:-1], y.shape[-1])
            # Cast only when the dtypes differ: traced by dynamo (torch 2.11), returning the no-op y.to(y.dtype), an
            # alias of y, left every LoRA weight with a zero gradient (tests/test_kernels.py, torch 2.11 on a CPU).
            return y if y.dtype == out_dtype else y.to(out_dtype)

        @staticmethod
        def backward(ctx, dy):
            weight, absmax, table, x2, mask, h, a, b = ctx.saved_tensors
            # A compiled layer's mask is bits (dropout.lora_a_of_dropped), which the backward's two dropout terms read
            # as they are (freetune.speed.dropout's kernels); an eager layer's is torch's bool mask.
            bits = mask is not None and mask.dtype == torch.uint8
            if mask is not None and not bits:
                mask = mask.to(x2.dtype)
            s = ctx.scaling
            compute = ctx.spec[3]
            shape = dy.shape
            dy2 = dy.reshape(-1, shape[-1]).to(compute)
            grad_x = grad_a = grad_b = None
            dh = (dy2 @ b).mul_(s)                           # (tokens, r): s * dy B
            if ctx.needs_input_grad[2]:
                grad_b = (dy2.t() @ h).mul_(s).to(ctx.b_dtype)
            if ctx.needs_input_grad[1]:
                if bits:
                    grad_a = dropout.lora_a_grad_of_dropped(dh, x2, mask, ctx.dropout_p).to(ctx.a_dtype)
                else:
                    # native_dropout's own output, recomputed: input x mask x 1/(1-p)
                    xd = x2 if mask is None else x2 * mask * (1.0 / (1.0 - ctx.dropout_p))
                    grad_a = (dh.t() @ xd).to(ctx.a_dtype)
                    del xd
            if ctx.needs_input_grad[0]:
                grad_x = nf4.times_dequantized(dy2, weight, absmax, ctx.spec, table)
                if mask is None:
                    grad_x = plus_product(grad_x, dh, a, phase="backward")
                elif bits:
                    grad_x = dropout.add_dropped_lora_grad_(grad_x, dh, a, mask, ctx.dropout_p)
                else:
                    grad_x.add_((dh @ a).mul_(mask).mul_(1.0 / (1.0 - ctx.dropout_p)))
                grad_x = grad_x.reshape(*shape[:-1], grad_x.shape[-1]).to(ctx.x_dtype)
            return grad_x, grad_a, grad_b, None, None, None, None, None, None, None

    return QLoRALinear


_FN = None  # the QLoRALinear class, built once by _fused_function


def _fused_function():
    """The autograd.Function class, built once, eagerly (use_fused_lora): dynamo cannot trace a class body, and the
    compiled decoder layers then trace its forward and backward into their graphs (one graph per layer, no break:
    plain tensors in, bitsandbytes' registered ops inside). Kept out of the graph instead (torch.compiler.disable),
    each layer fell into 8 compiled pieces with 7 eager calls between them: 5,300 tokens/s and 41 GiB on an H200,
    the plain stack's speed and memory (reports/gpu/bench_breaks_fn_disabled.json)."""
    global _FN
    if _FN is None:
        nf4._dequantized_mm_op()
        _add_product_op()
        dropout.make_ops()
        _FN = _function()
    return _FN


def qlora_linear(x, weight, absmax, spec, bias, lora_a, lora_b, scaling: float, dropout_p: float, table=None):
    """y = base(x) + scaling * lora_b(lora_a(dropout(x))) for a 4-bit base weight, as one autograd node.

    weight: the packed 4-bit data as a plain tensor (Params4bit.data, see use_fused_lora), not bitsandbytes'
    Params4bit itself; absmax, table, spec: its quantisation state as `quant_args` gives it."""
    # `_FN is None`, not `_FN or ...`: dynamo (torch 2.11) cannot take the truth value of an autograd.Function
    # class and broke the graph here ("data-dependent branching"), so every decoder layer ran in eager pieces.
    fn = _fused_function() if _FN is None else _FN
    return fn.apply(x, lora_a, lora_b, weight, absmax, table, bias, spec, scaling, dropout_p)


def fused_call_args(layer, x) -> dict | None:
    """What the fused function takes for one call of a fused peft lora.Linear4bit on `x` (peft 0.21: its adapter dicts,
    scaling and flags), or None where its own forward must run: generation (eval mode, a few tokens per call, faster
    through bitsandbytes' own 4-bit kernels), disabled or merged adapters, several active ones, a moved model."""
    import torch

    if (not stashed(layer, FUSED_ATTR, False) or not layer.training or layer.disable_adapters or layer.merged
            or len(layer.active_adapters) != 1 or layer.active_adapters[0] not in layer.lora_A):
        return None
    packed = stashed(layer, PACKED_ATTR)
    if packed.device != x.device:  # the model was moved after use_fused_lora: peft's layer reads the moved weight
        return None
    name = layer.active_adapters[0]
    dropping = layer.lora_dropout[name]
    cast = stashed(layer, ADAPTER_16BIT_ATTR)
    lora_a, lora_b = cast if cast is not None else (layer.lora_A[name].weight, layer.lora_B[name].weight)
    return dict(weight=packed, absmax=stashed(layer, ABSMAX_ATTR), table=stashed(layer, ABSMAX_TABLE_ATTR),
                spec=stashed(layer, SPEC_ATTR), bias=layer.base_layer.bias,
                lora_a=lora_a, lora_b=lora_b, scaling=float(layer.scaling[name]),
                dropout_p=dropping.p if isinstance(dropping, torch.nn.Dropout) else 0.0)


def _fused_forward(self, x, *args, **kwargs):
    """Replacement forward of one peft lora.Linear4bit, bound to it by use_fused_lora
    (freetune.reach.torch.replace_forward)."""
    call = None if args or kwargs else fused_call_args(self, x)
    if call is None:
        return type(self).forward(self, x, *args, **kwargs)
    return qlora_linear(x, call["weight"], call["absmax"], call["spec"], call["bias"], call["lora_a"], call["lora_b"],
                        call["scaling"], call["dropout_p"], call["table"])


def use_fused_lora(model, keep_8bit_absmax: bool = False) -> tuple[int, int]:
    """Give every fusable LoRA 4-bit layer of `model` the fused forward; returns (fused, LoRA layers seen).
    keep_8bit_absmax: double-quantised weights keep their 8-bit absmax values, for layers that will be compiled
    (quant_args; freetune.plan.memory.keeps_8bit_absmax says when the plan does so).

    Idempotent. The module's own forward stays reachable (type(module).forward) and takes over whenever the call
    is outside what the fused function does (evaluation, merged or disabled adapters, extra arguments)."""
    from peft.tuners.lora import LoraLayer

    _fused_function()  # now, eagerly: the compiled layers only read it
    fused = seen = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        seen += 1
        already = stashed(module, FUSED_ATTR, False)
        if not already and fusable(module):
            continue
        # The packed 4-bit weight as a plain tensor (same storage) and its quantisation state, read here, outside any
        # compiled region, again at every call (train() calls this after the model reached its GPU). The compiled
        # layers never touch bitsandbytes' Params4bit: its Python __torch_function__ recursed without end there on
        # H200s (in the compiled graph's runtime wrapper; and, eagerly, in the pack hook of gradient checkpointing
        # under DDP), and costs host time on every use.
        weight = module.base_layer.weight
        packed = weight.data  # one tensor object: each .data is a new one, and mark_static marks the object
        absmax, table, spec = nf4.quant_args(weight.quant_state, keep_8bit_absmax)
        for name, value in ((PACKED_ATTR, packed), (ABSMAX_ATTR, absmax), (ABSMAX_TABLE_ATTR, table),
                            (SPEC_ATTR, spec)):
            stash(module, name, value)
        if table is None and weight.quant_state.nested:
            # The 8-bit absmax values the fp32 ones came from are not kept beside them.
            peft_bnb_reach.single_quantised(weight.quant_state, absmax)
        mark_static(packed)
        if not already:
            replace_forward(module, _fused_forward)
            stash(module, FUSED_ATTR, True)
        fused += 1
    return fused, seen


def cast_adapters_once_per_forward(model, same_buffers: bool = False):
    """Cast every fused layer's LoRA weights to the compute dtype once per training forward of `model`, all in one
    go, instead of inside each layer; returns what undoes it (call it after training), or None where no layer is
    fused.

    Why: the LoRA weights are fp32 (the optimizer's precision; freetune.model.adapter_dtype_guard) and the layers
    compute in 16 bits, so each projection cast its A and B to 16 bits in its forward, again in a checkpointed
    layer's recompute, and cast their two gradients back to fp32 in its backward: up to six launches per projection
    and step, on a small model's step that is bound by the host's launches (docs/performance.md has the counts).
    Here a forward pre-hook casts all of them with one multi-tensor copy and hands each layer its 16-bit pair
    (ADAPTER_16BIT_ATTR, read by fused_call_args); their gradients come back to fp32 in one copy at the end of the
    backward. The same casts, so the same numbers (tests/test_kernels.py).

    One process only (train() asks): under DDP every gradient would reach its parameter at the very end of the
    backward, and the all-reduce of the first buckets could no longer overlap the rest of the backward. The 16-bit
    copies stay alive from the forward to the end of the backward (2 bytes per LoRA weight, counted by
    freetune.plan.memory.estimate).

    same_buffers: the copies written into the same buffers at every forward (freetune.speed.cuda_graphs' CUDA graphs
    read them at fixed addresses); they then stay allocated between steps."""
    layers, adapters = [], []
    for module in model.modules():
        if stashed(module, FUSED_ATTR, False):
            adapter = module.active_adapters[0] if len(module.active_adapters) == 1 else None
            if adapter is None or adapter not in module.lora_A:
                continue
            layers.append(module)
            adapters.append(adapter)
    computes = {stashed(layer, SPEC_ATTR)[3] for layer in layers}
    if len(computes) != 1:  # none fused, or layers computing in different dtypes: each layer casts its own
        return None
    compute = computes.pop()
    cast_fn = _cast_function()

    def cast_before_forward(top, args, kwargs=None):
        import torch

        if not (top.training and torch.is_grad_enabled()):
            for layer in layers:  # no 16-bit pair outside a training forward: the fp32 weights then, never a stale pair
                stash(layer, ADAPTER_16BIT_ATTR, None)
            return None
        # The weights read again at every forward, not kept from above: a resumed run's loading may replace them.
        weights = [w for layer, adapter in zip(layers, adapters)
                   for w in (layer.lora_A[adapter].weight, layer.lora_B[adapter].weight)]
        cast = cast_fn.apply(layers, compute, buffers if same_buffers else None, *weights)
        for t in cast:  # fixed sizes, as the parameters they copy: a token count equal to one must not specialise
            mark_static(t)
        for i, layer in enumerate(layers):
            stash(layer, ADAPTER_16BIT_ATTR, (cast[2 * i], cast[2 * i + 1]))
        return None

    buffers = []  # same_buffers: the copies' storage, made at the first forward
    handle = model.register_forward_pre_hook(cast_before_forward)

    def undo():
        handle.remove()
        buffers.clear()
        for layer in layers:  # a step stopped between its forward and its backward left its copies there
            stash(layer, ADAPTER_16BIT_ATTR, None)

    return undo


def _cast_function():
    import torch

    class CastAdapters(torch.autograd.Function):
        """fp32 LoRA weights -> 16-bit copies, one multi-tensor copy each way."""

        @staticmethod
        def forward(ctx, layers, dtype, buffers, *weights):
            ctx.layers, ctx.dtypes = layers, [w.dtype for w in weights]
            ctx.set_materialize_grads(False)  # a weight no layer used gets no gradient, not a zero one
            if buffers is None or len(buffers) != len(weights) or any(
                    b.shape != w.shape or b.dtype != dtype for b, w in zip(buffers, weights)):
                out = [torch.empty_like(w, dtype=dtype) for w in weights]
                if buffers is not None:
                    buffers[:] = out
            else:
                out = buffers
            foreach_copy_(out, list(weights))
            # New tensor objects over the same storage: autograd makes each forward's outputs its own.
            return tuple(t.detach() for t in out) if buffers is not None else tuple(out)

        @staticmethod
        def backward(ctx, *grads):
            for layer in ctx.layers:  # the backward is over: the 16-bit copies may go
                stash(layer, ADAPTER_16BIT_ATTR, None)
            have = [i for i, g in enumerate(grads) if g is not None]
            out = [torch.empty_like(grads[i], dtype=ctx.dtypes[i]) for i in have]
            if out:
                foreach_copy_(out, [grads[i] for i in have])
            full = [None] * len(grads)
            for i, g in zip(have, out):
                full[i] = g
            return (None, None, None, *full)

    return CastAdapters


def casts_once(model) -> bool:
    """Whether FEATURE casts `model`'s fused LoRA weights once per forward (in one process)."""
    return stashed(model, CAST_ONCE_ATTR, False)


def _applies(plan, trainer) -> tuple[bool, str]:
    return plan.kernels.lora == "fused", ""


def _install(trainer, plan):
    """The fused LoRA layers, their LoRA weights cast once per forward in one process (under DDP each gradient must
    reach its parameter as the backward goes, for the all-reduce to overlap it: cast_adapters_once_per_forward)."""
    model = trainer.model
    # How the double-quantised absmax values are kept: decided once by the plan (freetune.plan.memory).
    fused, seen = use_fused_lora(model, keep_8bit_absmax=plan.memory.keep_8bit_absmax)
    once = trainer.args.world_size == 1 and cast_adapters_once_per_forward(
        model, same_buffers=bool(plan.kernels.cuda_graph_tokens))  # graphs read them at fixed addresses
    print0(f"LoRA kernel: fused on {fused} of {seen} LoRA layers (freetune.speed.lora_kernel)"
           + ("; their weights cast to 16 bits once per forward, all together." if once else "."))
    if not once:
        return None
    stash(model, CAST_ONCE_ATTR, True)

    def undo():
        once()
        unstash(model, CAST_ONCE_ATTR)

    return undo


FEATURE = Feature("LoRA kernel", _applies, _install)
