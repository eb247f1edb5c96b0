"""GPU check of the FSDP-QLoRA path (issue 10): a model whose 4-bit weights do not fit one GPU's memory cap trains
sharded over two GPUs, where DDP under the same cap runs out of memory.

    python scripts/fsdp_check.py --out reports/gpu/fsdp_check.json          # on a machine with 2 GPUs

Three torchrun jobs (2 processes, NCCL) on the same model, data, LoRA and steps, through freetune's own path
(freetune.plan.make_plan -> freetune.model.load_base_model / attach_lora -> freetune.train):
  1. DDP  under the cap (torch.cuda.set_per_process_memory_fraction)  -> expected: out of memory
  2. auto under the cap: the plan must choose FSDP by itself            -> expected: trains
  3. the same FSDP run again with more steps: it resumes from job 2's checkpoint -> expected: resumes, trains on
  4. DDP  without a cap (for its peak memory and tokens/s)              -> expected: trains
Each rank records its peak GPU memory (allocated and reserved by torch's allocator, the part the cap limits),
its host memory (max RSS) and the run's tokens/s. The model is a random-weight Qwen2-architecture shape with many
wide MLP layers and Qwen's real tokenizer, built here (no download); only its shape matters for memory and speed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

# Wide MLPs and a narrow residual stream: many 4-bit weights per byte of embedding (Qwen's 151,936-token vocabulary
# makes the embedding, gathered whole by FSDP's root unit, the fixed cost a shard cannot split).
SHAPE = dict(hidden_size=512, intermediate_size=16384, num_layers=160, num_attention_heads=4, num_key_value_heads=1)
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def build_model(folder: Path, shape: dict) -> Path:
    """A random-weight model of `shape` written straight to safetensors (no fp32 copy in memory, no slow init)."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from freetune.fixtures import cached_tiny_model

    if (folder / ".complete").exists():
        return folder
    tiny = cached_tiny_model("qwen2")
    folder.mkdir(parents=True, exist_ok=True)
    for item in tiny.iterdir():  # the tokenizer files and a config to start from
        if item.is_file() and not item.name.endswith(".safetensors") and item.name != ".complete":
            shutil.copy(item, folder / item.name)
    config = json.loads((tiny / "config.json").read_text())
    config.update(hidden_size=shape["hidden_size"], intermediate_size=shape["intermediate_size"],
                  num_hidden_layers=shape["num_layers"], num_attention_heads=shape["num_attention_heads"],
                  num_key_value_heads=shape["num_key_value_heads"], tie_word_embeddings=True)
    config.pop("layer_types", None)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
    generator = torch.Generator().manual_seed(0)
    tensors, block = {}, None
    for name, param in model.state_dict().items():
        if "norm" in name:
            tensors[name] = torch.ones(param.shape, dtype=torch.bfloat16)
        elif name.endswith("bias"):
            tensors[name] = torch.zeros(param.shape, dtype=torch.bfloat16)
        elif name == "lm_head.weight":
            continue  # tied to the embedding
        else:
            numel = param.numel()
            if block is None or block.numel() < numel:  # one random block, sliced per tensor: fast to build
                block = torch.randn(max(numel, 64 * 2**20), generator=generator).to(torch.bfloat16) * 0.02
            tensors[name] = block[:numel].view(param.shape).clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / ".complete").touch()
    return folder


def synthetic_rows(n: int, words_per_row: int):
    """Plain prompt/completion rows of about the same length, different from each other (no download)."""
    from datasets import Dataset

    vocab = ("red green blue circle square line small large left right top bottom house tree river stone light "
             "dark water fire cloud north south east west open close fast slow").split()
    rows = []
    for i in range(n):
        words = [vocab[(i * 7 + j * 13 + j * j) % len(vocab)] for j in range(words_per_row)]
        half = words_per_row // 4
        rows.append({"prompt": f"Row {i}: " + " ".join(words[:half]), "completion": " " + " ".join(words[half:])})
    return Dataset.from_list(rows)


