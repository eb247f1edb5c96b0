"""freetune.speed.triton_kernels: each kernel computes what the eager code it replaces computes.

On a CPU the kernels run through Triton's interpreter (TRITON_INTERPRET=1: the same kernel source, each program's
block of elements as NumPy arrays), so the indexing, masks and arithmetic are checked here; `-k on_a_gpu` runs the
same comparisons compiled on a GPU (the GPU machine: `pytest tests/test_triton_kernels.py -k on_a_gpu`).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from freetune.speed import bnb_cpu, lora_kernel, mlp_ops, nf4, triton_kernels

REPO = Path(__file__).resolve().parents[1]


def interpreted(check: str):
    """Run check("cpu") of this module in a fresh process under Triton's interpreter: TRITON_INTERPRET must be set
    before triton is first imported (bitsandbytes and transformers import it), and set for this whole test process it
    would send every CPU test's custom ops through interpreted kernels."""
    import triton  # noqa: F401  (a dev dependency: these tests need it)

    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", f"from tests import test_triton_kernels as t; t.{check}('cpu')"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("compiled Triton kernels need a GPU; the interpreter cases cover them on a CPU")
    return "cuda"


def nested_weight(shape, dtype, device, seed=0):
    """A double-quantised NF4 weight as the compiled layers keep it: packed codes, 8-bit absmax values, their table."""
    import bitsandbytes.functional as bnbf

    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    packed, state = bnbf.quantize_4bit(weight, quant_type="nf4", compress_statistics=True)
    absmax, table, spec = nf4.quant_args(state, keep_8bit_absmax=True)
    return packed, state, absmax, table, spec


def check_dequantisation(device):
    import bitsandbytes.functional as bnbf

    assert triton_kernels.usable(torch.empty(1, device=device))

    bnb_cpu.ensure_correct_dequantize()
    # an odd element count (the last byte's second code unused), a partial last block, and several nested scales
    for shape in ((97, 161), (300, 200)):
        for dtype in (torch.float16, torch.bfloat16, torch.float32):
            packed, state, absmax, table, spec = nested_weight(shape, dtype, device)
            assert absmax.dtype == torch.uint8 and table is not None
            want = bnbf.dequantize_4bit(packed, state)
            got = triton_kernels.run("dequantize_nf4_nested", packed, absmax, table, spec[0], spec[2], spec[3])
            assert got.dtype == dtype and got.shape == shape
            # and what nf4._dequantize does eagerly there (the custom ops' bodies)
            for out in (got, nf4._dequantize(packed, absmax, spec, table)):
                if device == "cpu" and dtype == torch.bfloat16:
                    # Triton's interpreter casts fp32 to bf16 by truncation (NumPy has no bf16), a GPU rounds to
                    # nearest even as bitsandbytes does: one bf16 step at most here, equal on the GPU
                    torch.testing.assert_close(out, want, rtol=2**-7, atol=0)
                else:
                    assert torch.equal(out, want), (shape, dtype, (out != want).sum())
    assert not triton_kernels._BROKEN, triton_kernels._BROKEN  # no kernel fell back to the eager code


def test_the_dequantisation_is_bitsandbytes_bit_for_bit():
    """The 4-bit codes and 8-bit absmax values decoded in one kernel give bitsandbytes' weight exactly (its two
    roundings of the absmax value kept: fp contraction off)."""
    interpreted("check_dequantisation")


def test_the_dequantisation_is_bitsandbytes_bit_for_bit_on_a_gpu():
    check_dequantisation(on_gpu())


def rounding(dtype):
    return {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 1e-6}[dtype]


