"""The fast default path (freetune.speed.attention) trains the same model as the plain TRL stack, with no padding.

Same tiny Qwen2 model, same rows, same seed, same rows per optimizer step in the same order:
- plain: TRL's SFTTrainer as it comes (padded batches, its own compute_loss with per-step metric syncs);
- fast:  freetune.train.train with a plan whose batching is padding-free (rows concatenated, sdpa keeping
  them apart through the block-diagonal mask transformers builds from the restarting position_ids).
The per-token mean loss must agree at the first step (before any update) and along the trajectory.
"""

import json
import math

import pytest

ROWS = 24


def varied_rows():
    """Prompt/completion rows from a few to ~60 tokens, so a padded batch of 4 carries real padding."""
    from datasets import Dataset

    words = ["red", "green", "blue", "circle", "square", "line", "small", "large", "left", "right", "top", "bottom"]
    rows = []
    for i in range(ROWS):
        n = 2 + (i * 7) % 23  # lengths spread over the batch
        body = " ".join(words[(i * 5 + j) % 12] for j in range(n))
        rows.append({"prompt": f"Draw {words[i % 12]} number {i}:", "completion": f" <svg>{body} {i}</svg>"})
    return Dataset.from_list(rows)


def run_paths(root, name):
    from freetune.platform import Paths

    return Paths.under(root / name).make()


def losses(history):
    return [h["loss"] for h in history if "loss" in h]


def test_padding_free_path_matches_the_plain_loss_and_computes_no_padding(tiny_model_dir, tmp_path):
    from trl import SFTTrainer

    import freetune
    from freetune.model import adapter_dtype_guard
    from freetune.plan import Plan
    from freetune.reach import trl as trl_reach
    from freetune.speed import batching

    steps, micro, accum = 4, 4, 2

    def model_and_config(plan, name):
        paths = run_paths(tmp_path, name)
        model = freetune.model.load_base_model(str(tiny_model_dir), plan, gradient_checkpointing=False)
        model, _, _ = freetune.model.attach_lora(model, rank=8, alpha=16, dropout=0.0, seed=0)
        config = freetune.sft_config.make_config(
            paths, plan, max_steps=steps, micro_batch=micro, grad_accum=accum, learning_rate=5e-3, max_length=64,
            optimizer="adamw_torch", logging_steps=1, save_steps=100, save_total_limit=2, seed=0)
        return paths, model, config

    common = dict(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                  micro_batch=micro, grad_accum=accum, gradient_checkpointing=False)
    tokenizer = freetune.model.load_tokenizer(str(tiny_model_dir))

    # The plain stack: TRL's trainer and collator untouched (the fp32 LoRA guard only undoes TRL's bf16 cast,
    # which the fast path undoes too, so both train the same fp32 weights).
    _, model, config = model_and_config(Plan.build(**common, batching="padded"), "plain")
    plain = SFTTrainer(model=model, args=config, train_dataset=varied_rows(), processing_class=tokenizer,
                       callbacks=[adapter_dtype_guard()])
    plain.train()
    plain_losses = losses(plain.state.log_history)

    fast_plan = Plan.build(**common, batching="padding_free")
    paths, model, config = model_and_config(fast_plan, "fast")
    summary = freetune.train.train(model, tokenizer, varied_rows(), config, plan=fast_plan, paths=paths, resume=False)
    fast_history = json.loads((tmp_path / "fast" / "reports" / "log_history.json").read_text())
    fast_losses = losses(fast_history)

    assert len(plain_losses) == len(fast_losses) == steps
    # Step 1 is logged before any update: the same weights on the same tokens, only batched differently.
    assert math.isclose(fast_losses[0], plain_losses[0], rel_tol=1e-4), (fast_losses[0], plain_losses[0])
    # Along the run the same gradients give the same updates; float sums in another order drift only slightly.
    for a, b in zip(fast_losses, plain_losses):
        assert math.isclose(a, b, rel_tol=2e-3), (fast_losses, plain_losses)
    assert fast_losses[-1] < fast_losses[0]  # it does learn

    # The fast trainer ran padding-free: of the tokens it computed, only the alignment row (< 8 a micro-batch of
    # ~4 x 30 tokens) was padding ...
    pads = [h["pad_fraction"] for h in fast_history if "pad_fraction" in h]
    assert pads and all(0.0 <= p < 7 / 60 for p in pads) and any(p > 0 for p in pads)
    # ... and it saw every real token the plain run saw (its metrics are read once per log step, not per batch).
    plain_tokens = max(h.get("num_tokens", 0) for h in plain.state.log_history)
    assert summary["tokens"] == plain_tokens > 0
    fast_entropy = [h["entropy"] for h in fast_history if "entropy" in h]
    plain_entropy = [h["entropy"] for h in plain.state.log_history if "entropy" in h]
    assert math.isclose(fast_entropy[0], plain_entropy[0], rel_tol=1e-3)

    # The same batches through both collators: the plain one pads, the padding-free one does not.
    padded = [batching.padding_stats(b) for b in plain.get_train_dataloader()]
    trl_reach.apply_batching(plain, "padding_free")
    free_batches = list(plain.get_train_dataloader())
    free = [batching.padding_stats(b) for b in free_batches]
    assert sum(s["pad_tokens"] for s in padded) > 0
    # Padding-free pads only to a multiple of 8 tokens (one graph for compiled layers), with one extra row that
    # trains nothing and that attention keeps apart.
    assert all(s["computed_tokens"] % batching.PAD_TO == 0 and s["pad_tokens"] < batching.PAD_TO for s in free)
    assert any(s["pad_tokens"] > 0 for s in free)
    for b, s in zip(free_batches, free):
        tail = slice(s["real_tokens"], None)
        assert (b["labels"][0, tail] == -100).all()
        assert b["position_ids"][0, tail].tolist() == list(range(s["pad_tokens"]))
        assert b["cu_seq_lens_q"][-1] == s["computed_tokens"] and b["max_length_q"] >= s["pad_tokens"]
        if s["pad_tokens"]:
            assert b["cu_seq_lens_q"][-2] == s["real_tokens"]
    assert sum(s["real_tokens"] for s in free) == sum(s["real_tokens"] for s in padded)
    assert sum(s["computed_tokens"] for s in free) < sum(s["computed_tokens"] for s in padded)


