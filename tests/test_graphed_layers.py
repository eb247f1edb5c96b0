"""freetune.speed.cuda_graphs: freetune's own checkpoint of the decoder layers, replayed as CUDA graphs on a GPU.

On a CPU the same checkpoint runs without graphs (the buffers, the stored inputs, the padded row boundaries and the
16-bit LoRA weights' buffers all as on a GPU): its loss and gradients are transformers' checkpoint's. On a GPU the
graphs are recorded at the second batch of a token count and replayed after: the losses and gradients are those of
the same compiled layers under transformers' checkpoint.
"""

import pytest
import torch

import torch.utils._python_dispatch

from freetune.speed import batching, compiled_layers, cuda_graphs, lora_kernel, recompute
from freetune.speed import mlp as fused_mlp  # not `mlp`: the recompute test names a model's MLP module so
from test_kernels import quantized_lora_model


def packed_batch(lengths, pad_to, max_row, vocab=500, seed=0, device="cpu"):
    """A padding-free batch as TRL's collator and batching.AlignedPaddingFree make it: rows of `lengths` tokens, then
    padding rows (labels -100) up to a multiple of pad_to tokens, none longer than max_row."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    generator = torch.Generator().manual_seed(seed)
    rows = [{"input_ids": torch.randint(3, vocab, (n,), generator=generator).tolist()} for n in lengths]
    collator = batching.AlignedPaddingFree(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),
                                           multiple=pad_to, max_row=max_row)
    batch = collator(rows)
    batch.pop(batching.PAD_KEY)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def test_a_collator_without_row_boundaries_gets_them_from_the_positions_as_trl_116_gives_them():
    """TRL 1.15's padding-free collator gives no cu_seq_lens (1.16's does): freetune's attention then fell back to sdpa
    with a dense block-diagonal mask, 3.7x slower on an H200. AlignedPaddingFree adds them from the restarting
    position_ids; here equal to what TRL 1.16's own collator computes, with and without the alignment's padding."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    keys = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
    trl_116 = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)

    def like_trl_115(examples):
        return {k: v for k, v in trl_116(examples).items() if k not in keys + ("seq_idx",)}

    like_trl_115.pad_token_id = 0
    rows = [{"input_ids": list(range(3, 3 + n))} for n in (30, 50, 20)]
    for multiple in (batching.PAD_TO, 256):
        want = batching.AlignedPaddingFree(trl_116, multiple=multiple, max_row=64)(rows)
        got = batching.AlignedPaddingFree(like_trl_115, multiple=multiple, max_row=64)(rows)
        assert [got[k].tolist() if isinstance(got[k], torch.Tensor) else got[k] for k in keys] == [
            want[k].tolist() if isinstance(want[k], torch.Tensor) else want[k] for k in keys]
        assert got["cu_seq_lens_q"].dtype == want["cu_seq_lens_q"].dtype == torch.int32
    assert got["cu_seq_lens_q"].tolist() == [0, 30, 80, 100, 164, 228, 256]


def test_padding_free_batches_pad_to_a_fixed_length_in_rows_no_longer_than_max_row():
    batch = packed_batch([30, 50, 20], pad_to=256, max_row=64)
    assert batch["input_ids"].shape == (1, 256)
    pad_rows = batching.pad_rows(256 - 100, 64)
    assert pad_rows == [64, 64, 28]
    cu = batch["cu_seq_lens_q"].tolist()
    assert cu == [0, 30, 80, 100, 164, 228, 256]
    assert batch["max_length_q"] == 64
    positions = batch["position_ids"][0].tolist()
    assert positions[100:164] == list(range(64)) and positions[228:] == list(range(28))
    assert (batch["labels"][0, 100:] == -100).all() and (batch["labels"][0, 1:30] != -100).all()
    assert batching.most_rows(3, 256, 64) == 3 + 4  # 255 padding tokens at most: four rows
    assert len(cu) - 1 <= batching.most_rows(3, 256, 64)
    # Without max_row the padding stays one row (the default, alignment to 8).
    assert batching.pad_rows(5) == [5] and batching.pad_rows(130, 64) == [64, 64, 2]


