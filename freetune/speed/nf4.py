"""A bitsandbytes 4-bit weight as plain tensors and constants, and its dequantisation: what the fused LoRA layers
(freetune.speed.lora_kernel) and the fused MLP (freetune.speed.mlp) read instead of bitsandbytes' QuantState object, so
a compiled layer sees tensors and constants only; eagerly on a GPU through one Triton launch where Triton is
(freetune.speed.triton_kernels), else through bitsandbytes' registered ops.
"""

from __future__ import annotations

from freetune.reach.peft_bnb import NESTED_BLOCKSIZE
from freetune.reach.torch import mark_static
from freetune.speed import bnb_cpu

def quant_args(quant_state, keep_8bit_absmax: bool = False) -> tuple:
    """bitsandbytes' QuantState as (absmax, table, spec): the weight's absmax values (one per block of 64), a table
    for decoding them or None, and the constants (blocksize, quant_type, shape, dtype). The fused function takes
    these instead of the QuantState object, so a compiled layer sees plain tensors and constants only (no guards on a
    Python object's attributes, no bitsandbytes Python code to trace).

    A double-quantised weight keeps its absmax values themselves 8-bit blockwise; bitsandbytes dequantises them in
    every forward and backward of every layer (389 extra kernels a step for a 1.5B model, 13% of them: the step
    is bound by launches). Two ways around that:
    - keep_8bit_absmax (layers that will be compiled): the 8-bit values stay, and `nested_table` holds what decodes
      them; inside a compiled layer the whole dequantisation (absmax values, then the 4-bit codes) is plain tensor
      code that inductor fuses into one kernel (_dequantize).
    - otherwise the values are dequantised once, here, and kept in fp32 instead of the 8-bit ones (the caller drops
      those: freetune.reach.peft_bnb.single_quantised): +3 bytes per 64 weights (~61 MB for a 1.5B model).
    freetune.plan.memory.estimate counts either."""
    absmax, table = quant_state.absmax, None
    if quant_state.nested:
        inner = quant_state.state2
        if keep_8bit_absmax and inner.blocksize == NESTED_BLOCKSIZE:
            table = nested_table(quant_state)
            mark_static(table)
        else:
            absmax = dequantize_absmax(absmax, inner.absmax, inner.code.to(inner.absmax.device), quant_state.offset,
                                       inner.blocksize, inner.dtype)
    spec = (quant_state.blocksize, quant_state.quant_type, tuple(quant_state.shape), quant_state.dtype)
    mark_static(absmax)  # a fixed size: a token count equal to it must not specialise a graph
    return absmax, table, spec


def nested_table(quant_state):
    """What decodes a double-quantised weight, as one fp32 tensor: the 4-bit code (16 values), the code of the 8-bit
    absmax values (256), their offset, then one scale per NESTED_BLOCKSIZE absmax values (see _dequantize)."""
    import torch

    inner = quant_state.state2
    device = quant_state.absmax.device
    parts = (quant_state.code, inner.code, quant_state.offset.reshape(1), inner.absmax)
    return torch.cat([t.to(device=device, dtype=torch.float32).reshape(-1) for t in parts])


def _dequantize(packed, absmax, spec, table=None):
    """The 16-bit weight (out, in), as bitsandbytes.functional.dequantize_4bit computes it, for a packed weight of
    shape (n, 1) (tests/test_kernels.py compares the two). With fp32 absmax values (table None): bitsandbytes'
    registered op. With 8-bit ones and their nested_table: inside a compiled graph, the same arithmetic as tensor
    code (one fused kernel: an absmax value is its code times its block's scale plus the offset, a weight its 4-bit
    code's value times its block's absmax, two codes per byte, high nibble first); eagerly, bitsandbytes' ops."""
    import torch

    blocksize, quant_type, shape, dtype = spec
    if table is not None and torch.compiler.is_compiling():
        code4, code8, offset, scales = _table_parts(table)
        block = torch.arange(absmax.shape[0], device=absmax.device) // NESTED_BLOCKSIZE
        return bnb_cpu.decode_4bit(packed, code4, code8[absmax.long()] * scales[block] + offset, blocksize, shape,
                                   dtype)
    fast = triton_for(packed) if table is not None and quant_type == "nf4" else None
    if fast is not None:
        # Eagerly on a GPU (the custom ops' bodies: a backward's input gradient, the MLP backward): one Triton launch,
        # bit for bit bitsandbytes' three ops (the 8-bit absmax values, their offset, the 4-bit codes).
        out = fast.run("dequantize_nf4_nested", packed, absmax, table, blocksize, shape, dtype)
        if out is not None:
            return out
    if table is not None:
        absmax = decoded_absmax(absmax, table)
    return torch.ops.bitsandbytes.dequantize_4bit.default(packed, absmax, blocksize, quant_type, shape, dtype)


_TRITON: dict = {}  # "module": freetune.speed.triton_kernels, or None where Triton is not installed (imported once)


