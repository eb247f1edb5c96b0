"""LoRA dropout inside compiled layers: each element's keep-draw from an eighth of a Philox call, not a whole one,
and the dropped input never written.

Why: a LoRA projection drops its own copy of its input (q, k and v each draw a mask over the same hidden states), so
a step of Qwen2.5-1.5B on 8 x 1,024 tokens draws about 5 billion keep-draws (forward and recompute). inductor lowers
dropout to Triton's `tl.rand`, which runs a Philox-4x32-10 call (ten rounds of 32-bit multiplies) per element and keeps
1 of its 4 outputs, then writes the dropped input for the LoRA-A product to read back. On an H100, LoRA dropout 0.05
added 23 ms to the T4 long-row step's kernels, 22.8 of them in the compiled element-wise kernels where those draws,
copies and masks are (docs/performance.md, issue 49). Drawing 4 elements a call (31 bits each, as tl.rand) cut that by
7 ms only: the Philox rounds themselves were most of the kernel's time, so now a call gives 8 elements, 16 bits each.
`freetune::dropped_product` computes the LoRA-A output dropout(x) A^T from the draws in the same kernel
(freetune.speed.triton_kernels), writing only that (tokens x r) and the keep-mask as bits
(freetune.speed.lora_kernel.pack_mask's layout) for the backward; `freetune::dropout_packed` draws the same mask and
writes the dropped input (bench's dropout_op, and the fallback where the product kernel does not take the dtype).

What is computed is what dropout computes: every element kept independently, the kept ones times 1 / (1 - p), the
dropped ones 0; only the drop probability is p to within 2**-17 (a 16-bit draw below round(p * 2**16): 0.0500031 for
0.05), 60 times finer than the fp16 rounding of x / (1 - p) itself, and which numbers the draws take from the
generator differs (as it already differs between inductor's dropout and eager torch's). The seed comes from torch's
generator inside the graph (one torch.randint per projection), so a checkpointed layer's recompute, whose generator
state torch restores, draws the same mask again; the backward reads the saved bits, never the seed.

The default in compiled layers since it was measured (_DRAW; an H100 with the T4's constraints emulated, the long-row
bench: 12 ms of kernels a step less than inductor's dropout, the same peak); bench.py's experiments dropout_inductor
and dropout_op run the others, scripts/bench_dropout.py times each way's kernels alone. The kernels are checked on a
CPU through Triton's interpreter and on a GPU (tests/test_triton_kernels.py).

The backward reads the saved bits: inductor's code unpacks them for LoRA A's gradient (the dropped x made again for
cuBLAS) and for the input gradient's LoRA term; lora_a_grad_of_dropped and add_dropped_lora_grad_ can instead compute
each term in one kernel from the bits (_BACKWARD, off: fewer kernel-milliseconds, more host time, measured).

Where there is no Triton kernel for the tensor (no Triton, or that kernel's launch failed), a GPU draws with torch's
own dropout kernel and a CPU with `reference_draw`, the same numbers as the kernels in torch code (the tests compare
them).
"""

from __future__ import annotations

from freetune.speed import nf4

# How compiled layers draw LoRA dropout: "product", freetune::dropped_product (the LoRA-A product computed from the
# draws in the same kernel, the dropped input never written); "op", freetune::dropout_packed and then the product;
# "inductor", inductor's own dropout (before issue 49's tenth session). The product measured fastest (H100, T4
# emulated, long rows: 187.0 against inductor's 199.2 ms of kernels a step, docs/performance.md);
# scripts/bench_experiments.py's dropout_inductor and dropout_op set the others.
_DRAW = {"how": "product"}
_OPS: dict = {}  # the ops by name, defined once per process (see _op), and the library that holds them

_WORD = 0xFFFFFFFF
DRAW_BITS = 16  # bits of a Philox output per keep-draw: 8 elements a call (see the module)