def check_mlp_helpers(device):
    """The SwiGLU helpers of freetune.speed.mlp through their kernels against the code as written (which rounds to
    16 bits between its ops, where a kernel rounds once): within a rounding step or two of the dtype."""
    assert triton_kernels.usable(torch.empty(1, device=device))
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.bfloat16):
        tokens, width = 37, 203  # a width that is no multiple of 8: the packed mask's last byte is partial
        g, u, d, x = (torch.randn(tokens, width, generator=gen).to(dtype).to(device) for _ in range(4))
        kept = (torch.rand(tokens, width, generator=gen) > 0.3).to(device)
        packed = lora_kernel.pack_mask(kept)
        assert torch.equal(mlp_ops._pack(kept), packed)  # bits: exact
        scale = 1 / 0.7
        tol = dict(rtol=2 * rounding(dtype), atol=2 * rounding(dtype))
        for mask, s in ((None, 0.0), (packed, scale)):
            got = mlp_ops._activation(g, u, mask, s)
            want = mlp_ops._activation.eager(g.float(), u.float(), mask, s).to(dtype)
            torch.testing.assert_close(got, want, **tol)
        torch.testing.assert_close(mlp_ops._dropped(x, packed, scale),
                                   mlp_ops._dropped.eager(x.float(), packed, scale).to(dtype), **tol)
        dx = d.clone()
        out = mlp_ops._add_dropped_(x, packed, scale, dx)
        assert out.data_ptr() == dx.data_ptr()  # in place
        torch.testing.assert_close(dx, mlp_ops._add_dropped_.eager(x.float(), packed, scale, d.float()).to(dtype),
                                   **tol)
        gk, uk = g.clone(), u.clone()
        mlp_ops._swiglu_grads_(gk, uk, d)
        ge, ue = g.float(), u.float()
        mlp_ops._swiglu_grads_.eager(ge, ue, d.float())
        torch.testing.assert_close(gk, ge.to(dtype), **tol)
        torch.testing.assert_close(uk, ue.to(dtype), **tol)
        assert not torch.equal(gk, g) and not torch.equal(uk, u)  # written over g and u
    assert not triton_kernels._BROKEN, triton_kernels._BROKEN


def test_the_mlp_helpers_compute_what_the_eager_code_computes():
    interpreted("check_mlp_helpers")


def test_the_mlp_helpers_compute_what_the_eager_code_computes_on_a_gpu():
    check_mlp_helpers(on_gpu())


def check_mlp_backward_op(device):
    """freetune::swiglu_backward_'s body (the down projection's A gradient and the SwiGLU gradients written over g
    and u) with the kernels against the same body with the eager code, with and without dropout: the same numbers
    within 16-bit rounding, on bf16 tensors of a small MLP; and the kernels launched are the ones expected."""
    bnb_cpu.ensure_correct_dequantize()
    gen = torch.Generator().manual_seed(1)
    dtype, tokens, hidden, inter, r = torch.bfloat16, 45, 64, 160, 8
    packed, _, dabs, dtab, spec = nested_weight((hidden, inter), dtype, device, seed=2)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    g, u, hg, hu, dy, dh = (rand(tokens, inter), rand(tokens, inter), rand(tokens, r), rand(tokens, r),
                            rand(tokens, hidden), rand(tokens, r))
    gb, ub, da = rand(inter, r, scale=0.1), rand(inter, r, scale=0.1), rand(r, inter, scale=0.1)
    chunk, launched, real_run = mlp_ops.CHUNK_TOKENS, [], triton_kernels.run
    mlp_ops.CHUNK_TOKENS = 16  # several chunks, the last one partial (a process of its own, or restored below)
    try:
        for dropout in (0.0, 0.1):
            kept = torch.rand(tokens, inter, generator=gen).to(device) > dropout
            md = lora_kernel.pack_mask(kept) if dropout else None

            # hd: the down projection's saved A output, or None (a recompute that skipped the MLP's output: d B
            # from each chunk's activation)
            for hd in (rand(tokens, r), None):
                def run():
                    gi, ui = g.clone(), u.clone()
                    grad_da, grad_db = mlp_ops._swiglu_backward_impl(
                        gi, ui, hg, gb, hu, ub, dy, dh, packed, dabs, dtab, da, md, hd, spec[0], spec[1],
                        list(spec[2]), spec[3], [2.0, 2.0, 2.0], dropout)
                    return grad_da.float(), grad_db.float(), gi.float(), ui.float()

                triton_kernels.run = lambda name, *a: None  # every kernel's caller takes its eager code
                eager = run()
                triton_kernels.run = lambda name, *a: launched.append(name) or real_run(name, *a)
                launched.clear()
                with_kernels = run()
                assert not triton_kernels._BROKEN, triton_kernels._BROKEN
                # the down projection's weight once, then per chunk of 16 tokens (3): the activation (its dropout
                # applied), the dropped LoRA term where there is dropout, the SwiGLU gradients
                per_chunk = ["activation", "dropped", "swiglu_grads_"] if dropout else ["activation", "swiglu_grads_"]
                assert launched == ["dequantize_nf4_nested"] + per_chunk * 3
                for a, b in zip(with_kernels, eager):
                    torch.testing.assert_close(a, b, rtol=0.02, atol=0.02 * b.abs().max().item())
    finally:
        triton_kernels.run = real_run
        mlp_ops.CHUNK_TOKENS = chunk


def test_the_mlp_backward_op_gives_the_same_gradients_through_the_kernels():
    interpreted("check_mlp_backward_op")


