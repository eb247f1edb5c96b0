"""scripts/bench.py's worker: one configuration (one job) trained in this process, or one rank of it under torchrun,
and its measurements."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from freetune.plan import ModelShape
from scripts.bench_experiments import EXPERIMENTS, apply_ddp_experiments, apply_experiments
from scripts.bench_prepare import LORA_RANK, ROWS_PER_STEP, shape_of
from scripts.bench_probes import StackSampler, step_profiler_class, timer_class


def run_one(job: dict) -> dict:
    """One configuration in this process (under torchrun: one rank of it). Returns the measurements."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer

    import freetune

    ctx = freetune.distributed.init()
    shape = shape_of(job["shape"])
    cuda = torch.cuda.is_available()
    run_dir = Path(job["work"]) / f"{job['mode']}-{job['run']}-{job['world']}"
    paths = fresh_run_folder(run_dir, ctx)
    plan, experiments = job_plan(job, shape, run_dir)
    apply_experiments(experiments, shape, ctx.local_rank)
    if ctx.is_main:
        print(f"== {job['mode']} / {job['run']} / {job['world']} process(es)\n{plan.table()}", flush=True)

    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    rows = json.loads(Path(job["rows"]).read_text())
    dataset = Dataset.from_dict({"input_ids": rows})
    model = freetune.model.load_base_model(job["model"], plan, local_rank=ctx.local_rank,
                                           memory_cap_gib=job["cap_gib"] if cuda else 0.0)
    # The mode's recipe's LoRA dropout, unless a variant asks for another (lora_dropout=0: the peer's LoRA)
    dropout = float(experiments.get("lora_dropout", job["lora_dropout"]))
    model, trainable, _ = freetune.model.attach_lora(model, rank=LORA_RANK, alpha=2 * LORA_RANK, dropout=dropout,
                                                     seed=0)
    total_steps = job["warmup"] + job["steps"]
    most_tokens = [0]  # the largest micro-batch's tokens (padding included): what the memory estimate sizes

    def count_tokens(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and module.training:
            most_tokens[0] = max(most_tokens[0], ids.numel())

    model.register_forward_pre_hook(count_tokens, with_kwargs=True)
    config = freetune.sft_config.make_config(
        paths, plan, max_steps=total_steps + (1 if job.get("profile") else 0),  # the plan's batch and optimizer
        learning_rate=1e-4, max_length=job["max_length"], logging_steps=job.get("logging_steps", 1),
        save_steps=100_000, seed=0)
    ddp_experiment_callbacks = apply_ddp_experiments(experiments, config)
    sampler = StackSampler() if job.get("sample_stacks") else None
    timer = timer_class()(job["warmup"], job["steps"], cuda, ctx.rank, sampler)
    # The profiled step comes after the measured ones: the profiler's own overhead stays out of the timings. Every
    # rank profiles the same step (under DDP the ranks wait for each other, so one rank's wait is the other's work);
    # the report keeps rank 0's summary, the log has every rank's tables.
    profiler = step_profiler_class()(total_steps, cuda, ctx.rank, shape.vocab) if job.get("profile") else None
    callbacks = ddp_experiment_callbacks + [timer] + ([profiler] if profiler is not None else [])
    history = train_run(job, model, tokenizer, dataset, config, plan, paths, callbacks, ctx)
    if not ctx.is_main:
        freetune.distributed.cleanup()
        return {}
    result = {**measurements(job, shape, plan, config, history, timer, trainable, most_tokens[0]),
              "lora_dropout": dropout}
    if profiler is not None and profiler.summary:
        result["profile"] = profiler.summary
    if sampler is not None:
        samples = result["stack_samples"] = sampler.summary()
        print(f"where the host's time went (share of wall time; threads busy: {samples['busy']}), self:\n"
              + "\n".join(f"  {share:6.1%}  {where}  | {line}" for share, where, line in samples["self"])
              + "\ninclusive:\n" + "\n".join(f"  {share:6.1%}  {where}" for share, where in samples["inclusive"]),
              flush=True)
    result.update(host_and_memory(timer, cuda))
    freetune.distributed.cleanup()
    return result


def fresh_run_folder(run_dir: Path, ctx):
    """The run's Paths, its folder emptied and made by the main process (the others wait for it)."""
    import freetune
    from freetune.platform import Paths

    paths = Paths.under(run_dir)
    if ctx.is_main:
        # A fresh folder per run: the checkpoints an earlier run left there would stop train() ("holds checkpoints
        # of an earlier run"), as it must for a user's run, not for a benchmark repeated on a warm machine.
        shutil.rmtree(run_dir, ignore_errors=True)
        paths.make()
    freetune.distributed.barrier()
    return paths


def job_plan(job: dict, shape: ModelShape, run_dir: Path):
    """The plan this job's run follows, and the --variants experiments it asks for (not plan fields)."""
    from freetune.plan import make_plan, read_hardware

    hardware = read_hardware(str(run_dir), str(run_dir))
    # freetune[matched]: the budget of the peer's peak (+5%) under the mode's cap, set when it was launched
    budget = job.get("budget_gib") or job["cap_gib"] or None
    # The plan freetune would make for this cap: freetune runs it, plain_best borrows its micro-batch and
    # checkpointing (the best the cap allows) but not its batching, attention or trainer.
    dropout = float((job.get("overrides") or {}).get("lora_dropout", job["lora_dropout"]))  # as run_one attaches it
    plan = make_plan(hardware, model_shape=shape, max_length=job["max_length"], micro_batch=None,
                     grad_accum=ROWS_PER_STEP, lora_rank=LORA_RANK, precision=job["precision"],
                     memory_budget_gib=budget, lora_dropout=dropout, longest_row=job.get("longest_row"))
    plain = dict(batching="padded", sampler="random", attn_implementation="sdpa", lora_kernel="peft", compile=False,
                 optimizer="paged_adamw_8bit", frozen_dtype="float32", offload_activations=False, cuda_graph_tokens=0,
                 cuda_graph_max_tokens=0,
                 reasons={**plan.reasons, "batching": "plain stack: padded to the longest row of the batch",
                          "attention": "plain stack: sdpa", "sampler": "plain stack: random order"})
    if job["run"] == "free_tier":
        plain["reasons"].update(batch="free-tier recipe", gradient_checkpointing="free-tier recipe")
        plan = plan.replace(micro_batch=1, grad_accum=ROWS_PER_STEP, gradient_checkpointing=True, **plain)
    elif job["run"] == "plain_best":
        plan = plan.replace(**plain)
    elif job.get("batching"):  # --tiny: a CPU plan keeps padded batches; smoke the GPU's padding-free path
        plan = plan.replace(batching=job["batching"],
                            reasons={**plan.reasons, "batching": f"{job['batching']}, as --tiny asks"})
    overrides = dict(job.get("overrides") or {})
    experiments = {k: overrides.pop(k) for k in EXPERIMENTS if k in overrides}
    # fp32_absmax: the fused layers' fp32 absmax copy even where compiled layers decode 8-bit, as a plan variant.
    if experiments.pop("fp32_absmax", False):
        overrides["keep_8bit_absmax"] = False
    if overrides:  # a --variants run: freetune's plan with some choices changed
        plan = plan.replace(**overrides, reasons={**plan.reasons, **{k: "as --variants asks" for k in overrides}})
    return plan, experiments


def train_run(job: dict, model, tokenizer, dataset, config, plan, paths, callbacks: list, ctx) -> list[dict]:
    """Train the job's run, freetune's path or the plain stack; the log history (rank 0's; [] on other ranks)."""
    import torch
    from trl import SFTTrainer

    import freetune
    from freetune.model import adapter_dtype_guard

    cuda = torch.cuda.is_available()
    if not job["run"].startswith("freetune"):
        # The plain stack as it comes: the Trainer's defaults that freetune.sft_config.make_config changes to cut host
        # syncs (a blocking copy of each batch to the GPU, the NaN check of every micro-batch's loss).
        config.logging_nan_inf_filter = True
        config.dataloader_pin_memory = True
        config.accelerator_config.non_blocking = False
    if job["precision"] == "fp16" and cuda:
        # The T4's SDPA kernels (memory-efficient, math), as the peer is held to (bench_unsloth.t4_kernels): this
        # worker process runs one configuration, so the switch is process-wide.
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_cudnn_sdp(False)
    if job["run"].startswith("freetune"):
        freetune.train.train(model, tokenizer, dataset, config, plan=plan, paths=paths, resume=False,
                             extra_callbacks=callbacks)
        return json.loads((Path(paths.reports) / "log_history.json").read_text()) if ctx.is_main else []
    # The plain stack: TRL's trainer, collator and loss as they come. The fp32 LoRA guard stays: without it
    # the fp16 (T4) runs stop with TRL's bf16 LoRA weights under fp16 AMP, the bug freetune exists to fix.
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                         callbacks=[adapter_dtype_guard(), *callbacks])
    trainer.train()
    return trainer.state.log_history


