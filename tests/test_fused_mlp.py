"""freetune.speed.mlp: the SwiGLU MLP over three fused 4-bit LoRA layers as one op in token chunks computes what peft's
three layers compute, keeps no (tokens x intermediate) tensor for its backward, and compiles into the decoder layer.

Real bitsandbytes NF4 weights and peft adapters on a CPU (the same code a GPU runs, CPU kernels underneath)."""

import pytest
import torch

from freetune.plan import ModelShape, estimate

from freetune.plan.memory import keeps_8bit_absmax
from freetune.plan import Hardware
from freetune.speed import compiled_layers, lora_kernel, mlp_ops
from freetune.speed import mlp as fused_mlp  # not `mlp`: the tests name a model's MLP module that
from test_kernels import gpu, loss_and_grads, quantized_lora_model


def fused_model(model_dir, dtype, chunk, dropout=0.0, kernel="chunked"):
    model = quantized_lora_model(model_dir, dtype, dropout=dropout)
    lora_kernel.use_fused_lora(model)
    fused, seen = fused_mlp.use_fused_mlp(model, chunk=chunk, kernel=kernel)
    assert fused == seen == len(model.get_base_model().model.layers)
    assert fused_mlp.use_fused_mlp(model, chunk=chunk, kernel=kernel) == (fused, seen)  # idempotent
    return model


@pytest.mark.parametrize("kernel", ["chunked", "traced"])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_the_fused_mlp_gives_peft_loss_and_gradients(tiny_model_dir, dtype, tolerance, kernel):
    """64 tokens (chunked: in chunks of 24, the last one shorter; traced: one autograd node): the loss and every adapter
    weight's gradient as peft's layers give them (fp32: up to summation order; bf16: rounding in another order)."""
    ids = torch.randint(3, 500, (1, 64), generator=torch.Generator().manual_seed(1))
    autocast = dtype if dtype != torch.float32 else None
    want = loss_and_grads(quantized_lora_model(tiny_model_dir, dtype), ids, autocast)
    got = loss_and_grads(fused_model(tiny_model_dir, dtype, chunk=24, kernel=kernel), ids, autocast)
    assert got[0] == pytest.approx(want[0], rel=1e-5 if dtype == torch.float32 else 1e-3)
    assert got[1].keys() == want[1].keys()
    errors = sorted(((got[1][n] - g).norm() / g.norm()).item() for n, g in want[1].items())
    assert errors[-1] < tolerance, errors[-5:]


@pytest.mark.parametrize("kernel, chunk", [("chunked", 5), ("traced", 18)])
def test_dropout_drops_the_same_inputs_in_the_forward_and_the_backward(tiny_model_dir, kernel, chunk, monkeypatch):
    """With dropout the op draws each chunk's masks (gate's and up's over x, down's over the activation; the traced
    function: all 18 tokens at once, its backward's op then in chunks of 5) and must use the same ones for the
    gradients, read back from their bits. The reference draws the same masks (same seed, same kernel, same order) and
    differentiates plain tensor code with autograd."""
    import bitsandbytes.functional as bnbf

    monkeypatch.setattr(mlp_ops, "CHUNK_TOKENS", 5)  # the traced function's backward chunks (the op's: `chunk`)
    p = 0.3
    model = fused_model(tiny_model_dir, torch.float32, chunk=chunk, dropout=p, kernel=kernel)
    mlp = model.get_base_model().model.layers[0].mlp
    x = torch.randn(2, 9, mlp.gate_proj.in_features, generator=torch.Generator().manual_seed(2))
    dy = torch.randn(2, 9, mlp.down_proj.out_features, generator=torch.Generator().manual_seed(3))
    adapters = {}
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(mlp, name)
        key = layer.active_adapters[0]
        weight = bnbf.dequantize_4bit(layer.base_layer.weight, layer.base_layer.weight.quant_state)
        adapters[name] = (weight, layer.lora_A[key].weight, layer.lora_B[key].weight, layer.scaling[key])

    x1 = x.clone().requires_grad_()
    torch.manual_seed(7)
    y = mlp(x1)
    (y * dy).sum().backward()
    params = [t for name in adapters for t in adapters[name][1:3]]
    got = [y.detach(), x1.grad] + [t.grad.clone() for t in params]
    for t in params:
        t.grad = None

    def project(inp, name):
        w, a, b, s = adapters[name]
        dropped, mask = torch.native_dropout(inp, p, True)
        return inp @ w.t() + s * (dropped @ a.t()) @ b.t(), mask

    x2 = x.clone().requires_grad_()
    torch.manual_seed(7)
    rows, kept = [], []
    for part in x2.reshape(-1, x.shape[-1]).split(chunk):
        g, mg = project(part, "gate_proj")
        u, mu = project(part, "up_proj")
        out, md = project(torch.nn.functional.silu(g) * u, "down_proj")
        rows.append(out)
        kept += [mg.float().mean(), md.float().mean()]
    ref = torch.cat(rows).reshape(2, 9, -1)
    (ref * dy).sum().backward()
    want = [ref.detach(), x2.grad] + [t.grad for t in params]

    for g, r in zip(got, want):
        assert torch.allclose(g, r, rtol=1e-4, atol=1e-5), (g - r).abs().max()
    assert 0.55 < torch.stack(kept).mean().item() < 0.85  # about 1 - p of the inputs reach the adapters