def worker(args) -> int:
    """One rank of one job (under torchrun): train, and record this rank's memory and speed."""
    import torch

    import freetune
    from freetune.platform import Paths
    from freetune.plan import make_plan

    ctx = freetune.distributed.init()
    out = Path(args.records)
    record = {"label": args.label, "rank": ctx.rank, "world_size": ctx.world_size, "cap_gib": args.cap_gib,
              "layout_asked": args.layout, "gpu": torch.cuda.get_device_name(ctx.local_rank)}
    plan = make_plan(model_shape=args.model, layout=args.layout, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
                     max_length=args.max_length, lora_rank=args.lora_rank, lora_targets=LORA_TARGETS,
                     optimizer="adamw_torch", memory_budget_gib=args.cap_gib or None, gradient_checkpointing=True)
    # The same rows per step in every job: the plan's memory-based batch choice is not what is compared here.
    plan.batch.micro_batch, plan.batch.grad_accum, plan.batch.max_length = args.micro_batch, args.grad_accum, args.max_length
    record.update(layout=plan.layout.kind, layout_why=plan.reasons.get("layout"),
                  estimate_gib=plan.memory.estimate.total_gib if plan.memory.estimate else None, plan_warnings=plan.warnings)
    run_dir = Path(args.run_dir)
    paths = Paths.under(run_dir)
    if ctx.is_main:
        paths.make()
    freetune.distributed.barrier()
    stage = "load"
    started = time.time()
    try:
        tokenizer = freetune.model.load_tokenizer(args.model)
        model = freetune.model.load_base_model(args.model, plan, local_rank=ctx.local_rank,
                                               memory_cap_gib=args.cap_gib)
        record["load_s"] = round(time.time() - started, 1)
        record["after_load_gib"] = round(torch.cuda.max_memory_allocated(ctx.local_rank) / 2**30, 3)
        model, trainable, total = freetune.model.attach_lora(model, rank=args.lora_rank, alpha=2 * args.lora_rank,
                                                             dropout=0.0, target_modules=LORA_TARGETS, seed=0)
        record.update(trainable=trainable, total_params=total)
        stage = "train"
        config = freetune.sft_config.make_config(
            paths, plan, max_steps=args.steps, micro_batch=args.micro_batch, grad_accum=args.grad_accum,
            learning_rate=1e-4, max_length=args.max_length, optimizer="adamw_torch", logging_steps=1,
            save_steps=args.steps, save_total_limit=2, gradient_checkpointing=True, seed=0)
        summary = freetune.train.train(model, tokenizer, synthetic_rows(256, args.max_length), config, plan=plan,
                                       paths=paths)
        history = json.loads((run_dir / "reports" / "log_history.json").read_text()) if ctx.is_main else []
        record.update(status="trained", steps=summary["steps"], resumed_from=summary["resumed_from"],
                      first_loss=summary["first_loss"], last_loss=summary["last_loss"], wall_s=summary["wall_s"],
                      tokens=summary["tokens"], tokens_per_s=summary["tokens_per_s"],
                      losses=[round(h["loss"], 4) for h in history if "loss" in h])
        if ctx.is_main:
            marker = sorted((run_dir / "checkpoints").glob("checkpoint-*/freetune_complete.json"))
            record["checkpoints_complete"] = [p.parent.name for p in marker]
            record["adapter_files"] = sorted(p.name for p in (run_dir / "adapter").glob("*"))
    except Exception as exc:  # noqa: BLE001 - the record says what happened; an OOM may arrive wrapped
        text = f"{type(exc).__name__}: {exc}"
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text.lower()
        record.update(status="out_of_memory" if oom else "failed", stage=stage, error=text[:600])
        if not oom:
            import traceback

            traceback.print_exc()
    record["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(ctx.local_rank) / 2**30, 3)
    record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(ctx.local_rank) / 2**30, 3)
    record["host_max_rss_gib"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.label}-rank{ctx.rank}.json").write_text(json.dumps(record, indent=1))
    print(f"record: {json.dumps(record)}", flush=True)
    if record["status"] != "trained":
        os._exit(3)  # the other rank may wait in a collective: end this one now, torchrun ends the job
    freetune.distributed.cleanup()
    return 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="")
    parser.add_argument("--layout", default="auto")
    parser.add_argument("--model", default="")
    parser.add_argument("--records", default="")
    parser.add_argument("--run-dir", default="")
    parser.add_argument("--work", default="/tmp/fsdp_check", help="model and run folders")
    parser.add_argument("--out", default="reports/gpu/fsdp_check.json")
    parser.add_argument("--cap-gib", type=float, default=1.75, help="per-GPU cap for the DDP-vs-FSDP runs")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resume-steps", type=int, default=4, help="steps the resumed FSDP run adds")
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--layers", type=int, default=SHAPE["num_layers"])
    # The FSDP job quantises the model on the CPU first (~200 s per rank for 4.1 B weights on the first run).
    parser.add_argument("--job-timeout", type=int, default=420, help="seconds per torchrun job")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.worker:
        return worker(args)

    import torch

    work = Path(args.work)
    shape = {**SHAPE, "num_layers": args.layers}
    started = time.time()
    model = build_model(work / f"model-{args.layers}l", shape)
    print(f"model ready in {time.time() - started:.0f} s: {model}", flush=True)
    from freetune.plan import ModelShape
    from freetune.plan.memory import NF4_BYTES_PER_PARAM

    shape_info = ModelShape.named(str(model))
    weights_4bit = shape_info.quantized_params * NF4_BYTES_PER_PARAM[True] / 2**30
    results = run_jobs(args, model, work)
    report = {
        "check": "FSDP-QLoRA vs DDP under a per-GPU memory cap (issue 10)",
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "torch": torch.__version__,
        "model": {"shape": shape, "quantized_params": shape_info.quantized_params,
                  "total_params": shape_info.total_params, "weights_4bit_gib": round(weights_4bit, 3),
                  "vocab": shape_info.vocab},
        "settings": {"cap_gib": args.cap_gib, "steps": args.steps, "micro_batch": args.micro_batch,
                     "grad_accum": args.grad_accum, "max_length": args.max_length, "lora_rank": args.lora_rank,
                     "lora_targets": LORA_TARGETS, "optimizer": "adamw_torch", "gradient_checkpointing": True,
                     "processes": 2},
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print_table(results)
    print(f"4-bit weights {weights_4bit:.2f} GiB, cap {args.cap_gib} GiB per GPU; written {out}")
    return 0


def run_jobs(args: argparse.Namespace, model: Path, work: Path) -> dict:
    """The four torchrun jobs one after another; each job's exit, wall time and ranks' records, by label."""
    # (label, layout, cap, steps, run folder): fsdp_resume continues fsdp_capped's run from its checkpoint.
    jobs = [("ddp_capped", "ddp", args.cap_gib, args.steps, "ddp_capped"),
            ("fsdp_capped", "auto", args.cap_gib, args.steps, "fsdp_capped"),
            ("fsdp_resume", "auto", args.cap_gib, args.steps + args.resume_steps, "fsdp_capped"),
            ("ddp_uncapped", "ddp", 0.0, args.steps, "ddp_uncapped")]
    records_dir = work / "records"
    results = {}
    for label, layout, cap, steps, run in jobs:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
               "--worker", "--label", label, "--layout", layout, "--model", str(model), "--records", str(records_dir),
               "--run-dir", str(work / "runs" / run), "--cap-gib", str(cap), "--steps", str(steps),
               "--micro-batch", str(args.micro_batch), "--grad-accum", str(args.grad_accum),
               "--max-length", str(args.max_length), "--lora-rank", str(args.lora_rank)]
        print(f"\n=== {label}: layout {layout}, cap {cap or 'none'} GiB", flush=True)
        t0 = time.time()
        # Its own session, so a timeout stops torchrun and its ranks together: left running, they would share the
        # GPUs with the next job and spoil its figures (seen in the first run of this check).
        proc = subprocess.Popen(cmd, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                  "FREETUNE_COLLECTIVE_TIMEOUT_S": "60"})
        try:
            code = proc.wait(timeout=args.job_timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            code = "timeout"
        ranks = [json.loads(p.read_text()) for p in sorted(records_dir.glob(f"{label}-rank*.json"))]
        results[label] = {"exit": code, "job_s": round(time.time() - t0, 1), "ranks": ranks}
    return results


def print_table(results: dict) -> None:
    print(f"\n{'job':<13} {'exit':>5} {'layout':>7} {'status':>14} {'peak alloc GiB (r0/r1)':>24} {'tok/s':>8} resumed from")
    for label, result in results.items():
        ranks = result["ranks"]
        peaks = "/".join(f"{r['peak_allocated_gib']:.2f}" for r in ranks)
        status = ranks[0]["status"] if ranks else "no record"
        rate = next((r.get("tokens_per_s") for r in ranks if r.get("tokens_per_s")), None)
        print(f"{label:<13} {str(result['exit']):>5} {ranks[0]['layout'] if ranks else '?':>7} {status:>14} "
              f"{peaks:>24} {rate or '-':>8} {ranks[0].get('resumed_from') if ranks else ''}")


if __name__ == "__main__":
    sys.exit(main())