def philox(counter, key):
    """Philox-4x32-10 of the 4 x 32-bit counter words (int64 tensors) under the 2 x 32-bit key (int64 tensors or
    ints): its 4 output words, as Triton's tl.randint4x computes them (Random123's constants and rounds)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        # 32 x 32-bit products in int64: wrapped modulo 2**64, their high and low words exact
        p0, p2 = c0 * 0xD2511F53, c2 * 0xCD9E8D57
        c0, c1, c2, c3 = ((p2 >> 32) & _WORD) ^ c1 ^ k0, p2 & _WORD, ((p0 >> 32) & _WORD) ^ c3 ^ k1, p0 & _WORD
        k0, k1 = (k0 + 0x9E3779B9) & _WORD, (k1 + 0xBB67AE85) & _WORD
    return c0, c1, c2, c3


def drop_threshold(p: float) -> int:
    """The 16-bit draw below which an element is dropped: round(p * 2**16), so the drop probability is p within 2**-17
    (0.05 -> 3277 / 65536 = 0.0500031)."""
    return min(1 << DRAW_BITS, max(0, round(p * (1 << DRAW_BITS))))


def reference_draw(x, seed, p: float):
    """(dropout(x), its keep-mask as bits) for a (tokens, n) x, drawn as freetune::dropout_packed's Triton kernel
    draws them: byte b of the mask (8 elements of the row-major (tokens, 8 * ceil(n / 8)) layout) is Philox's call on
    counter b under the key `seed` (int64, one element); its element k takes the 16-bit half k % 2 (low first) of the
    call's output word k // 2, and is kept where that is at least drop_threshold(p)."""
    import torch

    from freetune.speed.lora_kernel import pack_mask

    tokens, cols = x.shape
    padded = 8 * -(-cols // 8)
    counter = torch.arange(tokens * padded // 8, device=x.device)
    zero = torch.zeros_like(counter)
    seed = seed.to(torch.int64)
    words = torch.stack(philox((counter, zero, zero, zero), (seed & _WORD, (seed >> 32) & _WORD)), -1)
    draws = torch.stack((words & 0xFFFF, words >> 16), -1).reshape(tokens, padded)
    keep = (draws >= drop_threshold(p))[:, :cols]
    dropped = torch.where(keep, (x.float() * (1.0 / (1.0 - p))).to(x.dtype), torch.zeros((), dtype=x.dtype))
    return dropped, pack_mask(keep)


def _fits_the_kernels(x) -> bool:
    # int32 indexing in the kernels: x's elements and the Philox counters (2 a byte) stay below 2**31
    return x.is_contiguous() and x.numel() < 2**30


def _draw(x, seed, p: float):
    """freetune::dropout_packed's body: the Triton kernel where it runs on x, else torch's code (see the module)."""
    fast = nf4.triton_for(x)
    if fast is not None and _fits_the_kernels(x):
        out = fast.run("dropout_packed", x, seed, p)
        if out is not None:
            return out
    return _torch_dropout(x, p) if x.is_cuda else reference_draw(x, seed, p)


def _torch_dropout(x, p: float):
    """torch's dropout of x (traced: inductor's) and its keep-mask as bits."""
    import torch

    from freetune.speed.lora_kernel import pack_mask

    dropped, kept = torch.native_dropout(x, p, True)
    return dropped, pack_mask(kept)


def _product_kernel_runs(x, rank: int, *others) -> bool:
    """Whether the kernels with a product in them (freetune::dropped_product's, the backward's) take x and the
    others (A, dh, dx): one 16-bit dtype (tl.dot's inputs; fp32 would round to tf32), bf16 only where the GPU
    multiplies it (compute capability 8.0 on; a T4 trains in fp16), all contiguous, a rank up to 128 (its fp32 sums
    held in registers)."""
    import torch

    return (all(t.dtype == x.dtype and t.is_contiguous() for t in others) and _fits_the_kernels(x) and rank <= 128
            and (x.dtype == torch.float16 or x.dtype == torch.bfloat16 and (
                not x.is_cuda or torch.cuda.get_device_capability(x.device) >= (8, 0))))


def _dropped_product(x, a, seed, p: float):
    """freetune::dropped_product's body: the Triton kernel where it runs on x, else the draw and a product."""
    fast = nf4.triton_for(x)
    if fast is not None and _product_kernel_runs(x, a.shape[0], a):
        out = fast.run("dropped_product", x, a, seed, p)
        if out is not None:
            return out
    dropped, bits = _draw(x, seed, p)
    return dropped @ a.t(), bits


def _grad_a_eager(dh, x, bits, p: float):
    """dh^T dropout(x) in torch code: the dropped x made again from the bits (inductor's code in a compiled layer)."""
    from freetune.speed.lora_kernel import unpack_mask

    return dh.t() @ (x * unpack_mask(bits, x.shape[1], x.dtype) * (1.0 / (1.0 - p)))


def _add_product_dropped_eager(dx, dh, a, bits, p: float):
    """dx += mask * (dh A) / (1 - p) in place, in torch code: the product, the mask and an add; returns dx."""
    from freetune.speed.lora_kernel import unpack_mask

    return dx.add_((dh @ a).mul_(unpack_mask(bits, dx.shape[1], dx.dtype)).mul_(1.0 / (1.0 - p)))


def _grad_a_parts_shape(dh, x) -> tuple:
    """The shape of freetune::dropped_grad_a_parts' output for dh (tokens, r) and x (tokens, n): (parts, r, n), the
    parts its kernel's split gives where its kernels run on x's device, else one (the fake and the body agree on it:
    the same device)."""
    fast = nf4.triton_for(x)
    return (1 if fast is None else fast.grad_a_splits(x.shape[0]), dh.shape[1], x.shape[1])


def _grad_a_parts(dh, x, bits, p: float):
    """freetune::dropped_grad_a_parts' body: fp32 parts (_grad_a_parts_shape) whose sum over the first dimension
    is dh^T dropout(x) from the saved bits: the Triton kernel's where it runs, else the dropped x made again and a
    product in the first part (x's dtype's rounding, as the kernel's sum is rounded by the caller), zeros in the
    others."""
    import torch

    fast = nf4.triton_for(x)
    if fast is not None and _product_kernel_runs(x, dh.shape[1], dh) and bits.is_contiguous():
        out = fast.run("dropped_grad_a_parts", dh, x, bits, p)
        if out is not None:
            return out
    parts = torch.zeros(_grad_a_parts_shape(dh, x), dtype=torch.float32, device=x.device)
    parts[0] = _grad_a_eager(dh, x, bits, p)
    return parts


def _add_product_dropped(dx, dh, a, bits, p: float) -> None:
    """freetune::add_dropped_product_'s body: dx += mask * (dh A) / (1 - p) in place; the Triton kernel where it runs,
    else the product, the mask and an add."""
    fast = nf4.triton_for(dx)
    if fast is not None and _product_kernel_runs(dx, dh.shape[1], dh, a) and bits.is_contiguous():
        if fast.run("add_dropped_product_", dx, dh, a, bits, p) is not None:
            return
    _add_product_dropped_eager(dx, dh, a, bits, p)


# The ops' signatures. Registered plainly (torch.library.Library: a schema, the body for CUDA and CPU tensors, a fake
# for tracing), not through torch.library.custom_op, whose Python wrapper around every call cost 22-47 us a call on
# the lent H100s' hosts against 7-14 for the plain registration (scripts/bench_dropout.py --host, issue 49's twelfth
# session): each is called once a projection a step, hundreds of times. What the plain registration leaves out, the
# ops do not need: they run only inside compiled graphs (lora_a_of_dropped, lora_a_grad_of_dropped and
# add_dropped_lora_grad_ call them while tracing), where autograd records none of their calls and inductor tracks
# the in-place one's mutation from the schema's (a!).
_SCHEMAS = {
    "dropout_packed": "(Tensor x, Tensor seed, float p) -> (Tensor, Tensor)",
    "dropped_product": "(Tensor x, Tensor a, Tensor seed, float p) -> (Tensor, Tensor)",
    "dropped_grad_a_parts": "(Tensor dh, Tensor x, Tensor bits, float p) -> Tensor",
    "add_dropped_product_": "(Tensor(a!) dx, Tensor dh, Tensor a, Tensor bits, float p) -> ()",
}


def _op(name: str):
    """The op freetune::`name` (made once, eagerly: dynamo cannot trace its making; the compiled layers call each as
    one opaque kernel): freetune::dropout_packed(x, seed, p) -> (dropout(x), keep-mask bits),
    freetune::dropped_product(x, a, seed, p) -> (dropout(x) A^T, keep-mask bits), and the backward's
    freetune::dropped_grad_a_parts(dh, x, bits, p) -> fp32 parts summing to dh^T dropout(x) and
    freetune::add_dropped_product_(dx, dh, a, bits, p) (dx += the mask's share of dh A, in place: inductor runs it on
    dx's own buffer, as lora_kernel's add_product_)."""
    if name not in _OPS:
        import torch

        def bits_like(x):
            return x.new_empty((x.shape[0], -(-x.shape[1] // 8)), dtype=torch.uint8)

        body, fake = {
            "dropout_packed": (_draw, lambda x, seed, p: (torch.empty_like(x), bits_like(x))),
            "dropped_product": (_dropped_product,
                                lambda x, a, seed, p: (x.new_empty((x.shape[0], a.shape[0])), bits_like(x))),
            "dropped_grad_a_parts": (_grad_a_parts, lambda dh, x, bits, p: x.new_empty(_grad_a_parts_shape(dh, x),
                                                                                   dtype=torch.float32)),
            "add_dropped_product_": (_add_product_dropped, lambda dx, dh, a, bits, p: None),
        }[name]
        if "library" not in _OPS:  # one library for the four; freed, it would unregister them
            _OPS["library"] = torch.library.Library("freetune", "FRAGMENT")
        library = _OPS["library"]
        library.define(name + _SCHEMAS[name])
        for device in ("CUDA", "CPU"):
            library.impl(name, body, device)
        torch.library.register_fake(f"freetune::{name}", fake, lib=library)
        _OPS[name] = getattr(torch.ops.freetune, name).default
    return _OPS[name]


def make_ops() -> None:
    """The ops, now, eagerly (the fused layer's and the traced MLP's function builders call this)."""
    for name in ("dropout_packed", "dropped_product", "dropped_grad_a_parts", "add_dropped_product_"):
        _op(name)


def _seed(x):
    """A Philox key from torch's generator, drawn in the graph: a checkpoint's recompute draws it again."""
    import torch

    return torch.randint(0, 2**62, (1,), device=x.device)


def lora_a_of_dropped(x, a, p: float):
    """(dropout(x) A^T, dropout's keep-mask as bits: lora_kernel.pack_mask's layout) for a (tokens, n) x and the
    (r, n) LoRA A: a fused projection's LoRA-A output. Inside a compiled layer as _DRAW says (one kernel,
    freetune::dropped_product; freetune::dropout_packed and a product; inductor's dropout); eagerly torch's dropout."""
    import torch

    how = _DRAW["how"] if torch.compiler.is_compiling() else "inductor"
    if how == "product":
        return _op("dropped_product")(x.contiguous(), a.contiguous(), _seed(x), p)
    dropped, bits = _op("dropout_packed")(x.contiguous(), _seed(x), p) if how == "op" else _torch_dropout(x, p)
    return dropped @ a.t(), bits


# Whether compiled layers' backward computes LoRA A's gradient and the input gradient's LoRA term from dropout's bits
# in one kernel each (freetune::dropped_grad_a_parts, freetune::add_dropped_product_: bench's experiment
# dropout_backward_kernels) instead of inductor's code (the bits unpacked, the dropped x made again for cuBLAS, the
# product dh A written, then masked and added). Off: on an H100 with the T4 long-row bench they take 1.3-1.4% off a
# step's kernels, but the two ops' Python (their dispatch, Triton's launch from Python) costs the backward's thread
# ~0.13-0.18 ms a projection, 196 a step: tokens/s 9% lower on that host-bound GPU (20-45% lower before the ops were
# registered plainly and LoRA A's parts added in the graph). Made triton_ops, which inductor launches from its own
# code, the host cost went but the kernels ran 7-19% slower than Triton's own launch (docs/performance.md, issue 49,
# eleventh and twelfth sessions).
_BACKWARD = {"kernels": False}


def lora_a_grad_of_dropped(dh, x, bits, p: float):
    """dh^T dropout(x): LoRA A's gradient (r, n) in x's dtype from s dy B (tokens, r), the projection's input x
    (tokens, n) and dropout's keep-mask as bits (lora_a_of_dropped's). Inside a compiled layer one kernel
    (freetune::dropped_grad_a_parts: the dropped x is never written) and the parts' sum in the graph; elsewhere, or
    with _BACKWARD off, the dropped x made again and a product."""
    import torch

    if _BACKWARD["kernels"] and torch.compiler.is_compiling():
        # the parts added and rounded here, in the caller's graph: one kernel inductor fuses and launches
        return _op("dropped_grad_a_parts")(dh.contiguous(), x.contiguous(), bits, p).sum(0).to(x.dtype)
    return _grad_a_eager(dh, x, bits, p)


def add_dropped_lora_grad_(dx, dh, a, bits, p: float):
    """dx += dropout's mask x (dh A) / (1 - p), in place, for an input gradient dx (tokens, n), s dy B dh (tokens, r),
    A (r, n) and dropout's keep-mask as bits; returns dx. Inside a compiled layer one kernel
    (freetune::add_dropped_product_: the product dh A is never written); elsewhere, or with _BACKWARD off, the product,
    the mask and an add."""
    import torch

    if _BACKWARD["kernels"] and torch.compiler.is_compiling() and dx.is_contiguous():
        _op("add_dropped_product_")(dx, dh.contiguous(), a.contiguous(), bits, p)
        return dx
    return _add_product_dropped_eager(dx, dh, a, bits, p)