def test_the_mlp_backward_op_gives_the_same_gradients_through_the_kernels_on_a_gpu():
    check_mlp_backward_op(on_gpu())


def check_dropout_draw(device):
    """freetune::dropout_packed's kernel draws what freetune.speed.dropout.reference_draw draws: the same bits and the
    same dropped values, over widths with a partial last byte and tensors of several programs; another seed, another
    mask. freetune::dropped_product's kernel: the same bits and the LoRA-A product of those dropped values."""
    from freetune.speed import dropout

    assert triton_kernels.usable(torch.empty(1, device=device))
    gen = torch.Generator().manual_seed(3)
    # widths with a partial last byte (203) and whole bytes over several column tiles (200: the product kernel's
    # bounds per byte)
    for (tokens, cols), dtype, p in (((37, 203), torch.float16, 0.05), ((40, 200), torch.float16, 0.2),
                                     ((300, 96), torch.bfloat16, 0.5), ((5, 3), torch.float32, 0.3)):
        x = torch.randn(tokens, cols, generator=gen).to(dtype).to(device)
        seed = torch.tensor([2**61 + 12345], device=device)  # both 32-bit key words in use
        got = triton_kernels.run("dropout_packed", x, seed, p)
        want = dropout.reference_draw(x, seed, p)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0]), (tokens, cols, dtype)
        assert 0 < (got[0] == 0).sum() < x.numel()
        other = triton_kernels.run("dropout_packed", x, seed + 1, p)
        assert not torch.equal(other[1], got[1])
        # The LoRA-A product from the same draws: the same bits, the product of the reference's dropped x within a
        # rounding of the 16-bit output; ranks below tl.dot's 16, at it, and between powers of two. (Its bf16 product
        # only on a GPU: Triton 3.9's interpreter gave bf16 products 1e11 off; NumPy has no bf16.)
        if dtype == torch.float16 or dtype == torch.bfloat16 and device != "cpu":
            for rank in (8, 16, 20):
                a = (torch.randn(rank, cols, generator=gen) / cols**0.5).to(dtype).to(device)
                h, bits = triton_kernels.run("dropped_product", x, a, seed, p)
                assert torch.equal(bits, want[1]) and h.shape == (tokens, rank) and h.dtype == dtype
                torch.testing.assert_close(h.float(), (want[0].float() @ a.float().t()), rtol=2 * rounding(dtype),
                                           atol=2 * rounding(dtype))
    assert not triton_kernels._BROKEN, triton_kernels._BROKEN


def test_the_dropout_kernel_draws_what_the_reference_draws():
    interpreted("check_dropout_draw")


def test_the_dropout_kernel_draws_what_the_reference_draws_on_a_gpu():
    check_dropout_draw(on_gpu())


