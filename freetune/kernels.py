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

import types

FUSED_ATTR = "_freetune_fused_lora"


def _dequantize(weight, quant_state):
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(weight, quant_state)  # (out, in) in the layer's compute dtype


def _function():
    import torch

    class QLoRALinear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, quant_state, bias, lora_a, lora_b, scaling: float, dropout_p: float):
            compute = quant_state.dtype
            out_dtype = x.dtype  # bitsandbytes' Linear4bit returns its input's dtype; so does this
            shape = x.shape
            x2 = x.reshape(-1, shape[-1]).to(compute)
            w = _dequantize(weight, quant_state)
            y = torch.nn.functional.linear(x2, w, None if bias is None else bias.to(compute))
            del w
            a, b = lora_a.to(compute), lora_b.to(compute)
            mask = None
            if dropout_p > 0.0:
                xd, mask = torch.native_dropout(x2, dropout_p, True)
            else:
                xd = x2
            h = xd @ a.t()                                   # (tokens, r)
            y.addmm_(h, b.t(), alpha=scaling)                # + s * h B^T, in place: no extra (tokens, out) tensor
            ctx.save_for_backward(weight, xd, mask, h, a, b)
            ctx.quant_state = quant_state
            ctx.scaling, ctx.dropout_p = scaling, dropout_p
            ctx.x_dtype, ctx.a_dtype, ctx.b_dtype = x.dtype, lora_a.dtype, lora_b.dtype
            return y.reshape(*shape[:-1], y.shape[-1]).to(out_dtype)

        @staticmethod
        def backward(ctx, dy):
            weight, xd, mask, h, a, b = ctx.saved_tensors
            s = ctx.scaling
            compute = ctx.quant_state.dtype
            shape = dy.shape
            dy2 = dy.reshape(-1, shape[-1]).to(compute)
            grad_x = grad_a = grad_b = None
            dh = (dy2 @ b).mul_(s)                           # (tokens, r): s * dy B
            if ctx.needs_input_grad[5]:
                grad_b = (dy2.t() @ h).mul_(s).to(ctx.b_dtype)
            if ctx.needs_input_grad[4]:
                grad_a = (dh.t() @ xd).to(ctx.a_dtype)
            if ctx.needs_input_grad[0]:
                w = _dequantize(weight, ctx.quant_state)
                grad_x = dy2 @ w
                del w
                if mask is None:
                    grad_x.addmm_(dh, a)
                else:
                    grad_x.add_((dh @ a).mul_(mask).mul_(1.0 / (1.0 - ctx.dropout_p)))
                grad_x = grad_x.reshape(*shape[:-1], grad_x.shape[-1]).to(ctx.x_dtype)
            return grad_x, None, None, None, grad_a, grad_b, None, None

    return QLoRALinear


_APPLY = None  # QLoRALinear.apply, kept out of compiled graphs; built once by _fused_apply


def _fused_apply():
    """QLoRALinear.apply, built once, outside any compiled region (dynamo cannot trace a class body).

    It is kept out of torch.compile's graphs (torch.compiler.disable): inside a compiled decoder layer it runs
    eagerly between the compiled pieces, as in the measured runs of the README. Traced into the layer's graph
    instead, with gradient checkpointing on (the T4 plan), the checkpoint's pack hook recursed without end in
    bitsandbytes' Params4bit.__torch_function__ (RecursionError on H200s), and without checkpointing the step was
    ~13% slower (5,901 vs 6,798 tokens/s on an H200, both runs slowed by another bug: indicative)."""
    global _APPLY
    if _APPLY is None:
        import torch

        _APPLY = torch.compiler.disable(_function().apply, recursive=True)
    return _APPLY


def qlora_linear(x, weight, quant_state, bias, lora_a, lora_b, scaling: float, dropout_p: float):
    """y = base(x) + scaling * lora_b(lora_a(dropout(x))) for a 4-bit base weight, as one autograd node."""
    return (_APPLY or _fused_apply())(x, weight, quant_state, bias, lora_a, lora_b, scaling, dropout_p)


def _fused_forward(self, x, *args, **kwargs):
    """Replacement forward of one peft lora.Linear4bit (bound to it by use_fused_lora)."""
    import torch

    # Generation (eval mode, a few tokens per call) is faster through bitsandbytes' own 4-bit kernels.
    if (args or kwargs or not self.training or self.disable_adapters or self.merged
            or len(self.active_adapters) != 1 or self.active_adapters[0] not in self.lora_A):
        return type(self).forward(self, x, *args, **kwargs)
    name = self.active_adapters[0]
    base = self.base_layer
    dropout = self.lora_dropout[name]
    p = dropout.p if isinstance(dropout, torch.nn.Dropout) else 0.0
    return qlora_linear(x, base.weight, base.weight.quant_state, base.bias, self.lora_A[name].weight,
                        self.lora_B[name].weight, float(self.scaling[name]), p)