def graphed_model(model_dir, dtype, device="cpu", graphs=True, max_tokens=256, max_row=64, max_rows=8,
                  same_buffers=True):
    model = quantized_lora_model(model_dir, dtype).to(device)
    model.get_base_model().gradient_checkpointing_enable({"use_reentrant": False})
    lora_kernel.use_fused_lora(model)
    assert lora_kernel.cast_adapters_once_per_forward(model, same_buffers=same_buffers) is not None
    graphed = cuda_graphs.GraphedLayers(model, max_tokens=max_tokens, max_row=max_row, max_rows=max_rows,
                                           graphs=graphs, fixed_pairs=True)
    return model, graphed


def step(model, batch, autocast_dtype=None):
    device = batch["input_ids"].device.type
    with torch.autocast(device, dtype=autocast_dtype, enabled=autocast_dtype is not None):
        out = model(**batch)
    out.loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    return out.loss.item(), grads


def test_the_checkpoint_trains_like_transformers_checkpoint_on_a_cpu(tiny_model_dir):
    """Three batches, the second and third of the same length (what records and replays graphs on a GPU): every
    loss and gradient equals transformers' checkpoint's on the same model. Layer i's input buffer is overwritten by
    layer i + 1's output, so a gradient comes out right only if the stored inputs came back."""
    reference, _ = graphed_model(tiny_model_dir, torch.float32, same_buffers=False)  # as without graphs
    model, graphed = graphed_model(tiny_model_dir, torch.float32)
    layers = cuda_graphs.decoder_layers(model)
    transformers_own = [layer._gradient_checkpointing_func for layer in layers]
    assert graphed.install() == len(layers) > 1
    assert all(layer._gradient_checkpointing_func.func == graphed._checkpoint for layer in layers)
    for seed, lengths in enumerate([(40, 70, 30), (64, 64, 20, 12), (10, 90, 33)]):
        batch = packed_batch(lengths, pad_to=256, max_row=64, seed=seed)
        want = step(reference, batch)
        got = step(model, batch)
        assert got[0] == pytest.approx(want[0], rel=1e-6)
        assert got[1].keys() == want[1].keys()
        for name, grad in want[1].items():
            assert torch.allclose(got[1][name], grad, rtol=1e-4, atol=1e-7), name
    assert sorted(graphed.shapes) == [256] and graphed.shapes[256].batches == 3
    # The row boundaries were padded with empty rows to the fixed count, the longest row set to max_row.
    rows = graphed.shapes[256].kwargs["cu_seq_lens_q"]
    assert rows.tolist() == [0, 10, 100, 133, 197, 256, 256, 256, 256]
    assert graphed.shapes[256].kwargs["max_length_q"] == 64
    assert graphed.recorded == 0  # no graphs without a GPU
    # An evaluation forward (no gradient) and removal leave transformers' checkpoint in place.
    model.eval()
    with torch.no_grad():
        model(**packed_batch((20, 30), pad_to=256, max_row=64))
    model.train()
    graphed.remove()
    assert [layer._gradient_checkpointing_func for layer in layers] == transformers_own


def test_a_batch_shorter_than_max_length_gives_the_layers_its_token_count_as_the_longest_row(tiny_model_dir):
    """Rows of 150-500 tokens, 2 a batch, padded to multiples of 256 against max_length 1,024 (Qwen3-8B planned for
    Unsloth's memory, issue 49): the longest row the layers get is the batch's token count where that is shorter than
    max_length (the GPU's memory-efficient kernel refuses a longer one: "Invalid max_seqlen_k:1024"), and the step
    still trains as under transformers' checkpoint."""
    reference, _ = graphed_model(tiny_model_dir, torch.float32, same_buffers=False)
    model, graphed = graphed_model(tiny_model_dir, torch.float32, max_tokens=1024, max_row=1024)
    graphed.install()
    for seed, lengths in enumerate([(150, 90), (300, 400), (120, 100)]):
        batch = packed_batch(lengths, pad_to=256, max_row=1024, seed=seed)
        want, got = step(reference, batch), step(model, batch)
        assert got[0] == pytest.approx(want[0], rel=1e-6)
        for name, grad in want[1].items():
            assert torch.allclose(got[1][name], grad, rtol=1e-4, atol=1e-7), name
    assert sorted(graphed.shapes) == [256, 768]
    assert [graphed.shapes[n].kwargs["max_length_q"] for n in (256, 768)] == [256, 768]


class BaseWeightMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the matmuls that read a whole MLP weight (an operand of intermediate x hidden or its transpose: the
    4-bit weight dequantised), outside custom ops (whose inner matmuls the mode does not see; both runs below call
    the same ones the same number of times)."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.shape, self.count = {hidden, inter}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            if any(isinstance(a, torch.Tensor) and a.dim() == 2 and set(a.shape) == self.shape for a in args):
                self.count += 1
        return func(*args, **(kwargs or {}))


def test_the_recompute_skips_the_traced_mlps_output_and_trains_the_same(tiny_model_dir):
    """In freetune's checkpoint the recompute's output is thrown away, so the traced MLP computes there only the
    LoRA-A outputs its backward reads: three fewer 4-bit matmuls per layer (gate, up, down) than under transformers'
    checkpoint, where the recompute runs the whole MLP; the loss and every gradient are the same (d B of the down
    projection then comes from the backward's own activation)."""
    models = []
    for _ in range(2):
        model, graphed = graphed_model(tiny_model_dir, torch.float32, same_buffers=False)
        assert fused_mlp.use_fused_mlp(model, kernel="traced")[0] == len(cuda_graphs.decoder_layers(model))
        models.append((model, graphed))
    (reference, _), (model, graphed) = models
    assert graphed.install() == len(cuda_graphs.decoder_layers(model))
    mlp = model.get_base_model().model.layers[0].mlp
    hidden, inter = mlp.gate_proj.in_features, mlp.gate_proj.out_features
    for seed, lengths in enumerate([(40, 70, 30), (64, 64, 20, 12)]):
        batch = packed_batch(lengths, pad_to=256, max_row=64, seed=seed)
        counted = []
        for m in (reference, model):
            with BaseWeightMatmuls(hidden, inter) as matmuls:
                result = step(m, batch)
            counted.append((result, matmuls.count))
        (want, want_count), (got, got_count) = counted
        assert got[0] == pytest.approx(want[0], rel=1e-6)
        for name, grad in want[1].items():
            assert torch.allclose(got[1][name], grad, rtol=1e-4, atol=1e-7), name
        layers = len(cuda_graphs.decoder_layers(model))
        assert want_count - got_count == 3 * layers, (want_count, got_count)
    assert not recompute.RECOMPUTING  # set only while a recompute runs


def test_a_batch_with_more_rows_than_the_buffers_hold_is_refused_with_the_count(tiny_model_dir):
    model, graphed = graphed_model(tiny_model_dir, torch.float32, max_rows=3)
    graphed.install()
    with pytest.raises(ValueError, match="6 rows in one batch, more than the 3"):
        step(model, packed_batch((40, 40, 40), pad_to=256, max_row=64))


def test_where_the_graphs_do_not_apply_the_run_is_told_why(tiny_model_dir):
    from freetune.plan import Plan

    model, _ = graphed_model(tiny_model_dir, torch.float32)
    plan = Plan.build(device="cuda", batching="padding_free", gradient_checkpointing=True, checkpoint_every=1)
    assert cuda_graphs.why_not(model, plan, world_size=1, cast_once=True) is None
    assert cuda_graphs.why_not(model, plan, world_size=2, cast_once=False) == (
        "more than one process; LoRA weights not cast once per forward (fused LoRA layers in one process)")
    dropout = quantized_lora_model(tiny_model_dir, torch.float32, dropout=0.05)
    assert "dropout 0.05" in cuda_graphs.why_not(dropout, plan, world_size=1, cast_once=True)
    cpu = Plan.build(device="cpu", batching="padded", gradient_checkpointing=True, checkpoint_every=2)
    assert cuda_graphs.why_not(model, cpu, 1, True) == (
        "no GPU; batches that are not padding-free; not every decoder layer checkpointed")


