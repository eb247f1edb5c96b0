"""LoRA dropout inside compiled layers: each element's keep-draw from a quarter of a Philox call, not a whole one.

Why: a LoRA projection drops its own copy of its input (q, k and v each draw a mask over the same hidden states), so
a step of Qwen2.5-1.5B on 8 x 1,024 tokens draws about 5 billion keep-draws (forward and recompute). inductor lowers
dropout to Triton's `tl.rand`, which runs a Philox-4x32-10 call (ten rounds of 32-bit multiplies) per element and keeps
1 of its 4 outputs; on an H100 those draws were most of the 23 ms a step that LoRA dropout 0.05 added to the T4
long-row run's kernels (docs/performance.md, issue 49). `freetune::dropout_packed` draws all four outputs of each call
(one kernel per projection, freetune.speed.triton_kernels) and writes the dropped input and its keep-mask as bits
(freetune.speed.lora_kernel.pack_mask's layout) in the same pass.

What is computed is what dropout computes: every element kept independently with probability 1 - p, the kept ones
times 1 / (1 - p), from a 31-bit uniform number compared with p as `tl.rand`'s are; only which numbers the draws take
from the generator differs (as it already differs between inductor's dropout and eager torch's). The seed comes from
torch's generator inside the graph (one torch.randint per projection), so a checkpointed layer's recompute, whose
generator state torch restores, draws the same mask again; the backward reads the saved bits, never the seed.

Where there is no Triton kernel for the tensor (no Triton, or a launch that failed), a GPU draws with torch's own
dropout kernel and a CPU with `reference_draw`, the same numbers as the kernel in torch code (the tests compare them).
"""

from __future__ import annotations

from freetune.speed import nf4

# Whether compiled layers draw LoRA dropout through freetune::dropout_packed (on) or inductor's own dropout (off:
# scripts/bench_experiments.py's inductor_dropout, which measures the difference).
_FOUR_DRAWS_PER_CALL = {"on": True}
_OP: dict = {}  # "op": freetune::dropout_packed, defined once per process

_WORD = 0xFFFFFFFF
_UNIFORM_31_BITS = 4.6566127342e-10  # 2 ** -31 as Triton's uint_to_uniform_float writes it


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


def reference_draw(x, seed, p: float):
    """(dropout(x), its keep-mask as bits) for a (tokens, n) x, drawn as freetune::dropout_packed's Triton kernel
    draws them: element e of the row-major (tokens, 8 * ceil(n / 8)) layout takes output e % 4 of Philox's call on
    counter e // 4 under the key `seed` (int64, one element), as a 31-bit uniform number; kept where it exceeds p."""
    import torch

    from freetune.speed.lora_kernel import pack_mask

    tokens, cols = x.shape
    padded = 8 * -(-cols // 8)
    counter = torch.arange(tokens * padded // 4, device=x.device)
    zero = torch.zeros_like(counter)
    seed = seed.to(torch.int64)
    words = torch.stack(philox((counter, zero, zero, zero), (seed & _WORD, (seed >> 32) & _WORD)), -1).reshape(-1)
    signed = torch.where(words >= 2**31, words - 2**32, words)  # the word as Triton's int32 reads it
    uniform = torch.where(signed < 0, -signed - 1, signed).to(torch.float32) * _UNIFORM_31_BITS
    keep = (uniform > p).view(tokens, padded)[:, :cols]
    dropped = torch.where(keep, (x.float() * (1.0 / (1.0 - p))).to(x.dtype), torch.zeros((), dtype=x.dtype))
    return dropped, pack_mask(keep)


def _draw(x, seed, p: float):
    """freetune::dropout_packed's body: the Triton kernel where it runs on x, else torch's code (see the module)."""
    import torch

    fast = nf4.triton_for(x)
    # int32 indexing in the kernel: x's elements and the Philox counters (2 a byte) stay below 2**31
    if fast is not None and x.is_contiguous() and x.numel() < 2**30:
        out = fast.run("dropout_packed", x, seed, p)
        if out is not None:
            return out
    if x.is_cuda:
        from freetune.speed.lora_kernel import pack_mask

        dropped, kept = torch.native_dropout(x, p, True)
        return dropped, pack_mask(kept)
    return reference_draw(x, seed, p)


def dropout_op():
    """freetune::dropout_packed(x, seed, p) -> (dropout(x), keep-mask bits), made once, eagerly (dynamo cannot trace
    its making): the compiled layers call it as one opaque kernel."""
    if "op" not in _OP:
        import torch

        op = torch.library.custom_op("freetune::dropout_packed", _draw, mutates_args=(),
                                     schema="(Tensor x, Tensor seed, float p) -> (Tensor, Tensor)")
        op.register_fake(lambda x, seed, p: (torch.empty_like(x),
                                             x.new_empty((x.shape[0], -(-x.shape[1] // 8)), dtype=torch.uint8)))
        _OP["op"] = op
    return _OP["op"]


def dropped_and_packed(x, p: float):
    """(dropout(x), its keep-mask as bits: lora_kernel.pack_mask's layout) for a (tokens, n) x: inside a compiled
    layer through freetune::dropout_packed (made by dropout_op before tracing); eagerly, or where the bench experiment
    inductor_dropout asks for it, through torch's dropout (traced: inductor's)."""
    import torch

    if _FOUR_DRAWS_PER_CALL["on"] and torch.compiler.is_compiling():
        # the seed from torch's generator, in the graph: a checkpoint's recompute draws it again
        seed = torch.randint(0, 2**62, (1,), device=x.device)
        return dropout_op()(x.contiguous(), seed, p)
    from freetune.speed.lora_kernel import pack_mask

    dropped, kept = torch.native_dropout(x, p, True)
    return dropped, pack_mask(kept)
