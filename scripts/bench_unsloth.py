"""The benchmark peer of scripts/bench.py (issue 25): one Unsloth run on the model, rows and LoRA that bench.py's own
runs train. Usage (bench.py starts it):  python scripts/bench_unsloth.py JOB.json

It runs in a process whose PYTHONPATH holds only the peer's own site (scripts/build_peer_wheels.sh; bench.py points
PYTHONPATH at $FREETUNE_PEER_SITE): Unsloth pins trl <= 1.15 and datasets < 5, below freetune's, so this file imports
nothing from freetune, only the standard library, torch, unsloth, transformers, trl and datasets. It reads the job
JSON bench.py writes for its own runs and writes the result keys bench.py's table reads.

Unsloth at its own best settings for throughput, as its notebooks set them:
- FastLanguageModel.from_pretrained(load_in_4bit=True, max_seq_length=1024), bf16 (uncapped) or fp16 (the T4 policy);
- get_peft_model(r=16, lora_alpha=32, lora_dropout=0, bias="none", the 7 linear projections): dropout 0 and no bias
  is what its fused LoRA kernels need; use_gradient_checkpointing="unsloth" (checkpointed activations offloaded to
  host memory) in the `unsloth` run, False in `unsloth_nockpt`;
- its SFTTrainer with padding_free=True (rows concatenated, kept apart by its attention dispatch): what its own
  rule (unsloth/utils/padding_choice.py) picks here when padding_free is left unset (sm90 is not among the GPUs
  it measured, and a run this short never repays the compile that padded batches take); 8 rows per step
  (micro-batch 8, no accumulation, as freetune's plan takes them), optim="adamw_8bit" (its notebooks' optimizer;
  not the paged one, whose state lives in unified memory outside torch's counters and would flatter the peak);
- its fused cross-entropy and its per-layer compile (one torch.compile region per decoder layer), both on by
  default; the compile skips padding-free batches (their row lengths are read on the host), so it runs only in
  the optional `unsloth_padded` run (padded batches, no checkpointing), the other candidate for its fastest.
Learning rate, schedule, seed and data order are freetune.sft_config.make_config's (same rows, same order; the per-step
losses are logged so the table can compare them).

The emulated budgets (bench.py's t4 and 4gb modes) hold the peer to what the emulated card can run:
- the memory cap: torch.cuda.set_per_process_memory_fraction, as freetune.model.cap_gpu_memory sets it, and
  torch.cuda.mem_get_info reporting the capped card (Unsloth sizes its fused cross-entropy chunks and its offload
  buffers from the free memory it reads there; a real 4 GB card reports 4 GB, not the H200's 141);
- attention: UNSLOTH_TORCH_VARLEN=0, Unsloth's own switch, keeps its padding-free rows off torch's varlen
  FlashAttention (sm80+) and on its per-segment SDPA, what it runs on a T4 without xformers (flash-attn and xformers
  are not installed); and SDPA itself is limited to its memory-efficient and math kernels (t4_kernels), which a T4
  runs, instead of the FlashAttention kernel it would pick on the H200. Its other compute-capability tests choose bf16-only Triton paths (unused in fp16) or tuning
  knobs of kernels Triton compiles for the GPU it runs on; freetune's runs get the H200's kernels there too;
- cuBLAS's workspace: the T4's size with bench.py --t4-cublas-workspace (CUBLAS_WORKSPACE_CONFIG, both tools' workers).
Which attention it used is read off the library after the run (attention_used), not assumed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

from gc_pauses import GcPauses  # scripts/, this file's folder (the peer's process has no freetune on its path)

LORA_RANK = 16
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# run -> (get_peft_model's use_gradient_checkpointing, SFTConfig's padding_free)
SETTINGS = {"unsloth": ("unsloth", True), "unsloth_nockpt": (False, True), "unsloth_padded": (False, False)}
# What each of Unsloth's attention paths is, by the attention_dispatch function that runs it (in the order its SDPA
# backend tries them: the per-segment path hands over to the dense mask where the rows do not tile the batch).
ATTENTION_PATHS = {
    "_torch_varlen_packed": ("torch_varlen", "torch's varlen FlashAttention over the packed rows (sm80+)"),
    "build_sdpa_packed_attention_mask": ("sdpa_mask", "SDPA with a dense block-diagonal mask over the packed row"),
    "_sdpa_packed_segments": ("sdpa_segments", "per-segment SDPA: one SDPA call per run of equal-length rows"),
}


def set_environment(job: dict, run_dir: Path) -> None:
    """Before Unsloth is imported (it reads these at import): offline, no usage statistics, its generated code in
    this run's folder, and the T4 policy's attention."""
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                      UNSLOTH_DISABLE_STATISTICS="1", UNSLOTH_COMPILE_LOCATION=str(run_dir / "unsloth_compiled_cache"))
    if job["precision"] == "fp16":  # the emulated T4 and 4 GB cards
        os.environ["UNSLOTH_TORCH_VARLEN"] = "0"


def emulate_card(cap_gib: float) -> None:
    """This process sees a card of cap_gib: allocations past it fail (as freetune.model.cap_gpu_memory caps its own
    runs), and torch.cuda.mem_get_info reports that card's free and total memory."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    cap = int(cap_gib * 2**30)
    if cap >= total:
        raise SystemExit(f"cap_gib={cap_gib} is not below this GPU's {total / 2**30:.1f} GiB")
    torch.cuda.set_per_process_memory_fraction(cap / total, 0)
    real = torch.cuda.mem_get_info

    def capped_mem_get_info(device=None):
        free, _ = real(device)
        return max(0, min(free, cap - torch.cuda.memory_reserved(device))), cap

    torch.cuda.mem_get_info = capped_mem_get_info
    print(f"GPU memory capped at {cap_gib:.2f} of {total / 2**30:.1f} GiB (emulating a smaller card; "
          f"{torch.cuda.memory_allocated() / 2**20:.0f} MiB allocated before the cap)", flush=True)