def test_the_plan_chooses_the_fast_path_and_says_why(monkeypatch):
    from freetune.plan import KNOWN_SHAPES
    from freetune.plan import GPU, Hardware, make_plan
    from freetune.speed import attention

    def machine(name, capability, memory_gib, bf16):
        return Hardware(gpus=[GPU(name, capability, memory_gib)], arch_list=["sm_75", "sm_80", "sm_90"],
                        bf16_supported=bf16, torch="2.13.0", cuda="12.8", disk_free_gib={"/work": 60.0},
                        ram_total_gib=30.0, ram_available_gib=28.0)

    shape = KNOWN_SHAPES["qwen2.5-1.5b"]
    # A T4: the full batch without checkpointing needs far more than 14.7 GiB, so checkpointing stays on. Its
    # policy allows only the memory-efficient variable-length kernel (sm50+); this CPU machine cannot run the probe
    # that checks it against sdpa, so the probe's two answers are given here.
    probed = []

    def probe(device_index, backends):
        probed.append(backends)
        return answer

    monkeypatch.setattr(attention, "_probe", probe)
    monkeypatch.setattr(attention, "_PROBED", {})
    answer = ("efficient", "efficient: checked against sdpa, forward and backward")
    t4 = make_plan(machine("Tesla T4", (7, 5), 14.7, False), model_shape=shape, micro_batch=None, grad_accum=8)
    assert probed == [("efficient", "efficient_copied")]
    assert t4.batch.micro_batch > 1 and t4.memory.checkpointing and t4.batch.batching == "padding_free"
    assert "would need" in t4.reasons["gradient_checkpointing"] and "T4 (sm75) runs too" in t4.reasons["batching"]
    assert t4.precision.frozen_dtype == "float16" and t4.kernels.attention == attention.VARLEN_ATTENTION
    monkeypatch.setattr(attention, "_PROBED", {})
    answer = ("", "efficient: disagrees with sdpa (output relative error 0.300)")
    t4 = make_plan(machine("Tesla T4", (7, 5), 14.7, False), model_shape=shape, micro_batch=None, grad_accum=8)
    assert t4.batch.batching == "grouped" and "disagrees with sdpa" in t4.reasons["batching"]
    monkeypatch.undo()
    # A 141 GB card: 8 x 1,024 tokens fit without the recompute, so it goes.
    big = make_plan(machine("NVIDIA H200", (9, 0), 139.8, True), model_shape=shape, micro_batch=None, grad_accum=8)
    assert big.batch.micro_batch == 8 and not big.memory.checkpointing and "fit without it" in \
        big.reasons["gradient_checkpointing"]
    # Asked for explicitly, checkpointing is kept whatever the memory.
    kept = make_plan(machine("NVIDIA H200", (9, 0), 139.8, True), model_shape=shape, micro_batch=None, grad_accum=8,
                     gradient_checkpointing=True)
    assert kept.memory.checkpointing and kept.reasons["gradient_checkpointing"] == "as given"
    # A CPU run is a check: the plain stack's padded batches (the padding-free path is tested explicitly above).
    cpu = make_plan(Hardware(gpus=[], arch_list=[], bf16_supported=False, torch="2.13.0", cuda=None,
                             disk_free_gib={"/work": 60.0}, ram_total_gib=30.0, ram_available_gib=28.0),
                    model_shape=shape, micro_batch=None, grad_accum=8, max_length=256)
    assert cpu.layout.device == "cpu" and cpu.batch.micro_batch > 1 and cpu.batch.batching == "padded"
    # Each choice is a row of the printed plan.
    table = big.table()
    assert "batching" in table and "checkpointing" in table