def measurements(job: dict, shape: ModelShape, plan, config, history: list[dict], timer, trainable: int,
                 most_tokens: int) -> dict:
    """The run's report entry: its settings, rates, losses and the memory estimates (rank 0's)."""
    warmup, measured, total_steps = timer.warmup, timer.measured, timer.total_steps
    tokens = {h["step"]: h["num_tokens"] for h in history if "num_tokens" in h}
    pads = [h["pad_fraction"] for h in history if "pad_fraction" in h]
    seconds = timer.marks[total_steps] - timer.marks[warmup]
    real_tokens = tokens[total_steps] - tokens[warmup]
    result = {
        "mode": job["mode"], "run": job["run"], "world_size": job["world"], "model_shape": shape.name,
        "precision": plan.precision.mixed, "cap_gib": job["cap_gib"], "max_length": job["max_length"],
        "micro_batch": plan.batch.micro_batch, "grad_accum": plan.batch.grad_accum, "batching": plan.batch.batching,
        "gradient_checkpointing": plan.memory.checkpointing, "attention": plan.kernels.attention,
        "trainable_params": trainable, "measured_steps": measured, "warmup_steps": warmup,
        "tokens": real_tokens, "seconds": round(seconds, 3), "tokens_per_s": round(real_tokens / seconds, 1),
        "step_s": round(seconds / measured, 4),
        "pad_fraction": round(sum(pads) / len(pads), 4) if pads else None,
        "losses": [round(h["loss"], 4) for h in history if "loss" in h],
        "lora_kernel": plan.kernels.lora, "mlp_kernel": plan.kernels.mlp, "compile": plan.kernels.compile,
        "optimizer": plan.memory.optimizer,
        "sampler": plan.layout.sampler, "logging_steps": config.logging_steps,
        "frozen_dtype": plan.precision.frozen_dtype, "offload_activations": plan.memory.offload_activations,
        "max_micro_batch_tokens": most_tokens,
        "budget_gib": job.get("budget_gib") or job["cap_gib"] or None, "matched_to": job.get("matched_to"),
        "peak_target_gib": job.get("peak_target_gib"),
        # The plan's estimate of this run's peak (every row at max_length), and re-made at the largest micro-batch
        # this run really saw: how far the memory model is from the measured peak.
        "estimate_gib": (round(plan.memory.estimate.peak_allocated_gib, 3) if plan.memory.estimate is not None
                         else None),
        "estimate_at_seen_tokens_gib": seen_estimate(plan, shape, most_tokens),
    }
    if plan.kernels.compile:
        # What the compiled layers became: one graph per layer and no break is the fast shape; breaks or graphs per
        # length mean pieces running eagerly (the regression of reports/gpu/bench_breaks_fn_disabled.json).
        from torch._dynamo.utils import counters

        result["dynamo"] = {"unique_graphs": counters["stats"]["unique_graphs"],
                            "graph_breaks": sum(counters["graph_break"].values()),
                            "frames_ok": counters["frames"]["ok"], "frames_total": counters["frames"]["total"]}
    return result


