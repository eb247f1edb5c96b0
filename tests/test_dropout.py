"""freetune.speed.dropout: LoRA dropout drawn eight elements per Philox call inside compiled layers.

The draws are Random123's Philox-4x32-10 (its published known answers), each element kept with probability 1 - p
independently of its neighbours in the same call and of the other projections' draws; a compiled layer trains through
the mask its own op drew from torch's generator, and a checkpoint's recompute draws it again. The Triton kernel against
reference_draw: tests/test_triton_kernels.py.
"""

import pytest
import torch

from freetune.speed import dropout, lora_kernel
from test_kernels import aten_graphs, quantized_lora_model


def test_philox_gives_random123s_known_answers():
    """Random123's kat_vectors for philox4x32-10 (counter words, key words -> output words)."""
    word = 0xFFFFFFFF
    cases = [((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((word,) * 4, (word, word), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counter, key, want in cases:
        got = dropout.philox(tuple(torch.tensor([c]) for c in counter), tuple(torch.tensor([k]) for k in key))
        assert tuple(int(w) for w in got) == want


def test_each_element_is_kept_with_probability_1_minus_p_independently():
    """Over 4M draws at p = 0.05: the kept share overall and at each of a byte's 8 places (the 16-bit halves of one
    Philox call's 4 outputs), and the share of neighbours dropped together (two halves of one output, two outputs of
    one call, the last of a call and the first of the next) and of the same element dropped under two seeds (two
    projections' masks over one input): p and p^2, within 6 standard deviations. The kept elements are the input
    times 1 / (1 - p), the dropped ones 0; the bits are the mask lora_kernel.pack_mask makes."""
    p, tokens, cols = 0.05, 1024, 4096
    assert dropout.drop_threshold(p) == 3277 and dropout.drop_threshold(0.0) == 0  # p within 2**-17
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) + 8  # none is 0
    dropped, bits = dropout.reference_draw(x, torch.tensor([12345]), p)
    kept = dropped != 0
    assert torch.equal(bits, lora_kernel.pack_mask(kept))
    assert torch.equal(dropped[kept], (x[kept].float() / (1 - p)).to(torch.bfloat16))

    def near(share, want, n):
        assert abs(share - want) < 6 * (want * (1 - want) / n) ** 0.5, (share, want)

    n = kept.numel()
    near(kept.float().mean().item(), 1 - p, n)
    for place in range(8):
        near(kept[:, place::8].float().mean().item(), 1 - p, n // 8)
    gone = ~kept
    near((gone[:, 0::2] & gone[:, 1::2]).float().mean().item(), p * p, n // 2)   # halves of one output
    near((gone[:, 0::4] & gone[:, 2::4]).float().mean().item(), p * p, n // 4)   # two outputs of one call
    near((gone[:, 7:-1:8] & gone[:, 8::8]).float().mean().item(), p * p, n // 8)  # last of a call, first of the next
    other = dropout.reference_draw(x, torch.tensor([12346]), p)[0] == 0
    near((gone & other).float().mean().item(), p * p, n)


def called_ops(gm) -> list[str]:
    """The ops an ATen graph calls, by name; an in-place op functionalised (auto_functionalized) by its own name."""
    return [str(node.args[0] if "auto_functionalized" in str(node.target) else node.target)
            for node in gm.graph.nodes if node.op == "call_function"]


def projection(tiny_model_dir, p: float):
    model = quantized_lora_model(tiny_model_dir, torch.float32, dropout=p)
    lora_kernel.use_fused_lora(model)
    return model.get_base_model().model.layers[0].mlp.down_proj


@pytest.mark.parametrize("how,backward_kernels", [("product", False), ("op", False), ("product", True)])
def test_a_compiled_layer_drops_through_its_op_and_trains_through_that_mask(tiny_model_dir, how, backward_kernels,
                                                                            monkeypatch):
    """Traced into a compiled layer (how="product", the default), a fused projection's dropout is one
    freetune::dropped_product call (bench's dropout_op: freetune::dropout_packed), no other random draw but its
    seed's; its backward unpacks the mask's bits for inductor's code (bench's dropout_backward_kernels: reads them
    in freetune::dropped_grad_a_parts and freetune::add_dropped_product_, never unpacked). Its output and gradients
    are those of plain tensor code over the mask reference_draw draws from the seed that torch's generator gives at
    that point (forward and backward: one mask)."""
    import bitsandbytes.functional as bnbf

    monkeypatch.setattr(dropout, "_DRAW", {"how": how})
    monkeypatch.setattr(dropout, "_BACKWARD", {"kernels": backward_kernels})
    p = 0.3
    layer = projection(tiny_model_dir, p)
    name = layer.active_adapters[0]
    a, b, s = layer.lora_A[name].weight, layer.lora_B[name].weight, layer.scaling[name]
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(2)).to(a.device).requires_grad_()

    torch.manual_seed(7)
    graphs, out = aten_graphs(layer, x)  # out.sum().backward() inside
    got = (out.detach(), x.grad.clone(), a.grad.clone(), b.grad.clone())
    targets = [str(node.target) for node in graphs["forward"].graph.nodes if node.op == "call_function"]
    backward = called_ops(graphs["backward"])
    # the op and its seed's draw, no other random draw or dropout
    op = {"product": "freetune.dropped_product.default", "op": "freetune.dropout_packed.default"}[how]
    assert sorted(t for t in targets if "rand" in t or "drop" in t) == ["aten.randint.low", op]
    ops = ["freetune.add_dropped_product_.default", "freetune.dropped_grad_a_parts.default"]
    assert sorted(t for t in backward if t.startswith("freetune") and "drop" in t) == (ops if backward_kernels else [])
    assert ("aten.bitwise_right_shift.Tensor" in backward) != backward_kernels  # the bits unpacked or never
    x.grad = a.grad = b.grad = None

    torch.manual_seed(7)
    seed = torch.randint(0, 2**62, (1,), device=a.device)  # the draw the graph made first (a GPU: its generator)
    x2 = x.detach().reshape(-1, layer.in_features).requires_grad_()
    dropped, bits = dropout.reference_draw(x2, seed, p)
    kept = lora_kernel.unpack_mask(bits, layer.in_features, torch.float32)
    assert 0.55 < kept.mean().item() < 0.85
    w = bnbf.dequantize_4bit(layer.base_layer.weight, layer.base_layer.weight.quant_state)
    ref = x2 @ w.t() + s * ((x2 * kept / (1 - p)) @ a.t()) @ b.t()
    ref.sum().backward()
    want = (ref.detach().reshape(out.shape), x2.grad.reshape(x.shape), a.grad, b.grad)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("how", ["product", "inductor"])
def test_a_checkpointed_compiled_layer_draws_the_same_mask_in_its_recompute(tiny_model_dir, how, monkeypatch):
    """Under non-reentrant checkpointing (the plans' recompute) the compiled layer runs its forward again for the
    backward; torch restores the generator's state for it, so the op's seed and its mask are the forward's: the same
    output and gradients as without checkpointing from the same generator state (a new draw would give other
    gradients, as a new seed does below). how="inductor": inductor's dropout (bench's dropout_inductor) holds the
    same."""
    import torch._dynamo
    from torch.utils.checkpoint import checkpoint

    monkeypatch.setattr(dropout, "_DRAW", {"how": how})
    layer = projection(tiny_model_dir, 0.3)
    a = layer.lora_A[layer.active_adapters[0]].weight
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(2)).to(a.device).requires_grad_()
    compiled = torch.compile(layer, fullgraph=True)
    torch._dynamo.reset()
    try:
        runs = {}
        for run, seed in (("plain", 7), ("checkpointed", 7), ("other seed", 8)):
            torch.manual_seed(seed)
            out = checkpoint(compiled, x, use_reentrant=False) if run == "checkpointed" else compiled(x)
            (out * out).sum().backward()
            runs[run] = (out.detach(), x.grad.clone(), a.grad.clone())
            x.grad = a.grad = None
    finally:
        torch._dynamo.reset()
    for got, want in zip(runs["checkpointed"], runs["plain"]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(runs["other seed"][2], runs["plain"][2])


def test_the_traced_mlps_backward_through_the_dropout_kernels_ops_gives_its_gradients(tiny_model_dir, monkeypatch):
    """The traced MLP compiled (its gate's and up's LoRA gradients and input gradient from dropout's bits): with the
    backward's dropout ops (bench's dropout_backward_kernels; their torch bodies on a CPU) its backward graph calls
    freetune::dropped_grad_a_parts and freetune::add_dropped_product_ once for gate and once for up, and the output and
    gradients are the default's, drawn from the same generator state (in place: the input gradient's term added to
    the projection's own gradient, not to a copy)."""
    from test_fused_mlp import fused_model

    model = fused_model(tiny_model_dir, torch.float32, chunk=18, dropout=0.3, kernel="traced")
    mlp = model.get_base_model().model.layers[0].mlp
    params = [getattr(mlp, name).lora_A[mlp.gate_proj.active_adapters[0]].weight for name in ("gate_proj", "up_proj")]
    x = torch.randn(2, 9, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(2))
    x = x.to(params[0].device).requires_grad_()  # a GPU machine loads the 4-bit model there
    runs = {}
    for backward_kernels in (False, True):
        monkeypatch.setattr(dropout, "_BACKWARD", {"kernels": backward_kernels})
        torch.manual_seed(7)
        graphs, out = aten_graphs(mlp, x)  # out.sum().backward() inside
        runs[backward_kernels] = [out.detach(), x.grad.clone()] + [t.grad.clone() for t in params]
        x.grad = None
        for t in params:
            t.grad = None
        backward = called_ops(graphs["backward"])
        ops = sorted(t for t in backward if t in ("freetune.dropped_grad_a_parts.default",
                                                   "freetune.add_dropped_product_.default"))
        assert ops == (["freetune.add_dropped_product_.default"] * 2 + ["freetune.dropped_grad_a_parts.default"] * 2
                       if backward_kernels else [])
    assert runs[True][2].abs().sum() > 0
    for got, want in zip(runs[True], runs[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