def test_freetune_attention_keeps_packed_rows_apart_like_separate_rows(tiny_model_dir):
    """freetune's registered attention on a packed row (off a GPU: sdpa with transformers' block-diagonal mask)
    gives each row the logits it gets alone: no token sees another row."""
    import torch
    from transformers import AutoModelForCausalLM

    from freetune.speed import attention

    name = attention.register_attention()
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation=name,
                                                 dtype=torch.float32).eval()
    rows = [torch.arange(5, 5 + n) * 37 % 5000 for n in (7, 12, 4)]
    packed = torch.cat(rows)[None]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    bounds = torch.tensor([0, 7, 19, 23], dtype=torch.int32)
    with torch.no_grad():
        # use_cache=False as in training (TRL sets it): with a KV cache transformers does not look for packed rows.
        together = model(input_ids=packed, position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds,
                         max_length_q=12, max_length_k=12, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=r[None]).logits[0] for r in rows])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)


def test_the_dense_mask_is_left_out_only_where_the_varlen_kernel_reads_the_rows(monkeypatch):
    """varlen_mask: no (tokens x tokens) mask for a training batch of one padding-free sequence on a GPU whose varlen
    kernel was chosen; sdpa's mask function for anything else (a padded batch, a KV cache, evaluation, no kernel)."""
    import torch
    import transformers.masking_utils as masking

    from freetune.speed import attention

    asked = []
    monkeypatch.setattr(masking, "sdpa_mask", lambda *a, **k: asked.append((a, k)) or "sdpa's mask")
    monkeypatch.setattr(attention, "_CHOSEN", {0: ("efficient", "chosen by the test")})
    assert attention.varlen_mask(1, 64, 64, device="cuda:0") is None and not asked
    assert attention.varlen_mask(1, 64, 64, device=torch.device("cuda")) is None and not asked
    padded = torch.ones(2, 64, dtype=torch.bool)
    for call in (dict(batch_size=2, attention_mask=padded), dict(kv_offset=8), dict(device="cpu"),
                 dict(device="cuda:1")):  # no kernel chosen for GPU 1
        args = {**dict(batch_size=1, q_length=64, kv_length=64, device="cuda:0"), **call}
        assert attention.varlen_mask(**args) == "sdpa's mask"
    with torch.no_grad():
        assert attention.varlen_mask(1, 64, 64, device="cuda:0") == "sdpa's mask"
    assert len(asked) == 5 and asked[0][1]["attention_mask"] is padded