@pytest.mark.parametrize("kernel", ["chunked", "traced"])
def test_the_mlp_keeps_no_tokens_by_intermediate_tensor_for_its_backward(tiny_model_dir, kernel):
    """What autograd keeps of one MLP for its backward: with the fused projections, their gate and up outputs and the
    activation (tokens x intermediate each); with the chunked op or the traced function, nothing that wide: its
    input, the LoRA-A outputs (tokens x r) and the masks as bits."""
    model = quantized_lora_model(tiny_model_dir, torch.float32, dropout=0.1)
    lora_kernel.use_fused_lora(model)
    mlp = model.get_base_model().model.layers[0].mlp
    inter, tokens = mlp.gate_proj.out_features, 12
    x = torch.randn(1, tokens, mlp.gate_proj.in_features, requires_grad=True)

    def saved_shapes():
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append((tuple(t.shape), t.dtype)) or t,
                                                      lambda t: t):
            y = mlp(x)
        y.sum().backward()
        return saved

    def wide(saved):
        return [s for s in saved if s[0][-1] == inter and s[0][0] in (tokens, 1) and s[1] != torch.uint8]

    assert len(wide(saved_shapes())) >= 2  # the per-projection path
    fused_mlp.use_fused_mlp(model, chunk=5, kernel=kernel)
    saved = saved_shapes()
    assert wide(saved) == [], wide(saved)
    assert ((tokens, -(-inter // 8)), torch.uint8) in saved  # the down projection's mask, as bits
    model.eval()  # generation: the module's own forward (bitsandbytes' inference kernels)
    with torch.no_grad():
        assert torch.equal(mlp(x), type(mlp).forward(mlp, x))


@pytest.mark.parametrize("kernel", ["chunked", "traced"])
def test_a_compiled_checkpointed_layer_with_the_fused_mlp_trains_like_an_eager_one(tiny_model_dir, kernel):
    """The op (or the traced function and the op its backward calls) inside compile_layers' decoder layers (aot_eager:
    dynamo and the autograd graph as inductor sees them), under gradient checkpointing (the plan uses it only there),
    the absmax values 8-bit where the plan keeps them so (the traced MLP), over two lengths: same loss and gradients
    as eager fp32-absmax layers, one graph per layer kind and no graph break."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    models = []
    for keep_8bit in (False, keeps_8bit_absmax("fused", True, kernel)):  # the compiled one as the plan has it
        model = quantized_lora_model(tiny_model_dir, torch.float32)
        model.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
        lora_kernel.use_fused_lora(model, keep_8bit_absmax=keep_8bit)
        fused_mlp.use_fused_mlp(model, chunk=16, kernel=kernel)
        models.append(model)
    eager, compiled = models
    torch._dynamo.reset()
    counters.clear()
    compiled_layers.compile_layers(compiled, backend="aot_eager")
    torch._dynamo.config.suppress_errors = False
    try:
        for length in (40, 48):
            ids = torch.randint(3, 500, (1, length), generator=torch.Generator().manual_seed(length))
            want, got = loss_and_grads(eager, ids), loss_and_grads(compiled, ids)
            assert got[0] == pytest.approx(want[0], rel=1e-5)
            for name, grad in want[1].items():
                assert torch.allclose(got[1][name], grad, rtol=1e-3, atol=1e-6), name
            eager.zero_grad()
            compiled.zero_grad()
        assert counters["stats"]["unique_graphs"] in (1, 2)
        assert not counters["graph_break"], dict(counters["graph_break"])
    finally:
        torch._dynamo.reset()
        compiled_layers.uncompile_layers(compiled)


def test_the_plan_takes_the_traced_mlp_where_every_layer_is_checkpointed_and_chunks_only_rows_that_would_not_fit():
    """Every layer checkpointed (a small budget): the traced MLP (2 instead of 7 tokens x intermediate tensors in a
    layer's backward, for two more matmuls); the chunked op, host-bound, only where even one row of max_length would
    not fit otherwise, instead of cutting the rows; the per-projection MLP where layers keep their activations."""
    from freetune.plan import make_plan

    t4 = gpu("Tesla T4", (7, 5), 14.7)
    small = make_plan(t4, model_shape="tinyllama-1.1b", memory_budget_gib=4.0)
    assert small.memory.checkpointing_text().startswith("on") and small.kernels.mlp == "traced"
    assert small.memory.estimate.settings["mlp_kernel"] == "traced" and "MLP kernel" in small.table()
    assert "2 instead of 7" in small.reasons["mlp_kernel"]
    assert small.kernels.loss_tile_tokens == 1024 and small.memory.estimate.settings["loss_tile_tokens"] == 1024
    long_rows = make_plan(t4, model_shape="qwen2.5-1.5b", max_length=32768, memory_budget_gib=4.0)
    assert long_rows.kernels.mlp == "chunked" and long_rows.memory.estimate.settings["mlp_kernel"] == "chunked"
    assert long_rows.batch.max_length == 32768 and long_rows.memory.estimate.fits  # the rows are not cut
    assert "rows need not be cut" in long_rows.reasons["mlp_kernel"]
    roomy = make_plan(t4, model_shape="qwen2.5-1.5b")
    assert roomy.kernels.mlp == "layers" and roomy.kernels.loss_tile_tokens == 0  # room for some layers unchecked
    cpu = make_plan(Hardware(ram_total_gib=16.0, ram_available_gib=12.0), model_shape="qwen3-8b", max_length=32768)
    assert cpu.kernels.mlp == "layers"  # peft's layers on a CPU: nothing to fuse

    shape = ModelShape.named("tinyllama-1.1b")
    common = dict(max_length=1024, micro_batch=8, lora_kernel="fused", compiled=True, compute_dtype="float16",
                  frozen_dtype="float16", gradient_checkpointing=True, offload_activations=True, loss_tile_tokens=1024)
    layers, traced, chunked = (estimate(shape, **common, mlp_kernel=k) for k in ("layers", "traced", "chunked"))
    mib = 2**20
    # One layer's backward at 8,192 tokens: each tokens x intermediate tensor is 88 MiB; the traced function holds
    # five fewer than the per-projection MLP (less its two fixed chunks and a weight), the chunked op fewer still.
    saved_traced = (layers.activations_gib - traced.activations_gib) * 2**30 / mib
    saved_chunked = (layers.activations_gib - chunked.activations_gib) * 2**30 / mib
    assert 150 < saved_traced < saved_chunked < 600, (saved_traced, saved_chunked)
    assert traced.settings["mlp_kernel"] == "traced" and chunked.settings["mlp_kernel"] == "chunked"
    # The loss head's tile of 1,024 instead of TRL's 4,096 tokens x 32,000 logits (fp16): 3,072 x 32,000 x 2 bytes less.
    trl_tile = estimate(shape, **{**common, "loss_tile_tokens": 0}, mlp_kernel="traced")
    assert (trl_tile.loss_head_gib - traced.loss_head_gib) * 2**30 == 3072 * 32000 * 2