def host_and_memory(timer, cuda: bool) -> dict:
    """Rank 0's host time (every rank's is in the log) and its peak memory (torch's counters, or the RSS)."""
    import torch

    import freetune

    out = {}
    if timer.busiest:
        out["thread_cpu_s"] = timer.busiest
    if timer.phases:
        out["host_phase_ms"] = timer.phase_summary()
        out["gc_pauses"] = timer.gc.summary()
    if cuda:
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        out["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
        out["gpu"] = torch.cuda.get_device_name(0)
    else:
        out["peak_rss_gib"] = round(freetune.train.memory_gib()[1], 3)
    return out


def seen_estimate(plan, shape: ModelShape, tokens: int) -> float | None:
    """freetune.plan.memory.estimate with the plan's settings at `tokens` tokens in one micro-batch."""
    from freetune.plan import estimate

    if plan.memory.estimate is None or not tokens:
        return None
    settings = {k: v for k, v in plan.memory.estimate.settings.items()
                if k not in ("model", "max_length", "micro_batch")}
    settings.update(gradient_checkpointing=plan.memory.checkpointing, optimizer=plan.memory.optimizer,
                    lora_kernel=plan.kernels.lora, frozen_dtype=plan.precision.frozen_dtype,
                    offload_activations=plan.memory.offload_activations, mlp_kernel=plan.kernels.mlp,
                    loss_tile_tokens=plan.kernels.loss_tile_tokens)
    return round(estimate(shape, max_length=tokens, micro_batch=1, **settings).peak_allocated_gib, 3)