def test_where_the_mask_was_left_out_a_fallback_to_sdpa_still_keeps_the_rows_apart(tiny_model_dir, monkeypatch):
    """If an attention call falls back to sdpa after varlen_mask left the mask out, it rebuilds the rows' mask from
    their positions: each packed row still gets the logits it gets alone."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.masking_utils import AttentionMaskInterface

    from freetune.speed import attention

    name = attention.register_attention()
    monkeypatch.setitem(AttentionMaskInterface._global_mapping, name, lambda *a, **k: None)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation=name,
                                                 dtype=torch.float32).eval()
    rows = [torch.arange(5, 5 + n) * 37 % 5000 for n in (7, 12, 4)]
    positions = torch.cat([torch.arange(len(r)) for r in rows])[None]
    with torch.no_grad():
        together = model(input_ids=torch.cat(rows)[None], position_ids=positions, use_cache=False).logits[0]
        alone = torch.cat([model(input_ids=r[None]).logits[0] for r in rows])
    torch.testing.assert_close(together, alone, rtol=1e-4, atol=1e-4)


def test_the_attention_layers_only_read_the_probed_backend_inside_compiled_code(monkeypatch):
    """Every attention call asks varlen_backend which kernel to use, inside the compiled decoder layers. It must be
    a plain lookup there: a functools.cache'd probe is traced by dynamo as if uncached and ran the whole probe in
    every attention call of every step on the GPU."""
    import torch

    from freetune.speed import attention

    probes = []

    def counting_probe(device_index, backends):
        probes.append(device_index)
        return "", "probed by the test"

    monkeypatch.setattr(attention, "_probe", counting_probe)
    monkeypatch.setattr(attention, "_CHOSEN", {})
    monkeypatch.setattr(attention, "_PROBED", {})
    assert attention.varlen_works(0) == (False, "probed by the test")  # eagerly, as the plan and train() do

    @torch.compile(backend="eager", fullgraph=True)  # fullgraph: a graph break would raise
    def layer(x):
        return x * 2 if attention.varlen_backend(0) else x + 1

    for n in (3, 5, 7):
        assert torch.equal(layer(torch.ones(n)), torch.full((n,), 2.0))
    assert probes == [0], "probed once, then only read"


def test_a_4bit_models_fp32_queries_run_the_16bit_kernel_under_mixed_precision(tiny_model_dir, monkeypatch):
    """A 4-bit model's residual stream is fp32 (prepare_model_for_kbit_training upcasts norms and embeddings), so
    under bf16 autocast q, k and v reach the attention function in fp32. The varlen kernel must still run, in
    autocast's dtype, as sdpa would under autocast: a check for 16-bit inputs alone sent every padding-free batch
    of the GPU benchmark to sdpa with a dense mask. Off a GPU the call goes to sdpa; the dtype it would take is
    read from the same function, inside a compiled graph as in the compiled layers."""
    import torch
    import transformers.integrations.sdpa_attention as sdpa

    import freetune
    from freetune.plan import Plan
    from freetune.speed import attention

    plan = Plan.build(device="cpu", compute_dtype="bfloat16", mixed_precision="bf16",
                attn_implementation=attention.VARLEN_ATTENTION, micro_batch=1, grad_accum=1,
                gradient_checkpointing=False)
    model = freetune.model.load_base_model(str(tiny_model_dir), plan)
    model, _, _ = freetune.model.attach_lora(model, rank=8, alpha=16, dropout=0.0, seed=0)
    seen = []
    real_sdpa = sdpa.sdpa_attention_forward

    def spy(module, query, *args, **kwargs):
        seen.append((query.dtype, attention.kernel_dtype(query)))
        return real_sdpa(module, query, *args, **kwargs)

    monkeypatch.setattr(sdpa, "sdpa_attention_forward", spy)
    ids = torch.arange(10, 22)[None]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, use_cache=False)
    assert seen and all(s == (torch.float32, torch.bfloat16) for s in seen), seen
    seen.clear()
    model(input_ids=ids, use_cache=False)  # no autocast: fp32 stays fp32, and sdpa it is
    assert seen and all(s == (torch.float32, None) for s in seen), seen

    @torch.compile(backend="eager", fullgraph=True)  # as in a compiled decoder layer: no graph break
    def cast(q):
        dtype = attention.kernel_dtype(q)
        return q if dtype is None else q.to(dtype)

    with torch.autocast("cpu", dtype=torch.float16):
        assert cast(torch.ones(3)).dtype == torch.float16
    assert cast(torch.ones(3)).dtype == torch.float32 and cast(torch.ones(3, dtype=torch.bfloat16)).dtype == \
        torch.bfloat16


def test_the_config_keeps_the_host_from_waiting_for_the_gpu_each_micro_batch(tmp_path):
    """On a GPU the batch is copied from pinned memory without a wait, and no micro-batch's loss is read on the host
    (the Trainer's NaN filter); on a CPU there is nothing to pin or wait for."""
    from freetune.plan import Plan
    from freetune.sft_config import make_config

    paths = run_paths(tmp_path, "cfg")
    kwargs = dict(max_steps=4, micro_batch=1, grad_accum=1, learning_rate=1e-4, max_length=64, optimizer="adamw_torch")
    # A GPU plan (fp32 so that TrainingArguments accepts it on this CPU-only machine).
    gpu = make_config(paths, Plan.build(device="cuda", compute_dtype="float32", mixed_precision="no",
                                  attn_implementation="sdpa"), **kwargs)
    assert gpu.accelerator_config.non_blocking is True and gpu.dataloader_pin_memory is True
    assert gpu.logging_nan_inf_filter is False
    cpu = make_config(paths, Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no",
                                  attn_implementation="sdpa"), **kwargs)
    assert cpu.accelerator_config.non_blocking is False and cpu.dataloader_pin_memory is False
    assert cpu.logging_nan_inf_filter is False


