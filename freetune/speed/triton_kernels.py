"""Hand-written Triton kernels for the element-wise work that freetune's custom ops do eagerly on a GPU: one launch
each, called straight from Python.

Why: inside the compiled decoder layers inductor writes such work itself, but the custom ops that the layers' graphs
call (freetune::dequantized_mm, freetune::swiglu_backward_, the chunked MLP) run their bodies eagerly, and there it
cost the host more than the GPU. A backward's dequantisation of a double-quantised weight was three of
bitsandbytes' registered ops (the 8-bit absmax values, their offset, then the 4-bit codes), each Python and ctypes
around its kernel, for six weights per layer; the MLP backward's element-wise steps were torch.compile'd helpers, a
dynamo call (guards, wrappers) per chunk of tokens. A sampled host profile of a 4 GB-card step had the custom ops at
a third of the wall time (docs/performance.md). Here each of them is one kernel launch.

The same arithmetic as the code it replaces (tests/test_triton_kernels.py, on a CPU through Triton's interpreter,
and on a GPU): the dequantisation bit for bit as bitsandbytes' (the absmax value's product and its offset rounded
apart, as bitsandbytes does: fp contraction off), the SwiGLU steps in fp32 with one rounding at the end (as inductor
computes them).

Also the LoRA dropout ops' kernels (freetune.speed.dropout: the keep-draws eight elements per Philox call, and the
LoRA-A product from them), which compiled layers call for their LoRA dropout (bench's dropout_inductor turns them
off); their draws are dropout.reference_draw's, bit for bit. And the backward's two dropout terms from the mask's bits
(LoRA A's gradient, the input gradient's LoRA term), off by default (dropout._BACKWARD says why).

Imported where Triton is (freetune.speed.nf4.triton_for). A launch that fails (a GPU or build Triton cannot compile
that kernel for) warns once and that kernel's callers take their eager path from then on; the other kernels stay in use
(the dropout product's tl.dot can fail where the element-wise kernels run).
"""

from __future__ import annotations

import os
import warnings

import torch
import triton
import triton.language as tl

from freetune.reach.peft_bnb import NESTED_BLOCKSIZE
from freetune.speed.dropout import drop_threshold

_BROKEN: dict = {}  # kernel name -> why its launch failed: run() then returns None for it, for the process
BLOCK = 1024        # elements (bytes, for the dequantisation) per program
# Triton's interpreter (the tests' processes set it before anything imports triton): CPU tensors run the kernels too
_INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def usable(t) -> bool:
    """Whether the kernels here run on `t`'s device: CUDA (or CPU tensors under Triton's interpreter,
    TRITON_INTERPRET=1, for tests)."""
    return t.is_cuda or (_INTERPRETING and t.device.type == "cpu")


def run(name: str, *args):
    """Kernel wrapper `name` (below) on args; None where it failed, now (warned once) or before: the caller's eager
    path."""
    if name in _BROKEN:
        return None
    try:
        return globals()[name](*args)
    except Exception as exc:  # a GPU or build Triton cannot compile for: the same arithmetic, eagerly
        _BROKEN[name] = repr(exc)
        warnings.warn(f"freetune.speed.triton_kernels: {name} failed ({exc}); the eager code runs instead")
        return None


def contiguous(*tensors) -> bool:
    """The kernels read their tensors as flat rows: every one given must be contiguous."""
    return all(t.is_contiguous() for t in tensors)