def t4_kernels(job: dict):
    """In the emulated T4 and 4 GB modes, SDPA limited to the kernels a T4 runs for fp16 (memory-efficient, math):
    on the H200 it would pick FlashAttention (sm80+) for the per-segment calls. freetune's runs are held to the same
    (scripts/bench.py, which also runs its own rows through the memory-efficient kernel)."""
    import contextlib

    if job["precision"] != "fp16":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def load(job: dict, dtype):
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=job["model"], max_seq_length=job["max_length"], dtype=dtype, load_in_4bit=True,
        use_exact_model_name=True, random_state=0)
    model = FastLanguageModel.get_peft_model(
        model, r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0, target_modules=LORA_TARGETS, bias="none",
        use_gradient_checkpointing=SETTINGS[job["run"]][0], random_state=0)
    return model, tokenizer


def make_trainer(job: dict, model, tokenizer, run_dir: Path, callbacks: list, cuda: bool, bf16: bool):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    # Cut at max_length as freetune's runs cut them. Unsloth's trainer cuts pre-tokenized rows itself for
    # padding-free batches, and turns padding-free off where it cannot: never here.
    rows = [row[:job["max_length"]] for row in json.loads(Path(job["rows"]).read_text())]
    total = job["warmup"] + job["steps"] + (1 if job.get("profile") else 0)  # the profiled step after the measured
    checkpointing, padding_free = SETTINGS[job["run"]]
    config = SFTConfig(
        output_dir=str(run_dir / "checkpoints"), max_steps=total, per_device_train_batch_size=8,
        gradient_accumulation_steps=1, learning_rate=1e-4, lr_scheduler_type="cosine",
        warmup_steps=max(1, math.ceil(0.03 * total)), weight_decay=0.0, max_grad_norm=1.0, optim="adamw_8bit",
        bf16=cuda and bf16, fp16=cuda and not bf16, use_cpu=not cuda,
        gradient_checkpointing=bool(checkpointing), padding_free=padding_free, max_length=job["max_length"],
        dataset_num_proc=1, logging_steps=job.get("logging_steps", 1), logging_first_step=True,
        save_strategy="no", report_to="none", disable_tqdm=True, seed=0, data_seed=0)
    return SFTTrainer(model=model, args=config, train_dataset=Dataset.from_dict({"input_ids": rows}),
                      processing_class=tokenizer, callbacks=callbacks)