def _padding_free_vs_alone(model_dir, device: str, backend: str):
    """(packed, alone) logits and LoRA gradients of three rows: one padding-free batch against each row on its own."""
    import torch

    import freetune
    from freetune.plan import Plan
    from freetune.speed import attention

    cuda = device == "cuda"
    dtype = {"flash": "bfloat16", "efficient": "float16", "efficient_copied": "float16"}.get(backend, "float32")
    plan = Plan.build(device=device, compute_dtype=dtype, mixed_precision={"bfloat16": "bf16", "float16": "fp16"}.get(
        dtype, "no"), attn_implementation=attention.VARLEN_ATTENTION, micro_batch=3, grad_accum=1,
        gradient_checkpointing=False, frozen_dtype=dtype if cuda else "float32")
    model = freetune.model.load_base_model(str(model_dir), plan)
    model, _, _ = freetune.model.attach_lora(model, rank=8, alpha=16, dropout=0.0, seed=0)
    for name, param in model.named_parameters():
        if "lora_B" in name:  # non-zero B, as after some training: the adapter then shapes the logits
            torch.nn.init.normal_(param, std=0.05)
    if cuda:
        attention._CHOSEN[torch.cuda.current_device()] = (backend, "forced by the test")
    rows = [(torch.arange(5, 5 + n, device=device) * 37) % 5000 for n in (7, 12, 4)]
    gen = torch.Generator(device=device).manual_seed(0)
    weights = [torch.randn(len(r), model.config.vocab_size, device=device, generator=gen) for r in rows]
    lora = [p for p in model.parameters() if p.requires_grad]

    def run(ids, **kwargs):
        with torch.autocast(device, dtype=plan.precision.torch_dtype, enabled=cuda):
            return model(input_ids=ids, use_cache=False, **kwargs).logits[0].float()

    bounds = torch.tensor([0, 7, 19, 23], dtype=torch.int32, device=device)
    positions = torch.cat([torch.arange(len(r), device=device) for r in rows])[None]
    packed = run(torch.cat(rows)[None], position_ids=positions, cu_seq_lens_q=bounds, cu_seq_lens_k=bounds,
                 max_length_q=12, max_length_k=12)
    (packed * torch.cat(weights)).sum().backward()
    packed_grads = [p.grad.clone() for p in lora]
    model.zero_grad()
    alone = [run(r[None]) for r in rows]
    sum((a * w).sum() for a, w in zip(alone, weights)).backward()
    return packed, torch.cat(alone), packed_grads, [p.grad for p in lora]


