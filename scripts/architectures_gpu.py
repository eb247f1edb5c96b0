"""Issue 47's GPU check: per architecture, freetune's fast path against the plain reference path, with the real
kernels, T4 constraints emulated on whatever GPU runs it (an H200 here).

For each architecture of the CPU matrix (tests/test_architectures.py: llama, qwen2, qwen3, mistral, gemma2,
gemma3_text, phi3, qwen3_moe), a small random model (SIZE below; sliding windows of WINDOW tokens, shorter than the
rows), NF4 base, LoRA r16 on every linear layer (and a mixture's experts, through peft), non-zero B, dropout 0:
  ref32  transformers' own path in fp32 (no autocast): what both 16-bit paths are measured against;
  plain  the plain reference path on the T4 policy: peft's LoRA layers, transformers' own attention (the plan's
         sdpa, or eager for soft-capped logits), fp16 autocast, transformers' checkpoint on every layer;
  fast   freetune's fast path on the same policy: every feature freetune.plan.decisions says honours the architecture
         (fused LoRA layers cast once per forward; the variable-length attention kernel with padding-free rows; the
         traced fused MLP; the layers replayed as CUDA graphs; torch.compile per decoder layer), each checkpointed.
The loss and every LoRA gradient of plain and fast on one padding-free batch (the same rows) are compared with
ref32's: relative L2 error per tensor (and over all of them). The fast path agrees when its error is within
max(3 x plain's, 0.02): fp16 rounding alone gives both ~1e-3; a dropped window or per-layer argument gives 0.3-1.3.
tokens/s: forward + backward (no optimizer step) of 8 rows of 300-1,000 tokens, real tokens only; plain on the rows
padded to the longest (the plain stack's batch), fast on the batch its plan takes (padding-free where the varlen
kernel applies, else the same padded batch: the plan's length-grouped batches).
T4 constraints: the process capped at 14.5 GiB (torch.cuda.set_per_process_memory_fraction), fp16 autocast with
the loss scaled (x1024, unscaled in the gradients) as the GradScaler does, fp16 frozen weights, FlashAttention and
cuDNN attention off (sdpa's memory-efficient and math kernels; the varlen kernel on the T4 policy is the
memory-efficient one, sm50+). What stays the H200's: its compute, bandwidth, and sm90 builds of the kernels.

Usage (GPU machine, freetune's wheels installed):
    python3 scripts/architectures_gpu.py --out reports/gpu/architectures.json
(~1 min per architecture, most of it compiling; --no-compile skips compile, --only llama,qwen2 a subset)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3", "qwen3_moe")
# Small, not tiny: a step long enough to time, short enough to compile eight models in a few minutes.
SIZE = dict(hidden_size=1024, num_layers=4, intermediate_size=2816, num_attention_heads=8, num_key_value_heads=2,
            vocab_size=32000)
WINDOW = 256  # every row is longer: a sliding window that is dropped shows in the gradients
ROWS, LENGTHS, MAX_LENGTH, CAP_GIB = 8, (300, 1000), 1024, 14.5
LORA_RANK, LOSS_SCALE = 16, 1024.0
AGREE_X, AGREE_FLOOR = 3.0, 0.02


def build(architecture: str, work: Path, tokenizer_dir: Path) -> Path:
    """The architecture's small random model (the CPU matrix's config, at SIZE, with WINDOW-token windows)."""
    import torch

    from freetune.fixtures import TINY_ARCHITECTURES, build_tiny_model

    out = work / f"model-{architecture}"
    if (out / "config.json").exists():
        return out
    arch = TINY_ARCHITECTURES[architecture]
    extra = {}
    if "sliding_window" in arch:
        extra["sliding_window"] = WINDOW
    if "head_dim" in arch:
        extra["head_dim"] = SIZE["hidden_size"] // SIZE["num_attention_heads"]
    if "query_pre_attn_scalar" in arch:
        extra["query_pre_attn_scalar"] = extra["head_dim"]
    if "moe_intermediate_size" in arch:
        extra["moe_intermediate_size"] = SIZE["intermediate_size"] // 4
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        build_tiny_model(out, architecture, tokenizer_dir=tokenizer_dir, pad_token_id=0, eos_token_id=1,
                         bos_token_id=1, **SIZE, **extra)
    return out


def rows(seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, SIZE["vocab_size"]) for _ in range(rng.randint(*LENGTHS))] for _ in range(ROWS)]


def packed_batch(token_rows, multiple: int):
    """A padding-free batch as TRL's collator and freetune's AlignedPaddingFree make it (padded to `multiple`)."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from freetune.speed import batching

    collator = batching.AlignedPaddingFree(DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),
                                           multiple=multiple, max_row=MAX_LENGTH)
    batch = collator([{"input_ids": r} for r in token_rows])
    batch.pop(batching.PAD_KEY)
    return {k: v.cuda() if hasattr(v, "cuda") else v for k, v in batch.items()}


