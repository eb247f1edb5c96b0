"""Side-by-side training throughput: the plain TRL stack against freetune's default path (issue 8).

On one model shape, the same synthetic SFT rows (random token ids, 300-1,200 tokens each, cut at 1,024) and the
same LoRA (rank 16, all linear layers, NF4 base), three runs per mode:
  free_tier   the usual free-tier recipe on the plain stack: TRL's SFTTrainer as it comes, batch 1 x
              accumulation 8, gradient checkpointing, paged 8-bit AdamW;
  plain_best  the plain stack at the best setting the same memory cap allows: the micro-batch and checkpointing
              freetune's plan picks for that cap, but padded batches, sdpa, peft's LoRA layers, eager layers,
              paged 8-bit AdamW and TRL's own per-step metrics;
  freetune    freetune's default path: make_plan (micro-batch, checkpointing, batching, attention, LoRA kernel,
              compile, optimizer) -> freetune.model -> freetune.train.train.
and, with --runs ...,unsloth,unsloth_nockpt[,unsloth_padded], the peer users would pick (issue 25): Unsloth at its
own best settings (scripts/bench_unsloth.py says which), with its offloaded checkpointing or none, in a process of its
own on the Unsloth site $FREETUNE_PEER_SITE (default /tmp/usite; scripts/build_peer_wheels.sh makes its wheels).
Modes (each run in fresh processes, one at a time, so the memory cap, the peak counters and the host's CPUs
belong to one run; --parallel runs two single-GPU runs at once, one per GPU, faster but skewed):
  uncapped    Qwen2.5-1.5B shape, bf16, the whole GPU;
  t4          Qwen2.5-1.5B shape under a 14.5 GiB cap (torch.cuda.set_per_process_memory_fraction) and the T4's
              fp16 policy (precision="fp16": fp16 autocast with loss scaling, no FlashAttention-only kernels),
              for both tools (--t4-cublas-workspace: the T4's cuBLAS workspace too);
  4gb         TinyLlama-1.1B shape under a 4 GiB cap, the same T4 policy;
  t4_8b       Qwen3-8B shape (home_assistant's model) under the 14.5 GiB cap and the T4 policy, rows of 150-500
              tokens as that recipe's (--row-lengths changes them; 'max': every row at max_length, GPU-bound).
With 2 GPUs the uncapped free_tier and freetune runs are repeated under torchrun (DDP) for the scaling efficiency,
each right after its 1-GPU run (the lent host's speed drifts over minutes; --variants 'again:' repeats a pair).

Reported per run: non-padding tokens/s (tokens of real rows through the model per second, every rank),
optimizer-step time, peak allocated and reserved GiB (torch's counters, rank 0), and MFU: 6N and 4N FLOPs per
token (N = the matmul weights a token passes: decoder linear layers + lm_head; 4N is what LoRA on a frozen base
needs, no weight gradients; attention's own FLOPs and checkpointing's recompute are not counted) against the
bf16 matmul rate this script measures on the GPU. With the peer: freetune's tokens/s over the fastest Unsloth run
of the mode that fits (x Unsloth), and issue 25's targets, met or not, under the table.

Usage (GPU machine):  python scripts/bench.py --out reports/gpu/bench.json   (~17 min on two H200s, the compiled
                      runs compile for ~100 s each; split it to fit 10-minute calls: --modes uncapped --no-ddp,
                      --modes t4,4gb --no-ddp, then --modes uncapped --runs freetune --ddp-only --merge FIRST.json)
Where the time goes:  --profile (torch.profiler over one extra step, and where it made the host wait for the GPU;
                      on a GPU its kernel time by category and phase, scripts/step_breakdown.py, the peer's too),
                      --variants 'eager:compile=false;...' (plan choices), 'flat:flat_sync=true' (DDP settings).
The plan's memory estimate on the rows the embedded default trains on (the bundled SVG sample, the plan sized from
its longest row):     --rows svg_sample --modes uncapped,t4 --runs freetune
CPU smoke test:       python scripts/bench.py --tiny --out /tmp/bench.json   (tiny shape, a few steps, no caps)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a file (python scripts/bench.py): its sibling modules by the package's name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# The jobs are split by what they do (bench_prepare, bench_probes, bench_experiments, bench_worker, bench_schedule,
# bench_report); this file is the entry point (its arguments and main) and names them all for callers and tests.
from freetune.plan import KNOWN_SHAPES  # noqa: F401
from scripts.bench_experiments import (  # noqa: F401
    DDP_EXPERIMENTS, EXPERIMENTS, PATCHES, MissingPatchTarget, Patch, apply_experiments, check_experiments, ddp_only,
    patch_targets)
from scripts.bench_prepare import (  # noqa: F401
    ARCHITECTURE, MATCHED, MODES, PEER_RUNS, REPO, ROW_LENGTHS, ROW_SOURCES, RUNS, build_model, build_tokenizer,
    parse_row_lengths, recipe_default, shape_named, shape_of, svg_sample_rows, synthetic_rows)
from scripts.bench_probes import StackSampler  # noqa: F401
from scripts.bench_report import counts_as_failure, peer_targets, summarise, table  # noqa: F401
from scripts.bench_schedule import (  # noqa: F401
    Schedule, in_rounds, make_jobs, matched_job, merge_runs, mode_lengths, one_per_run, parse_variants, peer_site,
    run_order)
from scripts.bench_worker import job_plan, run_one  # noqa: F401


VARIANTS_HELP = (
    "extra freetune runs with plan choices changed, ';'-separated 'label:field=value,...' "
    "(e.g. 'eager:compile=false;peft:lora_kernel=peft,optimizer=paged_adamw_8bit'); also the "
    "experiments liger=true (Liger's RMSNorm/SwiGLU/RoPE, liger-kernel installed), "
    "cpp_wrapper=true (inductor's C++ wrapper), combo_kernels=true (inductor's horizontal "
    "fusion), byte_masks=true (dropout masks a byte per "
    "element, as before freetune.speed.lora_kernel.pack_mask; with mlp_kernel=layers only), "
    "fp32_absmax=true (the fused layers' fp32 absmax copy where compiled ones keep 8-bit), "
    "per_layer_casts=true (each layer casts its own LoRA weights), copied_heads=true (the "
    "T4 attention's heads copied into parts), kv_head_calls=true (the T4 "
    "attention a kv head at a time where the plan put every head in one call), optimizer_per_tensor=true "
    "(bitsandbytes' 8-bit AdamW with a launch and a host sync per LoRA weight), trl_empty_cache=true (TRL's offloading "
    "empties the CUDA cache every micro-batch), no_triton=true (the custom ops' element-wise "
    "work without freetune.speed.triton_kernels), op_dgrad=true (the backward's input "
    "gradients through freetune::dequantized_mm where the plan dequantises them in the compiled graphs), "
    "addmm_sums=true (the compiled layers add every LoRA term in place, through freetune::add_product_), "
    "out_of_place_backward_sums=true (the backward's out of place too, as where no CUDA graphs ran before), "
    "traced_addmm=true (the in-place sums as a traced addmm_, which copies its input), "
    "widening_addmm=true (an MLP's gate and up as the base product and an in-place LoRA sum, not one product over "
    "[x | h]), dropout_inductor=true (compiled layers' LoRA dropout as inductor draws it, a Philox call per element, "
    "not 8 elements a call with the LoRA-A product in the same kernel), dropout_op=true (drawn 8 a call, the "
    "dropped input written and multiplied by A apart), dropout_backward_kernels=true (the backward's dropout "
    "terms from the mask's bits in one kernel each, not the unpacked mask through inductor and cuBLAS), "
    "skip_guards=true (after two steps dynamo checks only the guards that tell the layers' "
    "graphs apart), no_asserts=true (no size/stride checks in the compiled graphs' "
    "wrappers), gc_unfrozen=true (no gc.freeze after the warm-up), "
    "lora_dropout=0 (freetune with the peer's LoRA: no dropout; default: the mode's "
    "recipe's), "
    "dense_head=true and no_packed_check=true (two host syncs per step removed), "
    "pin_cores=true (scripts/bench_experiments.py) and "
    "the DDP settings ddp_split=true, "
    "static_graph=true, bucket_view=true, bucket_mb=N, flat_sync=true (apply_ddp_experiments; "
    "a variant of only these runs under DDP only). 'label:' alone repeats freetune's runs")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_call_arguments(parser)
    add_run_arguments(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    return args


def add_call_arguments(parser: argparse.ArgumentParser) -> None:
    """What a call runs: where it writes, which modes and runs, on how many GPUs, in what time."""
    parser.add_argument("--out", default=None,
                        help="JSON results (default reports/gpu/bench.json; with --tiny a file in the temp folder, so "
                             "that a smoke run never overwrites the committed GPU record)")
    parser.add_argument("--work", default="/tmp/freetune_bench", help="models, rows and run folders")
    parser.add_argument("--modes", default="uncapped,t4,4gb", help="comma-separated: " + ", ".join(MODES))
    parser.add_argument("--no-ddp", action="store_true", help="skip the 2-GPU (torchrun) runs")
    parser.add_argument("--ddp-only", action="store_true",
                        help="only the 2-GPU runs (their efficiency then needs --merge with a report of the "
                             "single runs)")
    parser.add_argument("--merge", nargs="*", default=[],
                        help="reports whose runs join this one's (e.g. the single-GPU runs of an earlier call)")
    parser.add_argument("--budget-s", type=float, default=480, help="start no run after this many seconds")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shape, a few steps, no caps")
    parser.add_argument("--parallel", action="store_true",
                        help="single-GPU runs side by side, one per GPU: about half the wall time, but the runs then "
                             "share the host's CPUs and their rates (and the DDP baseline) are skewed")
    parser.add_argument("--spawn", action="store_true", help="--tiny in fresh processes, as on a GPU machine")
    parser.add_argument("--runs", default=",".join(RUNS),
                        help="comma-separated subset of: " + ", ".join(RUNS + PEER_RUNS) + " (unsloth...: the peer, "
                             "see the top)")
    parser.add_argument("--steps", type=int, default=10,
                        help="measured steps of the plain_best, freetune and peer runs (more steps, less noise from "
                             "the rows' mix of lengths; each step ~0.5 s on an H200)")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How each run trains and what it measures: variants, rounds, rows, logging, profiling."""
    parser.add_argument("--variants", default="", help=VARIANTS_HELP)
    parser.add_argument("--t4-cublas-workspace", action="store_true",
                        help="in the t4 and 4gb modes also the T4's cuBLAS workspace (8 MiB per thread and stream, "
                             "not the H200's 32): both tools' peaks as on a T4, but every matmul about three times "
                             "the host time on Hopper (T4_CUBLAS_WORKSPACE)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the single-GPU runs this many times, every other round in reverse order; each "
                             "run's tokens/s is the median of its rounds (every round's in the report's each_round), "
                             "its peak memory the highest: the lent host's speed drifts between runs")
    parser.add_argument("--like-for-like", action="store_true",
                        help="one more freetune run per mode with the peer's LoRA dropout (0) and optimizer (8-bit "
                             "AdamW), judged against the mode's target like the default run (LIKE_FOR_LIKE); with "
                             "--match-peer-memory, freetune[matched] is planned with the peer's LoRA dropout (0) too")
    parser.add_argument("--logging-steps", type=int, default=1,
                        help="every run logs every N steps (each log step reads the metrics on the host: a sync); "
                             "the warm-up and measured steps are rounded up to multiples of N, the token counts being "
                             "read from the log. The recipes log every 5")
    parser.add_argument("--profile", action="store_true",
                        help="profile one more step after the measured ones (torch.profiler): GPU busy share, "
                             "kernels, top ops in the log")
    parser.add_argument("--sample-stacks", action="store_true",
                        help="sample every thread's Python stack each millisecond over the measured steps "
                             "(StackSampler): where the host's time goes, printed and in the report; the runs are a "
                             "little slower")
    parser.add_argument("--rows", choices=ROW_SOURCES, default="synthetic",
                        help="synthetic: random token ids, 300-1,200 tokens cut at 1,024 (the speed table's); "
                             "svg_sample: the bundled SVG sample (freetune/sample_data) rendered as svg_coder renders "
                             "it (its system prompt, Qwen2.5's chat template and tokenizer), the plan sized from its "
                             "longest row as the recipe's replan does: the memory estimate against the peak on the "
                             "rows the embedded default trains on")
    parser.add_argument("--row-lengths", default="",
                        help="the synthetic rows' lengths in tokens, 'MIN,MAX' (uniform; cut at 1,024) or 'max': every "
                             "row at max_length, the GPU-bound case (default: the mode's own, 300,1200; t4_8b's "
                             "150,500)")
    parser.add_argument("--match-peer-memory", action="store_true",
                        help="one more freetune run per mode, freetune[matched], planned (make_plan's "
                             "memory_budget_gib) for a peak allocated of the fastest Unsloth run that fit in this "
                             "call + 5%% (issue 49's memory target), under the mode's cap; needs an Unsloth run in "
                             "--runs")


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Values argparse cannot check alone, refused before any work."""
    if args.row_lengths:
        try:
            parse_row_lengths(args.row_lengths)
        except ValueError as exc:
            parser.error(str(exc))
    modes = set(args.modes.split(",")) - set(MODES)
    if modes:
        parser.error(f"--modes: no mode called {', '.join(sorted(modes))}; pick from {', '.join(MODES)}")
    if args.match_peer_memory and not set(args.runs.split(",")) & set(PEER_RUNS):
        parser.error(f"--match-peer-memory plans freetune for an Unsloth run's peak: add one of {', '.join(PEER_RUNS)} "
                     f"to --runs")
    unknown = set(args.runs.split(",")) - set(RUNS + PEER_RUNS)
    if unknown:
        parser.error(f"--runs: no run called {', '.join(sorted(unknown))}; pick from {', '.join(RUNS + PEER_RUNS)}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if set(args.runs.split(",")) & set(PEER_RUNS):
        peer_site()  # before any model is built: the peer's site must be there

    if args.worker:
        job = json.loads(Path(args.worker).read_text())
        try:
            result = run_one(job)
        except Exception as exc:  # e.g. make_plan refusing freetune[matched]'s budget: the report says why
            if not job.get("match_peer"):
                raise
            Path(job["result"]).write_text(json.dumps({k: job[k] for k in ("mode", "run", "world")} | {
                "failed": f"{type(exc).__name__}: {exc}", "budget_gib": job.get("budget_gib")}))
            return 1
        if result:
            Path(job["result"]).write_text(json.dumps(result))
        return 0

    import torch

    check_experiments(parse_variants(args.variants))  # a renamed target stops the call before any model is built
    start = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    gpus = torch.cuda.device_count() if device == "cuda" else 0
    report, jobs, ddp_jobs = make_jobs(args, work, device, gpus)
    if args.out is None:
        args.out = (Path(tempfile.gettempdir()) / "freetune_bench_tiny.json" if args.tiny
                    else REPO / "reports" / "gpu" / "bench.json")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_suffix(".log"), "w") as log:
        schedule = Schedule(args, report, out, log, start, gpus)
        if args.tiny and not args.spawn:  # in this process: the smoke test pays the imports once
            schedule.in_this_process(jobs, work)
        else:
            schedule.on_gpus(jobs, ddp_jobs)
    for other in args.merge:
        merge_runs(report, json.loads(Path(other).read_text())["runs"])
        report.setdefault("merged_from", []).append(other)
    summarise(report)
    out.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"wrote {out} ({time.time() - start:.0f} s)")
    return 1 if any(map(counts_as_failure, report["runs"])) else 0


if __name__ == "__main__":
    sys.exit(main())