@pytest.mark.parametrize("where", ["cpu", "cuda:flash", "cuda:efficient", "cuda:efficient_copied",
                                   "cuda:efficient+whole"])
def test_each_row_of_a_padding_free_batch_gets_its_own_logits_and_gradients(tiny_model_dir, where, monkeypatch):
    """Rows concatenated into one padding-free batch (position ids restarting, cu_seq_lens) give every row the logits
    and the LoRA gradients it gets on its own: no token attends across rows, forward or backward. On a CPU through
    sdpa and transformers' block-diagonal mask; on a GPU through each variable-length kernel (flash: sm80+;
    efficient: the one a T4 runs, in its two layouts and with every head in one call, as the plan asks where the
    copies fit), run on the GPU machine with `pytest tests/test_fast_path.py -k own_logits`."""
    import torch

    from freetune.speed import attention

    device, _, backend = where.partition(":")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the variable-length kernels need a GPU; the CPU case covers the packing itself")
    backend, whole, _ = backend.partition("+whole")
    if whole:
        monkeypatch.setitem(attention._WHOLE_HEADS, torch.cuda.current_device(), True)
    packed, alone, packed_grads, alone_grads = _padding_free_vs_alone(tiny_model_dir, device, backend)
    tol = 1e-4 if device == "cpu" else 3e-2
    torch.testing.assert_close(packed, alone, rtol=tol, atol=tol)
    for got, want in zip(packed_grads, alone_grads):
        assert (got - want).norm() <= tol * max(want.norm(), 1e-3), ((got - want).norm(), want.norm())


@pytest.mark.parametrize("layout", ["strided", "copied", "whole"])
def test_the_memory_efficient_ops_forward_backward_and_autograd_run_through_on_meta_tensors(layout):
    """freetune.speed.attention_efficient's custom ops, their grouped-query parts and their autograd, run end to end
    on meta tensors (the aten kernels' shape functions: no GPU needed): every output and gradient has its input's
    shape, the logsumexp one per q head and row. The numbers are the GPU tests' (the kernel needs a GPU)."""
    import torch

    from freetune.speed.attention_efficient import _backward_4d, efficient_op

    op = efficient_op()
    q = torch.empty(16, 8, 64, device="meta", dtype=torch.float16, requires_grad=True)
    k, v = (torch.empty(16, 2, 64, device="meta", dtype=torch.float16, requires_grad=True) for _ in range(2))
    cu = torch.tensor([0, 8, 16], dtype=torch.int32, device="meta")
    out, lse = torch.ops.freetune.varlen_efficient(q, k, v, cu, 8, None, layout)
    assert out.shape == q.shape and lse.shape[1] == q.shape[1]
    grads = torch.ops.freetune.varlen_efficient_backward(out, q, k, v, out, lse, cu, 8, None, layout)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    if layout == "whole":  # one kernel call: its output and q's gradient returned as the kernel made them, not copied
        with torch.no_grad():  # the function itself: the backward op's registered fake is an empty_like
            dq = _backward_4d(out, q, k, v, out, lse, cu, 8, None, layout)[0]
        assert out._is_view() and dq._is_view() and out.is_contiguous() and dq.is_contiguous()
    op(q, k, v, cu, 8, None, layout).sum().backward()
    assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