def padded_batch(token_rows):
    """The rows padded to the longest (the plain stack's batch), labels -100 on the padding."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    batch = DataCollatorForLanguageModeling(pad_token_id=0)([{"input_ids": r} for r in token_rows])
    return {k: v.cuda() for k, v in batch.items()}


def plans(model_dir: Path, multiple: int):
    """(the plan freetune makes for this model at the T4 cap, the fast path's plan, the plain path's plan, ref32's,
    {feature: "" or why it steps aside})."""
    import freetune
    from freetune.plan import ModelShape, decisions, make_plan, read_hardware
    from freetune.speed.attention import VARLEN_ATTENTION

    shape = ModelShape.named(str(model_dir))
    plan = make_plan(read_hardware("/tmp", "/tmp"), model_shape=shape, max_length=MAX_LENGTH, micro_batch=ROWS,
                     grad_accum=1, lora_rank=LORA_RANK, precision="fp16", memory_budget_gib=CAP_GIB,
                     lora_dropout=0.0)
    own = decisions.choose_attention(freetune.plan.Hardware(), "turing", shape).value
    aside = {"varlen": decisions.varlen_why_not(shape, MAX_LENGTH), "mlp": decisions.mlp_why_not(shape),
             "graphs": decisions.graphs_why_not(shape)}
    if aside["varlen"] and not aside["graphs"]:
        aside["graphs"] = "padded batches (the varlen kernel steps aside): the graphs take padding-free rows"
    aside["attention"] = "" if own == "sdpa" else f"{own}: soft-capped logits (sdpa would drop the cap)"
    common = dict(lora_kernel="peft", compile=False, gradient_checkpointing=True, checkpoint_every=1,
                  mlp_kernel="layers", cuda_graph_tokens=0, embeddings_on_host=False, offload_activations=False)
    plain = plan.replace(attn_implementation=own, batching="padded", **common)
    fast = plan.replace(**{**common, "lora_kernel": "fused", "compile": True,
                            "attn_implementation": VARLEN_ATTENTION if not aside["varlen"] else own,
                            "batching": "padding_free" if not aside["varlen"] else "grouped",
                            "mlp_kernel": "traced" if not aside["mlp"] else "layers",
                            "cuda_graph_tokens": multiple if not aside["graphs"] else 0})
    ref32 = plain.replace(compute_dtype="float32", frozen_dtype="float32", mixed_precision="no")
    return plan, fast, plain, ref32, aside


def load(model_dir: Path, plan):
    import torch

    import freetune

    model = freetune.model.load_base_model(str(model_dir), plan, gradient_checkpointing=True)
    model, _, _ = freetune.model.attach_lora(model, rank=LORA_RANK, alpha=2 * LORA_RANK, dropout=0.0, seed=0)
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.02)
    model.train()
    return model


class FastPath:
    """freetune's fast-path features on `model`, in the order freetune.train installs them."""

    def __init__(self, model, plan, compile_layers: bool):
        import torch

        from freetune.reach.torch import free_cublas_workspaces
        from freetune.plan.memory import keeps_8bit_absmax
        from freetune.speed import attention, compiled_layers, cuda_graphs, lora_kernel, mlp
        from freetune.speed.batching import most_rows

        self.model, self.graphed, self.stream, self.applied = model, None, None, {}
        compiled = plan.kernels.compile and compile_layers
        fused, seen = lora_kernel.use_fused_lora(model, keep_8bit_absmax=keeps_8bit_absmax("fused", compiled,
                                                                                        plan.kernels.mlp))
        self.applied["fused LoRA"] = f"{fused} of {seen}"
        self.undo_cast = lora_kernel.cast_adapters_once_per_forward(model, same_buffers=bool(plan.kernels.cuda_graph_tokens))
        self.applied["cast once"] = bool(self.undo_cast)
        if plan.kernels.mlp == "traced":
            fused, seen = mlp.use_fused_mlp(model, kernel="traced")
            self.applied["fused MLP"] = f"{fused} of {seen}"
        if plan.batch.batching == "padding_free":
            ok, why = attention.varlen_works(torch.cuda.current_device(), "turing")
            self.applied["varlen"] = attention.varlen_backend() if ok else f"probe failed: {why}"
        if compiled:
            self.applied["compile"] = f"{compiled_layers.compile_layers(model)} layers"
        if plan.kernels.cuda_graph_tokens:
            multiple = plan.kernels.cuda_graph_tokens
            self.graphed = cuda_graphs.GraphedLayers(
                model, max_tokens=-(-ROWS * MAX_LENGTH // multiple) * multiple, max_row=MAX_LENGTH,
                max_rows=most_rows(ROWS, multiple, MAX_LENGTH), fixed_pairs=True)
            self.stream = torch.cuda.Stream()
            self.stream.wait_stream(torch.cuda.current_stream())
            torch.cuda.set_stream(self.stream)
            free_cublas_workspaces()
            self.applied["CUDA graphs"] = f"{self.graphed.install()} of {len(self.graphed.layers)} layers"

    def remove(self):
        import torch

        if self.stream is not None:
            torch.cuda.default_stream().wait_stream(self.stream)
            torch.cuda.set_stream(torch.cuda.default_stream())
        if self.graphed is not None:
            self.graphed.remove()
        if self.undo_cast:
            self.undo_cast()


def step(model, batch, autocast: bool):
    """One forward and backward: (loss, {LoRA weight: fp32 gradient}); the fp16 paths' loss scaled as the
    GradScaler would and unscaled in the gradients."""
    import torch

    with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
        loss = model(**batch).loss
    (loss * (LOSS_SCALE if autocast else 1.0)).backward()
    scale = LOSS_SCALE if autocast else 1.0
    grads = {n: (p.grad.float() / scale).clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def errors(grads: dict, reference: dict) -> dict:
    """Relative L2 error over all LoRA gradients and the largest per tensor (with its name)."""
    import torch

    names = sorted(reference)
    diff = torch.stack([(grads[n] - reference[n]).norm() ** 2 for n in names]).sum().sqrt()
    total = torch.stack([reference[n].norm() ** 2 for n in names]).sum().sqrt()
    each = {n: ((grads[n] - reference[n]).norm() / reference[n].norm().clamp_min(1e-30)).item() for n in names}
    worst = max(each, key=each.get)
    zero = [n for n in names if grads[n].abs().sum() == 0]
    return {"all": round((diff / total).item(), 5), "worst": round(each[worst], 5), "worst_tensor": worst,
            "tensors": len(names), "zero_gradients": len(zero)}


def tokens_per_s(model, batch, real_tokens: int, autocast: bool, steps: int) -> float:
    import torch

    for _ in range(2):  # compiles, records graphs, grows the allocator
        step(model, batch, autocast)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        with torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            loss = model(**batch).loss
        (loss * LOSS_SCALE).backward()
        model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return round(real_tokens * steps / (time.perf_counter() - start), 1)


def one_architecture(architecture: str, work: Path, tokenizer_dir: Path, compile_layers: bool, steps: int) -> dict:
    import gc

    import torch

    from freetune.plan.sizing import graph_tokens

    model_dir = build(architecture, work, tokenizer_dir)
    token_rows = rows()
    real = sum(len(r) for r in token_rows)
    multiple = graph_tokens(ROWS, MAX_LENGTH)
    plan, fast_plan, plain_plan, ref_plan, aside = plans(model_dir, multiple)
    packed, padded = packed_batch(token_rows, multiple), padded_batch(token_rows)
    out = {"architecture": architecture, "real_tokens": real, "packed_tokens": packed["input_ids"].numel(),
           "padded_tokens": padded["input_ids"].numel(), "aside": aside,
           "plan_at_t4_cap": {k: plan.reasons.get(k, "") for k in ("attention", "batching", "mlp_kernel",
                                                                    "cuda_graphs", "gradient_checkpointing")},
           "plan_values": {"attention": plan.kernels.attention, "batching": plan.batch.batching,
                           "mlp_kernel": plan.kernels.mlp, "cuda_graph_tokens": plan.kernels.cuda_graph_tokens,
                           "checkpoint_every": plan.memory.checkpoint_every if plan.memory.checkpointing else 0,
                           "compile": plan.kernels.compile, "micro_batch": plan.batch.micro_batch}}

    def run(which, model_plan, autocast):
        model = load(model_dir, model_plan)
        features = FastPath(model, model_plan, compile_layers) if which == "fast" else None
        try:
            torch.cuda.reset_peak_memory_stats()
            loss, grads = step(model, packed, autocast)
            if features is not None and features.graphed is not None:
                step(model, packed, autocast)  # the first batch warms the layers; graphs are recorded from the next
                loss, grads = step(model, packed, autocast)
            rate = None
            if which != "ref32":
                batch = packed if which == "fast" and model_plan.batch.batching == "padding_free" else padded
                rate = tokens_per_s(model, batch, real, autocast, steps)
            peak = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            return loss, grads, rate, peak, (features.applied if features else {})
        finally:
            if features is not None:
                features.remove()
            del model
            gc.collect()
            torch.cuda.empty_cache()
            torch._dynamo.reset()

    ref_loss, ref_grads, _, _, _ = run("ref32", ref_plan, autocast=False)
    for which, model_plan in (("plain", plain_plan), ("fast", fast_plan)):
        try:
            loss, grads, rate, peak, applied = run(which, model_plan, autocast=True)
        except Exception as exc:  # noqa: BLE001 - the table says which path failed and why; the others still run
            out[which] = {"failed": f"{type(exc).__name__}: {str(exc)[:400]}"}
            continue
        out[which] = {"loss": round(loss, 5), "loss_error": round(abs(loss - ref_loss) / abs(ref_loss), 6),
                      "grad_error": errors(grads, ref_grads), "tokens_per_s": rate, "peak_allocated_gib": peak}
        if applied:
            out[which]["applied"] = applied
    out["ref32_loss"] = round(ref_loss, 5)
    if "loss" in out.get("plain", {}) and "loss" in out.get("fast", {}):
        bound = max(AGREE_X * out["plain"]["grad_error"]["worst"], AGREE_FLOOR)
        out["agrees"] = (out["fast"]["grad_error"]["worst"] <= bound
                         and out["fast"]["loss_error"] <= max(AGREE_X * out["plain"]["loss_error"], 1e-3)
                         and out["fast"]["grad_error"]["zero_gradients"] == 0)
        out["speedup"] = round(out["fast"]["tokens_per_s"] / out["plain"]["tokens_per_s"], 2)
    return out


def table(results: list[dict]) -> str:
    cols = ["architecture", "fast path (applied)", "stepped aside (why)", "loss err plain/fast",
            "grad err plain/fast (worst tensor)", "agrees", "tok/s plain", "tok/s fast", "x", "GiB plain/fast"]
    lines = [cols]
    for r in results:
        fast, plain = r.get("fast", {}), r.get("plain", {})
        applied = ", ".join(f"{k} {v}" for k, v in fast.get("applied", {}).items())
        aside = "; ".join(f"{k}: {v}" for k, v in r["aside"].items() if v) or "-"
        if "failed" in fast or "failed" in plain:
            lines.append([r["architecture"], applied, aside, "", "", "FAILED: " + (fast.get("failed") or
                                                                              plain.get("failed")), "", "", "", ""])
            continue
        lines.append([r["architecture"], applied, aside, f"{plain['loss_error']:.1e}/{fast['loss_error']:.1e}",
                      f"{plain['grad_error']['worst']:.1e}/{fast['grad_error']['worst']:.1e}",
                      "yes" if r["agrees"] else "NO", f"{plain['tokens_per_s']:,.0f}", f"{fast['tokens_per_s']:,.0f}",
                      f"{r['speedup']:.2f}", f"{plain['peak_allocated_gib']:.2f}/{fast['peak_allocated_gib']:.2f}"])
    return "\n".join(" | ".join(row) for row in lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="reports/gpu/architectures.json")
    parser.add_argument("--work", default="/tmp/freetune_architectures")
    parser.add_argument("--only", default=",".join(ARCHITECTURES), help="comma-separated subset")
    parser.add_argument("--no-compile", action="store_true", help="the fast path without torch.compile")
    parser.add_argument("--steps", type=int, default=5, help="timed forward+backward steps per path")
    args = parser.parse_args(argv)
    unknown = set(args.only.split(",")) - set(ARCHITECTURES)
    if unknown:
        parser.error(f"--only: no architecture {', '.join(sorted(unknown))}; pick from {', '.join(ARCHITECTURES)}")
    import torch

    if not torch.cuda.is_available():
        parser.error("this check needs a GPU (tests/test_architectures.py is the CPU one)")
    from freetune.model import cap_gpu_memory
    from scripts.bench import build_tokenizer

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    cap_gpu_memory(CAP_GIB)
    torch.backends.cuda.enable_flash_sdp(False)  # the T4's sdpa kernels: memory-efficient and math
    torch.backends.cuda.enable_cudnn_sdp(False)
    tokenizer_dir = build_tokenizer(work / "tokenizer")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "size": SIZE, "window": WINDOW,
              "rows": ROWS, "lengths": LENGTHS, "max_length": MAX_LENGTH, "cap_gib": CAP_GIB,
              "compile": not args.no_compile, "agree_rule": f"worst grad error <= max({AGREE_X} x plain's, "
                                                            f"{AGREE_FLOOR})", "results": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for architecture in args.only.split(","):
        start = time.time()
        try:
            result = one_architecture(architecture, work, tokenizer_dir, not args.no_compile, args.steps)
        except Exception as exc:  # noqa: BLE001 - one architecture's failure is a row of the table
            import traceback

            traceback.print_exc()
            result = {"architecture": architecture, "aside": {}, "fast": {"failed": f"{type(exc).__name__}: "
                                                                                    f"{str(exc)[:400]}"}}
        result["seconds"] = round(time.time() - start, 1)
        print(json.dumps(result), flush=True)
        report["results"].append(result)
        out.write_text(json.dumps(report, indent=1))
    print(table(report["results"]))
    return 0 if all(r.get("agrees") for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