def count_tokens(trainer, max_length: int) -> list[tuple[int, int]]:
    """(real tokens, tokens with padding) of each micro-batch the collator builds, in order (the i-th is step i's: one
    micro-batch a step; the dataloader may build the next one early, never out of order). Counted on the host."""
    counts = []
    collator = trainer.data_collator
    inner = collator.torch_call  # Unsloth's own wrapper (it adds the rows' lengths for its attention)

    def counting(examples):
        batch = inner(examples)
        counts.append((sum(min(len(e["input_ids"]), max_length) for e in examples), batch["input_ids"].numel()))
        return batch

    collator.torch_call = counting
    return counts


def marks_callback(warmup: int, total: int, cuda: bool):
    """A TrainerCallback that notes the wall time (GPU drained) and dynamo's graph count at the end of the warm-up
    and of the last measured step, and the garbage collector's pauses in between, as bench.py's Timer does for its
    runs."""
    import torch
    from torch._dynamo.utils import counters
    from transformers import TrainerCallback

    class Marks(TrainerCallback):
        def __init__(self):
            self.time, self.graphs, self.gc = {}, {}, GcPauses()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (warmup, total):
                if cuda:
                    torch.cuda.synchronize()
                self.time[state.global_step] = time.perf_counter()
                self.graphs[state.global_step] = counters["stats"]["unique_graphs"]
                if state.global_step == warmup:
                    self.gc.start()
                else:
                    self.gc.stop()

    return Marks()


@contextlib.contextmanager
def counting_attention(seen: dict):
    """Count, into `seen`, the calls of Unsloth's attention dispatch (attention_dispatch looks these functions up
    as module globals at each call): one key per backend and packing, one per path taken (ATTENTION_PATHS)."""
    import unsloth.utils.attention_dispatch as dispatch

    originals = {name: getattr(dispatch, name) for name in [*ATTENTION_PATHS, "_run_attention"]}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            key = name
            if name == "_run_attention":  # (config, context, Q, K, V), by keyword from run_attention
                config = kwargs["config"] if "config" in kwargs else args[0]
                context = kwargs["context"] if "context" in kwargs else args[1]
                packed = context.seq_info is not None
                key = f"backend {config.backend}, {'packed rows' if packed else 'no packing'}"
            seen[key] = seen.get(key, 0) + 1
            return fn(*args, **kwargs)
        return counted

    try:
        for name, fn in originals.items():
            setattr(dispatch, name, wrap(name, fn))
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dispatch, name, fn)


def describe_attention(seen: dict) -> tuple[str, str]:
    """(short name, what it is) of the attention path the counted calls took."""
    paths = [ATTENTION_PATHS[name] for name in ATTENTION_PATHS if seen.get(name)]
    backends = sorted(k for k in seen if k.startswith("backend"))
    if paths:
        return paths[0][0], "; ".join(p[1] for p in paths) + f" ({', '.join(backends)})"
    return (backends[0].split(",")[0].split()[-1] if backends else "unknown"), ", ".join(backends) or "no call seen"


def attention_used(trainer) -> tuple[str, str, dict]:
    """(short name, what it is, calls) of the attention path Unsloth's dispatch took on one real micro-batch.

    Parts of the step run compiled (its per-layer compile takes padded batches; its fused cross-entropy), so the
    dispatch is counted over one forward run eagerly (torch.compiler.set_stance("force_eager")) after the measured
    steps: the same dispatch code on the same shapes, counted where it runs, without touching the timed steps."""
    import torch

    examples = [trainer.train_dataset[i] for i in range(trainer.args.per_device_train_batch_size)]
    batch = trainer._prepare_inputs(trainer.data_collator(examples))
    seen: dict[str, int] = {}
    with counting_attention(seen), torch.no_grad(), torch.compiler.set_stance("force_eager"), \
            trainer.accelerator.autocast():
        trainer.model(**batch)
    return (*describe_attention(seen), seen)