@triton.jit
def _nf4_nested_kernel(packed_ptr, absmax_ptr, table_ptr, out_ptr, n_bytes, n_out,
                       BLOCKSIZE: tl.constexpr, NESTED: tl.constexpr, BLOCK: tl.constexpr):
    # A byte holds two 4-bit codes, high nibble first; its block's absmax value is its 8-bit code's value times its
    # group's scale, plus the offset (freetune.speed.nf4.nested_table: 16 + 256 + 1 + the scales).
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_bytes
    byte = tl.load(packed_ptr + offs, mask=inside, other=0).to(tl.int32)
    block = (offs * 2) // BLOCKSIZE
    code8 = tl.load(absmax_ptr + block, mask=inside, other=0).to(tl.int32)
    absmax = tl.load(table_ptr + 16 + code8, mask=inside, other=0.0)
    absmax = absmax * tl.load(table_ptr + 273 + block // NESTED, mask=inside, other=0.0)
    absmax = absmax + tl.load(table_ptr + 272)
    high = tl.load(table_ptr + (byte >> 4), mask=inside, other=0.0) * absmax
    low = tl.load(table_ptr + (byte & 15), mask=inside, other=0.0) * absmax
    kind = out_ptr.dtype.element_ty
    tl.store(out_ptr + 2 * offs, high.to(kind), mask=inside & (2 * offs < n_out))
    tl.store(out_ptr + 2 * offs + 1, low.to(kind), mask=inside & (2 * offs + 1 < n_out))


@triton.jit
def _kept(mask_ptr, offs, inside, cols, mask_cols):
    # dropout's keep-mask bit of each element, 0 or 1 (freetune.speed.lora_kernel.pack_mask: 8 per byte, the lowest
    # bit first)
    row = offs // cols
    col = offs % cols
    bits = tl.load(mask_ptr + row * mask_cols + col // 8, mask=inside, other=0).to(tl.int32)
    return ((bits >> (col % 8)) & 1).to(tl.float32)


@triton.jit
def _activation_kernel(g_ptr, u_ptr, mask_ptr, out_ptr, n, cols, mask_cols, scale,
                       HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    act = g * tl.sigmoid(g) * u
    if HAS_MASK:
        act = act * _kept(mask_ptr, offs, inside, cols, mask_cols) * scale
    tl.store(out_ptr + offs, act.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _swiglu_grads_kernel(g_ptr, u_ptr, d_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    d = tl.load(d_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    kind = g_ptr.dtype.element_ty
    tl.store(g_ptr + offs, (d * u * (sig + silu * (1.0 - sig))).to(kind), mask=inside)
    tl.store(u_ptr + offs, (d * silu).to(kind), mask=inside)


@triton.jit
def _dropped_kernel(x_ptr, mask_ptr, out_ptr, n, cols, mask_cols, scale, ACCUMULATE: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    x = x * _kept(mask_ptr, offs, inside, cols, mask_cols) * scale
    if ACCUMULATE:
        x = x + tl.load(out_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, x.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _pack_kernel(kept_ptr, out_ptr, n_out, cols, out_cols, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n_out
    row = offs // out_cols
    first = (offs % out_cols) * 8
    bits = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.static_range(8):
        col = first + k
        kept = tl.load(kept_ptr + row * cols + col, mask=inside & (col < cols), other=0).to(tl.int32)
        bits = bits | (kept << k)
    tl.store(out_ptr + offs, bits.to(tl.uint8), mask=inside)


@triton.jit
def _byte_draws(seed, byte, N: tl.constexpr):
    # (N, 8) 16-bit keep-draws for N bytes of the packed mask (freetune.speed.dropout.reference_draw): byte b is
    # Philox's call on counter b; its element k takes the 16-bit half k % 2 (low first) of output word k // 2.
    # Inductor's dropout runs a whole call per element (tl.rand keeps 1 of its 4 outputs), and the rounds are most of
    # such a kernel's time.
    r0, r1, r2, r3 = tl.randint4x(seed, byte)
    words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [N, 4]).to(tl.uint32, bitcast=True)
    return tl.reshape(tl.join(words & 0xFFFF, words >> 16), [N, 8])


@triton.jit
def _dropout_packed_kernel(x_ptr, seed_ptr, out_ptr, bits_ptr, n_bytes, cols, bit_cols, threshold, scale,
                           BYTES: tl.constexpr):
    # BYTES bytes of the packed mask a program, 8 elements each (a (BYTES, 8) tile of the padded layout of x)
    offs = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
    inside = offs < n_bytes
    row = offs // bit_cols
    col = (offs % bit_cols)[:, None] * 8 + tl.arange(0, 8)[None, :]
    where = inside[:, None] & (col < cols)
    keep = (_byte_draws(tl.load(seed_ptr), offs, BYTES) >= threshold) & where
    at = row[:, None] * cols + col
    x = tl.load(x_ptr + at, mask=where, other=0.0).to(tl.float32)
    tl.store(out_ptr + at, tl.where(keep, x * scale, 0.0).to(out_ptr.dtype.element_ty), mask=where)
    bits = tl.sum(keep.to(tl.int32) << tl.arange(0, 8)[None, :], axis=1)
    tl.store(bits_ptr + offs, bits.to(tl.uint8), mask=inside)


@triton.jit
def _eight(k0, k1, k2, k3, k4, k5, k6, k7):
    # eight (M, N) tensors as one (M, N, 8), the k-th at [:, :, k]: the new dimension in each thread's registers (a
    # join's), so no layout conversion between the draws of a byte and its 8 elements
    return tl.reshape(tl.join(tl.join(tl.join(k0, k4), tl.join(k2, k6)), tl.join(tl.join(k1, k5), tl.join(k3, k7))),
                      [k0.shape[0], k0.shape[1], 8])


@triton.jit
def _dropped_product_kernel(x_ptr, a_ptr, seed_ptr, h_ptr, bits_ptr, tokens, cols, bit_cols, rank, threshold, scale,
                            PADDED: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr,
                            WHOLE_BYTES: tl.constexpr):
    # h = dropout(x) A^T for ROWS rows of x a program, COLS columns at a time, with the keep-draws of
    # _dropout_packed_kernel (the same elements kept); the mask's bits written on the way, the dropped x never.
    # Laid out by byte of the mask: a (ROWS, COLS / 8) tile of Philox calls, each call's 8 draws compared and packed
    # where they are, and x read as (ROWS, COLS / 8, 8), so that a byte's 8 elements sit in one thread with their
    # draws. (Drawn as a flat (bytes, 8) tile and reshaped to (ROWS, COLS), as until issue 49's fourteenth session,
    # Triton moved the draws between layouts through shared memory and summed the bits across threads.)
    # PADDED (8 * bit_cols) a constant: one build per width (a model has two or three), and Triton 3.6's interpreter
    # cannot loop up to a run-time scalar. WHOLE_BYTES (cols % 8 == 0): the bounds checked per byte, not per element.
    B: tl.constexpr = COLS // 8
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_in = rows < tokens
    seed = tl.load(seed_ptr)
    ranks = tl.arange(0, R)  # R: the rank padded to a power of two >= 16 (tl.dot's least)
    eighth = tl.arange(0, 8)
    acc = tl.zeros([ROWS, R], dtype=tl.float32)
    for first in range(0, PADDED, COLS):
        nth = first // 8 + tl.arange(0, B)
        byte = rows[:, None] * bit_cols + nth[None, :]
        # element k of a byte: the 16-bit half k % 2 (low first) of the call's output word k // 2
        r0, r1, r2, r3 = tl.randint4x(seed, byte)
        r0, r1 = r0.to(tl.uint32, bitcast=True), r1.to(tl.uint32, bitcast=True)
        r2, r3 = r2.to(tl.uint32, bitcast=True), r3.to(tl.uint32, bitcast=True)
        k0, k1 = (r0 & 0xFFFF) >= threshold, (r0 >> 16) >= threshold
        k2, k3 = (r1 & 0xFFFF) >= threshold, (r1 >> 16) >= threshold
        k4, k5 = (r2 & 0xFFFF) >= threshold, (r2 >> 16) >= threshold
        k6, k7 = (r3 & 0xFFFF) >= threshold, (r3 >> 16) >= threshold
        # the bits of the columns past the last one are 0 (pack_mask's padding)
        valid = (1 << tl.minimum(tl.maximum(cols - nth * 8, 0), 8)) - 1
        bits = (k0.to(tl.int32) | (k1.to(tl.int32) << 1) | (k2.to(tl.int32) << 2) | (k3.to(tl.int32) << 3)
                | (k4.to(tl.int32) << 4) | (k5.to(tl.int32) << 5) | (k6.to(tl.int32) << 6)
                | (k7.to(tl.int32) << 7)) & valid[None, :]
        tl.store(bits_ptr + byte, bits.to(tl.uint8), mask=row_in[:, None] & (nth < bit_cols)[None, :])
        col = (nth * 8)[None, :, None] + eighth[None, None, :]
        if WHOLE_BYTES:
            where = row_in[:, None, None] & (nth < bit_cols)[None, :, None]
        else:
            where = row_in[:, None, None] & (col < cols)
        keep = _eight(k0, k1, k2, k3, k4, k5, k6, k7)  # outside the bounds x reads as 0: nothing to keep or drop
        x = tl.load(x_ptr + rows[:, None, None] * cols + col, mask=where, other=0.0).to(tl.float32)
        dropped = tl.reshape(tl.where(keep, x * scale, 0.0).to(x_ptr.dtype.element_ty), [ROWS, COLS])
        col2 = first + tl.arange(0, COLS)
        a_t = tl.load(a_ptr + ranks[None, :] * cols + col2[:, None],
                      mask=(ranks < rank)[None, :] & (col2 < cols)[:, None], other=0.0)
        acc += tl.dot(dropped, a_t.to(dropped.dtype))
    tl.store(h_ptr + rows[:, None] * rank + ranks[None, :], acc.to(h_ptr.dtype.element_ty),
             mask=row_in[:, None] & (ranks < rank)[None, :])


@triton.jit
def _kept_tile(bits_ptr, rows, row_in, first, bit_cols, ROWS: tl.constexpr, COLS: tl.constexpr):
    # (ROWS, COLS) of dropout's keep-mask from its bits (freetune.speed.lora_kernel.pack_mask: 8 a byte, the lowest
    # bit first), columns first on (a multiple of 8): each byte loaded once, its 8 bits spread over 8 columns
    nth = first // 8 + tl.arange(0, COLS // 8)
    byte = tl.load(bits_ptr + rows[:, None] * bit_cols + nth[None, :],
                   mask=row_in[:, None] & (nth < bit_cols)[None, :], other=0).to(tl.int32)
    return tl.reshape((byte[:, :, None] >> tl.arange(0, 8)[None, None, :]) & 1, [ROWS, COLS]) != 0


@triton.jit
def _dropped_grad_a_kernel(dh_ptr, x_ptr, bits_ptr, part_ptr, tokens, cols, bit_cols, rank, scale,
                           SPLIT: tl.constexpr, R: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    # (dh^T dropout(x)) over SPLIT tokens for COLS columns: program (j, k) sums tokens k * SPLIT on of columns j * COLS
    # on into part[k] (fp32); the dropped x made in registers from x and the bits, never written. SPLIT a constant
    # (Triton 3.6's interpreter cannot loop up to a run-time scalar).
    first_col = tl.program_id(0) * COLS
    col = first_col + tl.arange(0, COLS)
    col_in = col < cols
    ranks = tl.arange(0, R)  # R: the rank padded to a power of two >= 16 (tl.dot's least)
    acc = tl.zeros([R, COLS], dtype=tl.float32)
    for first in range(0, SPLIT, ROWS):
        rows = tl.program_id(1) * SPLIT + first + tl.arange(0, ROWS)
        row_in = rows < tokens
        keep = _kept_tile(bits_ptr, rows, row_in, first_col, bit_cols, ROWS, COLS)
        x = tl.load(x_ptr + rows[:, None] * cols + col[None, :], mask=row_in[:, None] & col_in[None, :],
                    other=0.0).to(tl.float32)
        dropped = tl.where(keep, x * scale, 0.0).to(x_ptr.dtype.element_ty)
        dh_t = tl.load(dh_ptr + rows[None, :] * rank + ranks[:, None], mask=(ranks < rank)[:, None] & row_in[None, :],
                       other=0.0)
        acc += tl.dot(dh_t.to(dropped.dtype), dropped)
    tl.store(part_ptr + tl.program_id(1) * rank * cols + ranks[:, None] * cols + col[None, :], acc,
             mask=(ranks < rank)[:, None] & col_in[None, :])


@triton.jit
def _add_dropped_product_kernel(dx_ptr, dh_ptr, a_ptr, bits_ptr, tokens, cols, bit_cols, rank, scale,
                                R: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr):
    # dx += dropout's mask x scale x (dh A) on a ROWS x COLS tile, in place: the product (tokens x cols) never written
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    col = tl.program_id(1) * COLS + tl.arange(0, COLS)
    row_in = rows < tokens
    col_in = col < cols
    ranks = tl.arange(0, R)
    dh = tl.load(dh_ptr + rows[:, None] * rank + ranks[None, :], mask=row_in[:, None] & (ranks < rank)[None, :],
                 other=0.0)
    a = tl.load(a_ptr + ranks[:, None] * cols + col[None, :], mask=(ranks < rank)[:, None] & col_in[None, :],
                other=0.0)
    product = tl.dot(dh, a.to(dh.dtype))
    where = row_in[:, None] & col_in[None, :]
    keep = _kept_tile(bits_ptr, rows, row_in, tl.program_id(1) * COLS, bit_cols, ROWS, COLS)
    at = rows[:, None] * cols + col[None, :]
    dx = tl.load(dx_ptr + at, mask=where, other=0.0).to(tl.float32)
    tl.store(dx_ptr + at, (dx + tl.where(keep, product * scale, 0.0)).to(dx_ptr.dtype.element_ty), mask=where)


def _grid(n: int):
    return (triton.cdiv(max(n, 1), BLOCK),)


def dot_rank(rank: int) -> int:
    """The LoRA rank padded to a power of two of at least 16 (tl.dot's least): the R of the kernels with a product."""
    return max(16, triton.next_power_of_2(rank))


def dequantize_nf4_nested(packed, absmax, table, blocksize: int, shape, dtype):
    """The 16-bit weight of a double-quantised NF4 weight (packed codes, 8-bit absmax values, their nested_table)."""
    out = torch.empty(tuple(shape), dtype=dtype, device=packed.device)
    n_bytes = packed.numel()
    # fp contraction off: the absmax value's product and its offset round apart, as in bitsandbytes
    _nf4_nested_kernel[_grid(n_bytes)](packed, absmax, table, out, n_bytes, out.numel(), BLOCKSIZE=blocksize,
                                       NESTED=NESTED_BLOCKSIZE, BLOCK=BLOCK, enable_fp_fusion=False)
    return out


def activation(g, u, packed, scale: float):
    """silu(g) * u, times the packed dropout mask and scale where one is given."""
    out = torch.empty_like(g)
    n = g.numel()
    mask = g if packed is None else packed  # any pointer where there is no mask (never read)
    _activation_kernel[_grid(n)](g, u, mask, out, n, g.shape[-1], 0 if packed is None else packed.shape[-1],
                                 float(scale), HAS_MASK=packed is not None, BLOCK=BLOCK)
    return out


def swiglu_grads_(g, u, dact):
    """d gate over g and d up over u, from the activation's gradient; returns g."""
    _swiglu_grads_kernel[_grid(g.numel())](g, u, dact, g.numel(), BLOCK=BLOCK)
    return g


def dropped(x, packed, scale: float, out=None):
    """x times the packed dropout mask and scale; added to `out` in place where given."""
    n = x.numel()
    accumulate = out is not None
    out = torch.empty_like(x) if out is None else out
    _dropped_kernel[_grid(n)](x, packed, out, n, x.shape[-1], packed.shape[-1], float(scale),
                              ACCUMULATE=accumulate, BLOCK=BLOCK)
    return out


def pack(kept):
    """A boolean keep-mask (tokens, n) as bits (tokens, ceil(n / 8)), as freetune.speed.lora_kernel.pack_mask."""
    tokens, cols = kept.shape
    out = torch.empty(tokens, -(-cols // 8), dtype=torch.uint8, device=kept.device)
    _pack_kernel[_grid(out.numel())](kept, out, out.numel(), cols, out.shape[1], BLOCK=BLOCK)
    return out


def dropout_packed(x, seed, p: float):
    """(dropout(x), its keep-mask as bits) for a contiguous (tokens, n) x, drawn from the int64 `seed` (a one-element
    tensor on x's device) as freetune.speed.dropout.reference_draw draws them: the same elements kept."""
    tokens, cols = x.shape
    bit_cols = -(-cols // 8)
    out = torch.empty_like(x)
    bits = torch.empty(tokens, bit_cols, dtype=torch.uint8, device=x.device)
    n_bytes = bits.numel()
    _dropout_packed_kernel[(triton.cdiv(max(n_bytes, 1), BLOCK // 8),)](
        x, seed, out, bits, n_bytes, cols, bit_cols, drop_threshold(p), 1.0 / (1.0 - p), BYTES=BLOCK // 8)
    return out, bits


# freetune::dropped_product's tile: rows of x a program, columns a loop step, warps a program. On an H100 (fp16, rank
# 16, 8,192 tokens, the long-row step's widths), the kernel laid out by byte: 16 x 64 x 2 the fastest, 12.3 ms a step
# against 13.9 for the flat layout's best tile, 16 x 128 x 4 (reports/gpu/dropout_product_layout_h100_issue49_s14.log)
PRODUCT_TILE = {"rows": 16, "cols": 64, "warps": 2}


def dropped_product(x, a, seed, p: float):
    """(dropout(x) A^T, dropout's keep-mask as bits) for a contiguous (tokens, n) x and (r, n) A of x's dtype: the
    elements dropout_packed keeps, summed in fp32 and rounded once (as a cuBLAS product of the dropped x)."""
    tokens, cols = x.shape
    rank = a.shape[0]
    h = torch.empty(tokens, rank, dtype=x.dtype, device=x.device)
    bits = torch.empty(tokens, -(-cols // 8), dtype=torch.uint8, device=x.device)
    tile = PRODUCT_TILE
    _dropped_product_kernel[(triton.cdiv(max(tokens, 1), tile["rows"]),)](
        x, a, seed, h, bits, tokens, cols, bits.shape[1], rank, drop_threshold(p), 1.0 / (1.0 - p),
        PADDED=8 * bits.shape[1], R=dot_rank(rank), ROWS=tile["rows"], COLS=tile["cols"],
        WHOLE_BYTES=cols % 8 == 0, num_warps=tile["warps"])
    return h, bits


# The backward kernels' tiles: dropped_grad_a_parts sums "split" tokens a program ("rows" a loop step) for "cols"
# columns, so a 1,536-wide input still gives the GPU 12 x 16 programs at 8,192 tokens; add_dropped_product_ one
# "rows" x "cols" tile a program. scripts/bench_dropout.py on an H100 (fp16, rank 16, the T4 long-row step's shapes):
# 6.8 and 7.4 ms a step against 10.7 and 12.2 for the code they replace compiled by inductor; the other tiles tried
# within 0.3 ms of these (reports/gpu/dropout_backward_kernels_h100_issue49_s11.log).
GRAD_A_TILE = {"rows": 64, "cols": 128, "split": 512, "warps": 4}
ADD_TILE = {"rows": 32, "cols": 128, "warps": 4}


def grad_a_splits(tokens):
    """How many fp32 parts dropped_grad_a_parts sums `tokens` tokens into (a SymInt where tokens is one: the op's fake,
    freetune.speed.dropout's, computes it too)."""
    return -(-tokens // GRAD_A_TILE["split"])


def dropped_grad_a_parts(dh, x, bits, p: float):
    """fp32 parts (grad_a_splits(tokens), r, n) whose sum over the first dimension is dh^T dropout(x), for the
    contiguous s dy B dh (tokens, r) and the layer's input x (tokens, n) of one dtype and dropout's keep-mask as bits:
    LoRA A's gradient, the dropped x rounded to x's dtype as the forward rounds it. The parts are left to the caller's
    compiled graph to add and round (one fused kernel there, launched by inductor: a sum and a cast launched from
    here cost the host more than the kernel)."""
    tokens, cols = x.shape
    rank = dh.shape[1]
    tile = GRAD_A_TILE
    splits = grad_a_splits(tokens)
    parts = torch.empty(splits, rank, cols, dtype=torch.float32, device=x.device)
    if splits:
        _dropped_grad_a_kernel[(triton.cdiv(max(cols, 1), tile["cols"]), splits)](
            dh, x, bits, parts, tokens, cols, bits.shape[1], rank, 1.0 / (1.0 - p), SPLIT=tile["split"],
            R=dot_rank(rank), ROWS=tile["rows"], COLS=tile["cols"], num_warps=tile["warps"])
    return parts


def add_dropped_product_(dx, dh, a, bits, p: float):
    """dx += dropout's mask x (dh A) / (1 - p), in place, for contiguous dx (tokens, n), dh (tokens, r) and A (r, n) of
    one dtype: the LoRA term of an input gradient where dropout dropped the input, summed in fp32 and rounded once."""
    tokens, cols = dx.shape
    rank = dh.shape[1]
    tile = ADD_TILE
    grid = (triton.cdiv(max(tokens, 1), tile["rows"]), triton.cdiv(max(cols, 1), tile["cols"]))
    _add_dropped_product_kernel[grid](
        dx, dh, a, bits, tokens, cols, bits.shape[1], rank, 1.0 / (1.0 - p), R=dot_rank(rank),
        ROWS=tile["rows"], COLS=tile["cols"], num_warps=tile["warps"])
    return dx