def gpu_plan(memory_gib, **asked):
    from freetune.plan import GPU, Hardware, make_plan

    gpu = GPU(name="NVIDIA T4", capability=(7, 5), memory_gib=memory_gib)
    hardware = Hardware(gpus=[gpu], torch="2.13.0", cuda="12.8", arch_list=["sm_75"])
    return make_plan(hardware, model_shape="TinyLlama/TinyLlama-1.1B-Chat-v1.0", grad_accum=8, **asked)


def test_the_plan_replays_the_layers_as_graphs_where_every_layer_is_checkpointed_and_dropout_is_off(monkeypatch):
    """A 4 GiB plan for TinyLlama on a T4 (every layer checkpointed, padding-free rows): CUDA graphs, batches in
    eighths of the largest, 8-bit AdamW and smaller loss tiles paying for the graphs' buffers, which the memory
    estimate counts; the buffers hold the batches of the data's longest row. With dropout, or with the whole batch
    fitting without checkpointing, no graphs and the optimizer as before."""
    from freetune.plan import memory, sizing
    from freetune.speed import attention
    from freetune.plan.decisions import resolve_shape

    # The variable-length kernel's probe needs a GPU: here it is taken as passed, as on a T4.
    monkeypatch.setattr(attention, "varlen_works", lambda device, policy="ampere": (True, "probed by the test"))
    monkeypatch.setattr(attention, "varlen_backend", lambda device: "efficient")

    plan = gpu_plan(4, memory_budget_gib=4, lora_dropout=0.0)
    assert plan.memory.checkpointing and plan.memory.checkpoint_every == 1 and plan.batch.batching == "padding_free"
    assert plan.kernels.cuda_graph_tokens == sizing.graph_tokens(plan.batch.micro_batch, plan.batch.max_length) == 1024
    assert plan.memory.optimizer == "adamw_8bit" and plan.kernels.loss_tile_tokens == sizing.GRAPHS_LOSS_TILE_TOKENS
    assert (plan.kernels.cuda_graph_max_tokens, plan.batch.micro_batch) == (8 * 1024, 8)
    table = dict((c, v) for c, v, _ in plan.rows())
    assert table["CUDA graphs"] == "per layer, batches in multiples of 1024 tokens up to 8192"
    # rows of at most 600 tokens (replan's longest_row): buffers for 8 x 600 tokens in multiples of 640, not 8 x 1,024
    short = gpu_plan(4, memory_budget_gib=4, lora_dropout=0.0, longest_row=600)
    assert (short.batch.max_length, short.kernels.cuda_graph_tokens, short.kernels.cuda_graph_max_tokens) == (
        1024, 640, 5120)
    shape = resolve_shape("TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    settings = {k: v for k, v in plan.memory.estimate.settings.items() if k != "model"}
    assert settings["cuda_graphs"]
    with_graphs = memory.estimate(shape, **settings)
    without = memory.estimate(shape, **{**settings, "cuda_graphs": False})
    buffers = 3 * plan.batch.micro_batch * plan.batch.max_length * shape.hidden * 2 / 2**30
    # without them the backward dequantises in the compiled graphs: one layer's 16-bit weights (memory.estimate)
    in_graph = shape.quantized_params // shape.layers * 2 / 2**30
    assert with_graphs.activations_gib - without.activations_gib == pytest.approx(buffers - in_graph)

    dropout = gpu_plan(4, memory_budget_gib=4, lora_dropout=0.05)
    assert dropout.kernels.cuda_graph_tokens == 0 and dropout.memory.optimizer == "adamw_torch_fused"
    assert "LoRA dropout 0" in dropout.reasons["cuda_graphs"]
    roomy = gpu_plan(80, lora_dropout=0.0, gradient_checkpointing="off")
    assert roomy.kernels.cuda_graph_tokens == 0 and "every layer checkpointed" in roomy.reasons["cuda_graphs"]
    assert gpu_plan(4, memory_budget_gib=4, optimizer="adamw_torch_fused").memory.optimizer == "adamw_torch_fused"
    # A budget where fp32 state is too large a share (bench.py's plan at Unsloth's peak + 5%): paged 8-bit AdamW without
    # the graphs, the one-launch 8-bit AdamW with them (the estimate counts both at 2 bytes per LoRA value).
    tight = gpu_plan(14.5, memory_budget_gib=2.0, lora_dropout=0.0)
    tight_dropout = gpu_plan(14.5, memory_budget_gib=2.0, lora_dropout=0.05)
    assert tight.kernels.cuda_graph_tokens and tight.memory.optimizer == "adamw_8bit"
    assert "not paged" in tight.reasons["optimizer"]
    assert tight_dropout.kernels.cuda_graph_tokens == 0 and tight_dropout.memory.optimizer == "paged_adamw_8bit"
    assert tight.memory.estimate.optimizer_gib == pytest.approx(tight_dropout.memory.estimate.optimizer_gib)
    asked = gpu_plan(14.5, memory_budget_gib=2.0, lora_dropout=0.0, optimizer="paged_adamw_8bit")
    assert asked.kernels.cuda_graph_tokens and asked.memory.optimizer == "paged_adamw_8bit"  # as given


def test_the_t4_attention_takes_every_head_in_one_call_where_the_plan_has_room_for_the_copies(monkeypatch):
    """Issue 49: on a T4 (the memory-efficient kernel) the plan puts a layer's grouped-query heads through one kernel
    call where the batch it chose still fits with k and v copied for every q head (their gradients and the kernel's
    fp32 dq accumulator for all heads too), and counts them in the estimate; where they would not fit, a kv head at a
    time with the same batch. FlashAttention (sm80+) takes grouped heads itself: nothing to decide."""
    from dataclasses import replace

    from freetune.plan import GPU, Hardware, make_plan, memory
    from freetune.plan.decisions import resolve_shape
    from freetune.speed import attention

    monkeypatch.setattr(attention, "varlen_works", lambda device, policy="ampere": (True, "probed by the test"))
    monkeypatch.setattr(attention, "varlen_backend", lambda device: "efficient")
    shape = resolve_shape("TinyLlama/TinyLlama-1.1B-Chat-v1.0")  # 32 q heads, 4 kv heads of 64
    # k and v for 32 heads (2 x 2 bytes), 3/4 more of their gradients (2 x 2) and of the fp32 dq accumulator (4)
    assert memory.whole_heads_attention_bytes(shape, "float16") == 2048 * (4 + 8 * 0.75) == 20480
    assert memory.whole_heads_attention_bytes(replace(shape, kv_heads=shape.heads), "float16") == 0

    roomy = gpu_plan(4, memory_budget_gib=4, lora_dropout=0.0)
    assert roomy.kernels.attention_whole_heads and roomy.batch.micro_batch == 8
    assert "32 q heads in one call" in roomy.reasons["attention"]
    assert dict((c, v) for c, v, _ in roomy.rows())["attention"] == "freetune_varlen, heads in one call"
    settings = {k: v for k, v in roomy.memory.estimate.settings.items() if k != "model"}
    assert settings["attention_whole_heads"]
    without = memory.estimate(shape, **{**settings, "attention_whole_heads": False})
    assert (roomy.memory.estimate.peak_allocated_gib - without.peak_allocated_gib) * 2**30 == pytest.approx(
        8 * 1024 * 20480)

    tight = gpu_plan(4, memory_budget_gib=without.total_gib + 0.05, lora_dropout=0.0)
    assert not tight.kernels.attention_whole_heads and tight.batch.micro_batch == 8
    assert "a kv head at a time" in tight.reasons["attention"]
    assert tight.memory.estimate.total_gib == pytest.approx(without.total_gib)
    assert not tight.memory.estimate.settings["attention_whole_heads"]

    monkeypatch.setattr(attention, "varlen_backend", lambda device: "flash")
    hardware = Hardware(gpus=[GPU(name="NVIDIA L4", capability=(8, 9), memory_gib=4)], torch="2.13.0", cuda="12.8",
                        arch_list=["sm_89"])
    flash = make_plan(hardware, model_shape="TinyLlama/TinyLlama-1.1B-Chat-v1.0", grad_accum=8, lora_dropout=0.0)
    assert flash.batch.batching == "padding_free" and not flash.kernels.attention_whole_heads
    assert "one call" not in flash.reasons["attention"]


def test_the_graphs_multiple_is_an_eighth_of_the_largest_batch_in_steps_of_64():
    from freetune.plan.sizing import graph_tokens

    assert graph_tokens(8, 1024) == 1024 and graph_tokens(8, 2048) == 2048
    assert graph_tokens(4, 1000) == 512 and graph_tokens(1, 512) == 256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_graphs_replay_what_transformers_checkpoint_computes_on_a_gpu(tiny_model_dir):
    """Compiled layers (inductor) in fp16 autocast under transformers' checkpoint, and the same under this one: the
    first batch runs without graphs, the next of each token count (256 or 512) records them, the later ones replay
    them; every loss and gradient agrees (fp16: to its rounding), batches with fewer rows (empty rows padded) too."""
    torch.manual_seed(0)
    reference, _ = graphed_model(tiny_model_dir, torch.float16, device="cuda", same_buffers=False)
    model, graphed = graphed_model(tiny_model_dir, torch.float16, device="cuda", max_tokens=512)
    for m in (reference, model):
        compiled_layers.compile_layers(m)
    graphed.install()
    batches = [(40, 70, 30), (64, 64, 20, 12), (10, 90, 33), (100, 50), (200, 100), (150, 150, 10)]
    for seed, lengths in enumerate(batches):
        batch = packed_batch(lengths, pad_to=256, max_row=64, seed=seed, device="cuda")  # 256 or 512 tokens
        want = step(reference, batch, torch.float16)
        got = step(model, batch, torch.float16)
        assert got[0] == pytest.approx(want[0], rel=2e-3), (seed, got[0], want[0])
        for name, grad in want[1].items():
            scale = grad.abs().max().item() + 1e-6
            assert (got[1][name] - grad).abs().max().item() <= 2e-2 * scale, (seed, name)
    layers = len(graphed.layers)
    assert sorted(graphed.shapes) == [256, 512]
    for shape in graphed.shapes.values():
        assert shape.failed is None, shape.failed
        assert len(shape.forward_graphs) == len(shape.backward_graphs) == layers
    # The first batch ran without graphs; each count's first batch after it recorded its graphs, once.
    assert graphed.recorded == 2 * 2 * layers
    compiled_layers.uncompile_layers(model)
    compiled_layers.uncompile_layers(reference)


def test_the_mlp_kernel_is_weighed_with_the_embeddings_already_in_host_ram(monkeypatch):
    """Issue 49: Qwen3-8B on a T4 at 7.11 GiB (Unsloth's peak + 5%), rows of at most 500 tokens. Its input embeddings
    (1.2 GiB) go to host RAM; the MLP kernel's one-row check counted them on the GPU and picked the chunked MLP (half
    the speed) at 4 x 2 rows. Weighed with them in host RAM: the traced MLP and all 8 rows in one micro-batch."""
    from freetune.plan import GPU, Hardware, make_plan
    from freetune.speed import attention

    monkeypatch.setattr(attention, "varlen_works", lambda device, policy="ampere": (True, "probed by the test"))
    monkeypatch.setattr(attention, "varlen_backend", lambda device: "efficient")
    gpu = GPU(name="NVIDIA T4", capability=(7, 5), memory_gib=15)
    hardware = Hardware(gpus=[gpu], torch="2.13.0", cuda="12.8", arch_list=["sm_75"])
    plan = make_plan(hardware, model_shape="qwen3-8b", grad_accum=8, memory_budget_gib=7.11, longest_row=500,
                     lora_dropout=0.0)
    assert plan.memory.embeddings_on_host and plan.kernels.cuda_graph_tokens
    assert (plan.kernels.mlp, plan.batch.micro_batch) == ("traced", 8)
    assert plan.memory.estimate.total_gib <= 7.11