def check_dropout_backward(device):
    """The backward's dropout kernels: dropped_grad_a_parts' fp32 parts sum to dh^T dropout(x) and
    add_dropped_product_ adds the mask's share of dh A / (1 - p) to dx in place, both from the packed bits
    reference_draw gives, against fp32 products of the reference's dropped x (within a rounding of the 16-bit output);
    tokens that split into several programs' sums (a split smaller than the default's, and one that leaves a partial
    last split), widths with a partial last byte and tile, ranks below tl.dot's 16, at it and between powers of
    two."""
    from freetune.speed import dropout

    gen = torch.Generator().manual_seed(5)
    default_tile = dict(triton_kernels.GRAD_A_TILE)
    dtypes = (torch.float16, torch.bfloat16) if device != "cpu" else (torch.float16,)  # bf16: see check_dropout_draw
    try:
        for (tokens, cols), dtype, p, split in (((37, 203), dtypes[-1], 0.05, default_tile["split"]),
                                                ((300, 136), torch.float16, 0.5, 128)):
            triton_kernels.GRAD_A_TILE.update(split=split)
            x = torch.randn(tokens, cols, generator=gen).to(dtype).to(device)
            seed = torch.tensor([2**61 + 99], device=device)
            dropped, bits = dropout.reference_draw(x, seed, p)
            for rank in (8, 16, 20):
                dh = torch.randn(tokens, rank, generator=gen).to(dtype).to(device)
                a = (torch.randn(rank, cols, generator=gen) / cols**0.5).to(dtype).to(device)
                parts = triton_kernels.run("dropped_grad_a_parts", dh, x, bits, p)
                assert parts.shape == (-(-tokens // split), rank, cols) and parts.dtype == torch.float32
                got = parts.sum(0).to(dtype)  # as dropout.lora_a_grad_of_dropped adds and rounds them
                want = dh.float().t() @ dropped.float()
                # a sum over the tokens: its 16-bit rounding grows with it
                torch.testing.assert_close(got.float(), want, rtol=2 * rounding(dtype),
                                           atol=2 * rounding(dtype) * tokens**0.5)
                dx = torch.randn(tokens, cols, generator=gen).to(dtype).to(device)
                kept = lora_kernel.unpack_mask(bits, cols, torch.float32)
                want = dx.float() + (dh.float() @ a.float()) * kept / (1 - p)
                assert triton_kernels.run("add_dropped_product_", dx, dh, a, bits, p) is dx
                torch.testing.assert_close(dx.float(), want, rtol=2 * rounding(dtype), atol=2 * rounding(dtype))
    finally:
        triton_kernels.GRAD_A_TILE.update(default_tile)
    assert not triton_kernels._BROKEN, triton_kernels._BROKEN
    # the op's body where its kernel failed: the parts its fake promised (the compiled graph's buffers were sized by
    # it), the eager product in the first and zeros after, so that their sum is still the gradient
    triton_kernels._BROKEN["dropped_grad_a_parts"] = "a launch that failed"
    triton_kernels.GRAD_A_TILE.update(split=128)  # 300 tokens: three parts
    try:
        parts = dropout._grad_a_parts(dh, x, bits, p)
        assert parts.shape == (triton_kernels.grad_a_splits(x.shape[0]), dh.shape[1], x.shape[1])
        assert parts.shape[0] > 1 and not parts[1:].any()
        assert torch.equal(parts.sum(0).to(x.dtype), dropout._grad_a_eager(dh, x, bits, p))
    finally:
        del triton_kernels._BROKEN["dropped_grad_a_parts"]
        triton_kernels.GRAD_A_TILE.update(default_tile)


def test_the_dropout_backward_kernels_compute_the_gradients_from_the_bits():
    interpreted("check_dropout_backward")


def test_the_dropout_backward_kernels_compute_the_gradients_from_the_bits_on_a_gpu():
    check_dropout_backward(on_gpu())


def test_a_kernel_whose_launch_failed_sends_only_its_own_callers_to_the_eager_code(monkeypatch):
    """A failed launch warns once and that kernel's run() returns None from then on (its callers' eager code); the
    other kernels still launch: the dropout product's tl.dot failing must not cost the dequantisation its kernel."""
    monkeypatch.setattr(triton_kernels, "_BROKEN", {})
    calls = []

    def failing(*args):
        calls.append("dropped_product")
        raise RuntimeError("no tl.dot for this GPU")

    monkeypatch.setattr(triton_kernels, "dropped_product", failing)
    monkeypatch.setattr(triton_kernels, "pack", lambda kept: calls.append("pack") or "packed")
    with pytest.warns(UserWarning, match="dropped_product failed .*no tl.dot for this GPU"):
        assert triton_kernels.run("dropped_product", "x", "a", "seed", 0.1) is None
    assert triton_kernels.run("dropped_product", "x", "a", "seed", 0.1) is None  # not launched again
    assert triton_kernels.run("pack", "kept") == "packed"
    assert calls == ["dropped_product", "pack"] and list(triton_kernels._BROKEN) == ["dropped_product"]


def test_the_dropout_product_kernel_builds_for_a_t4_without_spills_or_shuffles():
    """freetune::dropped_product's kernel compiled for a T4 (sm_75) and an H100 (sm_90) on this CPU
    (scripts/kernel_sass.py: Triton's own compiler and disassembler, no GPU): its loop keeps a byte's draws, bits and
    elements in one thread, so it spills no registers to local memory and packs the bits without a shuffle between
    threads. Drawn as a flat tile and reshaped, as before issue 49's fourteenth session, it spilled on sm_75 (110 local
    loads and stores a loop step with Triton 3.9) and summed the bits across threads (48 shuffles)."""
    from scripts.kernel_sass import compile_kernel, loop_costs

    tile = triton_kernels.PRODUCT_TILE
    constants = {"PADDED": 1536, "R": 16, "ROWS": tile["rows"], "COLS": tile["cols"], "WHOLE_BYTES": 1}
    for arch in (75, 90):
        costs = loop_costs(*compile_kernel("_dropped_product_kernel", arch, constants, tile["warps"]))
        assert costs["loop_instructions"] > 100, costs  # the loop was found
        assert costs["local_memory_ops"] == 0 and costs["by_opcode"].get("SHFL", 0) == 0, (arch, costs)