def triton_for(t):
    """freetune.speed.triton_kernels where its kernels run on `t`'s device, else None (Triton not installed, a CPU
    tensor): the callers' eager code then, as where its run() returns None (a kernel whose launch failed)."""
    if "module" not in _TRITON:
        try:
            from freetune.speed import triton_kernels
        except ImportError:
            triton_kernels = None
        _TRITON["module"] = triton_kernels
    fast = _TRITON["module"]
    return fast if fast is not None and fast.usable(t) else None


# Where the compiled layers' backward dequantises its input gradients' weights (times_dequantized): True, in the
# graph itself; False, through freetune::dequantized_mm. Set by freetune.speed.compiled_layers from the plan before
# the layers compile (dequantise_backward_in_graph).
_IN_GRAPH = {"on": False}


def dequantise_backward_in_graph(on: bool) -> None:
    """Whether compiled layers traced from now on write their backward's dequantisation into their own graphs
    (times_dequantized). freetune.speed.compiled_layers sets it from the plan
    (freetune.plan.memory.dequantises_backward_in_graph) and resets it when training ends."""
    _IN_GRAPH["on"] = bool(on)


def times_dequantized(d, packed, absmax, spec, table=None):
    """d W for a packed 4-bit weight W (out, in): a backward's input gradient.

    Inside a compiled graph, two ways, the same arithmetic (tests/test_kernels.py):
    - through an op the compiler cannot see into (freetune::dequantized_mm), which dequantises where the graph
      reaches it and lets the 16-bit weight die with the product. As graph code the dequantisation hangs on the
      layer's inputs alone, and inductor fused it with the recomputed forward's dequantisation of the same weight (the
      traced MLP's gate and up, in its CPU code) or ran it at the top of the backward graph (the attention's
      projections, in a memory snapshot on the GPU): a 16-bit copy of each weight alive from there to its use, at the
      backward's peak. The op's eager body costs the host ~0.1 ms a call (the op's dispatch, a Triton launch from
      Python), six or seven calls per layer.
    - in the graph (dequantise_backward_in_graph, 8-bit absmax values only: their decoding is tensor code), where the
      plan has room for one layer's 16-bit weights (freetune.plan.memory.estimate counts them) and the layers are not
      replayed as CUDA graphs (which take the host's cost away anyway). On the T4 cap's long rows it was 11-17%
      faster on an H100 with a slower host, as fast with a faster one, at the same peak and GPU time
      (docs/performance.md, issue 49)."""
    import torch

    if not torch.compiler.is_compiling() or (table is not None and _IN_GRAPH["on"]):
        return d @ _dequantize(packed, absmax, spec, table)
    blocksize, quant_type, shape, dtype = spec
    return _dequantized_mm_op()(d, packed, absmax, table, blocksize, quant_type, list(shape), dtype)


_DEQUANTIZED_MM: dict = {}  # "op": freetune::dequantized_mm, defined once per process


def _dequantized_mm_op():
    """freetune::dequantized_mm (times_dequantized), made once, eagerly: dynamo cannot trace its making, so the fused
    layers' builders call this before any layer compiles."""
    if "op" not in _DEQUANTIZED_MM:
        import torch

        def impl(d, packed, absmax, table, blocksize: int, quant_type: str, shape: list[int], dtype):
            return d @ _dequantize(packed, absmax, (blocksize, quant_type, tuple(shape), dtype), table)

        schema = ("(Tensor d, Tensor packed, Tensor absmax, Tensor? table, int blocksize, str quant_type, int[] shape, "
                  "ScalarType dtype) -> Tensor")
        op = torch.library.custom_op("freetune::dequantized_mm", impl, mutates_args=(), schema=schema)
        op.register_fake(lambda d, packed, absmax, table, blocksize, quant_type, shape, dtype:
                         d.new_empty((d.shape[0], shape[1])))
        _DEQUANTIZED_MM["op"] = op
    return _DEQUANTIZED_MM["op"]


def decoded_absmax(absmax, table):
    """8-bit absmax values and their nested_table as the fp32 values, through bitsandbytes' op (eagerly)."""
    import torch

    _, code8, offset, scales = _table_parts(table)
    return dequantize_absmax(absmax, scales, code8, offset, NESTED_BLOCKSIZE, torch.float32)


def _table_parts(table):
    """nested_table's parts: (4-bit code, 8-bit code, offset, scales)."""
    return table[:16], table[16:272], table[272], table[273:]


def dequantize_absmax(absmax, absmax2, code2, offset, blocksize2, dtype2):
    """A double-quantised weight's fp32 absmax values (one per block), from their 8-bit blockwise form, as
    bitsandbytes.functional.dequantize_4bit computes them."""
    import torch

    return (torch.ops.bitsandbytes.dequantize_blockwise.default(absmax, absmax2, code2, blocksize2, dtype2)
            + offset).float()