def fusable(module) -> str:
    """'' when `module` can take the fused forward, else why not."""
    import torch

    try:
        from bitsandbytes.nn import Linear4bit
        from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    except ImportError as exc:
        return f"bitsandbytes/peft unavailable: {exc}"
    if not isinstance(module, LoraLinear4bit):
        return "not a peft LoRA layer over a 4-bit base"
    base = module.base_layer
    if not isinstance(base, Linear4bit) or getattr(base.weight, "quant_state", None) is None:
        return "base layer has no quantisation state"
    if getattr(base.weight.quant_state, "packing_format_for_cpu", False):
        return "weight repacked for CPU inference"
    if module.lora_variant or any(module.use_dora.values()):
        return "a LoRA variant (DoRA, ...) has its own forward"
    if len(module.lora_A) != 1:
        return "several adapters"
    dropout = next(iter(module.lora_dropout.values()))
    if not isinstance(dropout, (torch.nn.Dropout, torch.nn.Identity)):
        return f"dropout module {type(dropout).__name__}"
    if base.weight.quant_state.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"compute dtype {base.weight.quant_state.dtype}"
    return ""


def choose_lora_kernel(device: str, layout: str) -> tuple[str, str]:
    """(kernel, why) for the plan: "fused" on a GPU, peft's own layers elsewhere."""
    if device != "cuda":
        return "peft", ("a CPU run is a check: peft's layers, whose dropout draws match the plain stack's "
                        "(a CPU is bound by arithmetic, not by launches)")
    if layout == "fsdp":
        return "peft", "FSDP flattens the 4-bit weights into its shards; peft's layers read them back from there"
    return "fused", ("one autograd node per LoRA 4-bit layer instead of ~10 (freetune.kernels): the step of a "
                     "small model is bound by kernel launches, not by the GPU's arithmetic")


def use_fused_lora(model) -> tuple[int, int]:
    """Give every fusable LoRA 4-bit layer of `model` the fused forward; returns (fused, LoRA layers seen).

    Idempotent. The module's own forward stays reachable (type(module).forward) and takes over whenever the call
    is outside what the fused function does (evaluation, merged or disabled adapters, extra arguments)."""
    from peft.tuners.lora import LoraLayer

    _fused_apply()  # now, eagerly: the compiled layers only read it
    fused = seen = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer):
            continue
        seen += 1
        if getattr(module, FUSED_ATTR, False):
            fused += 1
        elif not fusable(module):
            module.forward = types.MethodType(_fused_forward, module)
            setattr(module, FUSED_ATTR, True)
            fused += 1
    return fused, seen


def choose_compile(compile_layers: str, device: str, layout: str) -> tuple[bool, str]:
    """(compile each decoder layer?, why) for the plan; compile_layers is "auto", "on" or "off"."""
    if compile_layers not in ("auto", "on", "off"):
        from freetune.errors import FreetuneError

        raise FreetuneError(f"compile = {compile_layers!r}: use 'auto' (on a GPU), 'on' or 'off'.")
    if compile_layers != "auto":
        return compile_layers == "on", "as given"
    if device != "cuda":
        return False, "a CPU run is a check: eager, as the plain stack runs"
    if layout == "fsdp":
        return False, "FSDP: its flat parameters and compiled layers are not combined here"
    return True, ("torch.compile per decoder layer: its norms, rotary, SiLU-gate and casts fuse into a few kernels, "
                  "fewer launches and less activation memory; the first steps compile (a minute or two)")


def compile_layers(model, backend: str = "inductor") -> int:
    """torch.compile every decoder layer of `model` in place (module.compile, so the module tree, the adapter's
    parameter names and checkpoints stay as they are); returns how many. Shapes are marked dynamic: padding-free
    and length-grouped batches change length every step. A layer dynamo cannot compile runs eagerly
    (suppress_errors) rather than stopping the run."""
    import torch
    import torch._dynamo

    torch._dynamo.config.suppress_errors = True
    # One compiled graph serves every layer of a model (same code, different weights): the cache must hold at
    # least one entry per layer's guards.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        layer.compile(dynamic=True, backend=backend)
    return len(layers)


def uncompile_layers(model) -> int:
    """Undo compile_layers (after training): generation runs token by token through a KV cache, shapes the
    training graphs were not compiled for; eager layers serve it without recompiling. Returns how many."""
    undone = 0
    for module in model.modules():
        if getattr(module, "_compiled_call_impl", None) is not None:
            module._compiled_call_impl = None
            undone += 1
    return undone