def what_unsloth_did(model, trainer) -> dict:
    """The settings as the library applied them, read off the model and trainer after the run (not the arguments)."""
    import torch.utils.checkpoint

    layers = [m for m in model.modules() if hasattr(m, "self_attn") and hasattr(m, "mlp")]
    lora = fused_lora(layers)
    wrapped = sum(bool(getattr(type(m).forward, "_unsloth_block_compiled", False)) for m in layers)
    compiled = sum(bool(m.__dict__.get("_unsloth_block_checked")) for m in layers)  # set once a compiled call ran
    asked = getattr(model, "_unsloth_gradient_checkpointing", None)
    decoder = next((m for m in model.modules() if hasattr(m, "layers") and hasattr(m, "gradient_checkpointing")), None)
    active = bool(asked) and bool(getattr(decoder, "gradient_checkpointing", False))
    checkpoint = torch.utils.checkpoint.checkpoint  # Unsloth swaps in its offloading one for "unsloth"
    collator = trainer.data_collator
    return {
        "gradient_checkpointing": active,
        "checkpointing": ("offload" if asked == "unsloth" else "on") if active else "off",
        "checkpoint_function": f"{checkpoint.__module__}.{checkpoint.__name__}",
        "batching": "padding_free" if getattr(collator, "padding_free", False) else "padded",
        "lora_kernel": lora.pop("kernel"), "lora_fused_layers": lora,
        "compile": f"per layer ({compiled}/{len(layers)} ran compiled)" if compiled else (
            "off (its per-layer compile skips padding-free batches)" if wrapped else "off"),
        "optimizer": str(getattr(trainer.args.optim, "value", trainer.args.optim)),
        "precision": "bf16" if trainer.args.bf16 else ("fp16" if trainer.args.fp16 else "fp32"),
    }


def fused_lora(layers: list) -> dict:
    """How many decoder layers run Unsloth's fused LoRA kernels, per part ({"kernel": short name, part: count}); it
    fuses a part only where its conditions hold (no dropout, no bias: Qwen2's q/k/v biases keep peft's there)."""
    try:
        import unsloth.kernels as kernels
    except ImportError:  # its CPU backend (a smoke run) has none
        return {"kernel": "peft"}
    counts = {
        "qkv": sum(getattr(m.self_attn, "apply_qkv", None) is kernels.apply_lora_qkv for m in layers),
        "o": sum(getattr(m.self_attn, "apply_o", None) is kernels.apply_lora_o for m in layers),
        "mlp": sum(getattr(getattr(m.mlp.forward, "__func__", None), "__name__", "").startswith("apply_lora_mlp")
                   for m in layers),
    }
    parts = [part for part, n in counts.items() if layers and n == len(layers)]
    kernel = "unsloth" if len(parts) == 3 else ("unsloth " + "+".join(parts) if parts else "peft")
    return {"kernel": kernel, **counts, "layers": len(layers)}


def peaks(cuda: bool) -> dict:
    import torch

    if not cuda:
        import resource

        return {"peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 3)}
    return {"peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3)}


def profile_callback(step: int, vocab: int):
    """A TrainerCallback that profiles optimizer step `step` + 1 (after the measured ones, as bench.py's StepProfiler
    does for freetune's runs): wall time, the GPU's busy time, and where that time went (scripts/step_breakdown.py)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import TrainerCallback

    from step_breakdown import breakdown, text

    class StepProfile(TrainerCallback):
        prof, t0, summary = None, 0.0, {}

        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == step and self.prof is None:
                torch.cuda.synchronize()
                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True)
                self.prof.__enter__()
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if self.prof is None or self.summary or state.global_step != step + 1:
                return
            torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            parts = breakdown(self.prof, LORA_RANK, vocab)
            busy = parts["total_ms"] / 1000
            self.summary = {"wall_s": round(wall, 4), "gpu_busy_s": round(busy, 4),
                            "gpu_busy_share": round(busy / wall, 3) if wall else None, "breakdown": parts}
            print(f"unsloth: profile of step {state.global_step}: wall {wall:.3f} s\n{text(parts)}", flush=True)

    return StepProfile()


def run(job: dict) -> dict:
    run_dir = Path(job["work"]) / f"{job['mode']}-{job['run']}-1"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh folder (and generated code) per run, as bench.py's runs
    run_dir.mkdir(parents=True)
    set_environment(job, run_dir)
    import torch

    import unsloth  # noqa: F401 - before transformers, trl and peft, as Unsloth asks (it patches them)

    cuda = torch.cuda.is_available()
    if cuda and job["cap_gib"]:
        emulate_card(job["cap_gib"])  # after Unsloth's import (it sets the allocator up), before the model loads
    bf16 = job["precision"] != "fp16" and cuda and torch.cuda.is_bf16_supported()
    model, tokenizer = load(job, (torch.bfloat16 if bf16 else torch.float16) if cuda else None)
    warmup, total = job["warmup"], job["warmup"] + job["steps"]
    marks = marks_callback(warmup, total, cuda)
    profiler = profile_callback(total, model.config.vocab_size) if job.get("profile") and cuda else None
    trainer = make_trainer(job, model, tokenizer, run_dir, [marks] + ([profiler] if profiler else []), cuda, bf16)
    tokens = count_tokens(trainer, job["max_length"])
    load_peak = peaks(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    with t4_kernels(job):
        trainer.train()
    memory = {k: max(v, load_peak[k]) for k, v in peaks(cuda).items()}  # the whole process, as freetune's runs
    if marks.graphs[total] > marks.graphs[warmup]:
        print(f"warning: dynamo compiled {marks.graphs[total] - marks.graphs[warmup]} graphs during the measured "
              f"steps: their compile time is inside the timing (more warm-up steps would keep it out)", flush=True)
    try:
        short, detail, calls = attention_used(trainer)
    except Exception as exc:  # noqa: BLE001 - the measurement stands without it
        short, detail, calls = "unknown", f"not read: {type(exc).__name__}: {exc}", {}
    print(f"unsloth attention: {short}: {detail}", flush=True)
    versions = {name: _version(name) for name in ("unsloth", "trl", "transformers", "peft", "datasets",
                                                   "bitsandbytes")}
    return {
        "mode": job["mode"], "run": job["run"], "world_size": 1, "model_shape": job["model_shape"],
        "cap_gib": job["cap_gib"], "max_length": job["max_length"], "micro_batch": 8, "grad_accum": 1,
        "sampler": "random", **what_unsloth_did(model, trainer), "attention": short, "attention_detail": detail,
        "attention_calls": calls, "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
        **rates(marks, tokens, warmup, total), "logging_steps": trainer.args.logging_steps,
        "gc_pauses": marks.gc.summary(),
        "losses": [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h],
        "load_peak": load_peak, **memory, "versions": {**versions, "torch": torch.__version__},
        **({"gpu": torch.cuda.get_device_name(0)} if cuda else {}),
        **({"profile": profiler.summary} if profiler is not None and profiler.summary else {}),
    }


def rates(marks, tokens: list[tuple[int, int]], warmup: int, total: int) -> dict:
    """Real tokens per second over the measured steps (warm-up excluded), as bench.py reports its runs'."""
    seconds = marks.time[total] - marks.time[warmup]
    real = sum(r for r, _ in tokens[warmup:total])
    padded = sum(p for _, p in tokens[warmup:total])
    return {"measured_steps": total - warmup, "warmup_steps": warmup, "tokens": real, "seconds": round(seconds, 3),
            "tokens_per_s": round(real / seconds, 1), "step_s": round(seconds / (total - warmup), 4),
            "pad_fraction": round(1 - real / padded, 4),
            # Graphs dynamo compiled during the measured steps: compile time inside the timing (0 is clean).
            "dynamo": {"graphs_at_warmup_end": marks.graphs[warmup], "graphs_at_end": marks.graphs[total]}}


def _version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def failure(job: dict, exc: BaseException) -> dict:
    """The row a run that stopped leaves (bench.py's failed-run shape): out of memory is a result under a cap."""
    text = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:160]
    oom = "out of memory" in str(exc).lower() or type(exc).__name__ == "OutOfMemoryError"
    return {"mode": job["mode"], "run": job["run"], "world": 1, "out_of_memory": oom,
            "failed": ("out of memory: " if oom else "") + text}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    try:
        result = run(job)
    except Exception as exc:  # noqa: BLE001 - any failure is this run's row; the orchestrator goes on
        traceback.print_exc()
        Path(job["result"]).write_text(json.dumps(failure(job, exc)))
        return 1
    Path(job["result"]).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
