"""scripts/bench.py's scheduler: the jobs a call asks for, their order (rounds, DDP runs next to their 1-GPU runs),
the processes that run them, and the results merged into the report."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from freetune.fixtures import QWEN_PADDED_VOCAB
from freetune.plan.memory import ALLOCATOR_SLACK, CUDA_CONTEXT_GIB
from scripts.bench_experiments import ddp_only
from scripts.bench_prepare import (
    BENCH, LIKE_FOR_LIKE, LORA_RANK, MATCHED, MAX_LENGTH, MODES, PEER_MEMORY_MARGIN, PEER_RUNS, PEER_SITE_DEFAULT,
    PEER_WORKER, ROWS_PER_STEP, ROW_LENGTHS, RUNS, T4_CUBLAS_WORKSPACE, base_run, build_model, build_tokenizer,
    measure_matmul_tflops, parse_row_lengths, recipe_default, shape_of, svg_sample_rows, synthetic_rows)
from scripts.bench_report import fastest_peer, summarise
from scripts.bench_worker import run_one


def launch(job: dict, gpus: list[int], log):
    """Start one job in fresh processes on `gpus` (torchrun for several); (process, where its result lands)."""
    job_file = Path(job["work"]) / f"job-{job['mode']}-{job['run']}-{len(gpus)}.json"
    result_file = job_file.with_suffix(".result.json")
    job_file.write_text(json.dumps({**job, "result": str(result_file)}))
    result_file.unlink(missing_ok=True)  # a warm machine's last result is not this run's
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "PYTHONUNBUFFERED": "1"}
    if job["precision"] == "fp16" and job.get("t4_cublas_workspace"):  # the emulated T4 modes, when asked
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", T4_CUBLAS_WORKSPACE)
    cwd = None
    if job["run"] in PEER_RUNS:  # in the work folder: Unsloth writes generated code where it runs
        (cmd, env), cwd = peer_command(job_file, env), job["work"]
    elif len(gpus) > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={len(gpus)}",
               str(BENCH), "--worker", str(job_file)]
    else:
        cmd = [sys.executable, str(BENCH), "--worker", str(job_file)]
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT), result_file


def peer_site() -> Path:
    """The folder the Unsloth peer imports from ($FREETUNE_PEER_SITE, default /tmp/usite): Unsloth with its own pins
    (trl <= 1.15, datasets < 5), never freetune's site; an error that says how to make it where it is missing."""
    site = Path(os.environ.get("FREETUNE_PEER_SITE", PEER_SITE_DEFAULT))
    if not (site / "unsloth" / "__init__.py").is_file():
        raise SystemExit(
            f"The Unsloth peer runs ({', '.join(PEER_RUNS)}) import Unsloth from a site of their own, and {site} holds "
            f"none. Build its wheels on a machine with PyPI (bash scripts/build_peer_wheels.sh writes .uwhl/), carry "
            f".uwhl/ to the GPU machine and install them there: python3 -m pip install -q --no-index --no-deps "
            f"--target {site} .uwhl/*.whl (or set FREETUNE_PEER_SITE to the folder that holds them).")
    return site


def peer_command(job_file: Path, env: dict) -> tuple[list[str], dict]:
    """The peer worker's command and environment: a script that imports nothing from freetune, with the peer's site
    alone on PYTHONPATH (in place of freetune's), so that Unsloth's trl and datasets are the ones imported."""
    return [sys.executable, str(PEER_WORKER), str(job_file)], {**env, "PYTHONPATH": str(peer_site())}


def make_jobs(args: argparse.Namespace, work: Path, device: str, gpus: int) -> tuple[dict, list[dict], list[dict]]:
    """The report's header (the matmul rate measured here), the single-process jobs and the DDP jobs; builds the
    tokenizer, the models and the rows they need in `work`."""
    import torch

    tokenizer_dir = build_tokenizer(work / "tokenizer")
    if args.tiny:
        modes = {"cpu": dict(shape="tiny", cap_gib=0.0, precision="auto", recipe="svg_coder")}
        lengths, max_length, steps = (16, 48), 40, dict(free_tier=(1, 1), plain_best=(1, 1), freetune=(1, 1))
    else:
        modes = {m: MODES[m] for m in args.modes.split(",")}
        # Warm-up: the first steps grow the allocator to the batch shapes (packed lengths vary every step).
        lengths, max_length, steps = None, MAX_LENGTH, dict(free_tier=(1, 3), plain_best=(3, args.steps),
                                                            freetune=(3, args.steps))
    not_qwen = [mode for mode, spec in modes.items() if shape_of(spec["shape"]).vocab < QWEN_PADDED_VOCAB]
    if args.rows == "svg_sample" and not_qwen:  # before any model is built or the matmul rate measured
        raise SystemExit(f"--rows svg_sample: Qwen2.5's token ids need a Qwen2.5 shape (--modes uncapped,t4), "
                         f"not mode {', '.join(not_qwen)}")
    steps.update({peer: steps["freetune"] for peer in PEER_RUNS})  # the same rows measured as freetune's
    peak = measure_matmul_tflops(device)
    report = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "gpus": gpus,
              "torch": torch.__version__, "matmul_tflops": {k: round(v, 3) for k, v in peak.items()},
              "rows": {"source": args.rows, "lengths": {m: mode_lengths(args, spec, lengths)
                                                        for m, spec in modes.items()},
                       "max_length": max_length, "lora_rank": LORA_RANK, "rows_per_gpu_step": ROWS_PER_STEP},
              "scheduling": "parallel (one single-GPU run per GPU at a time)" if args.parallel else "sequential",
              "runs": []}
    print(f"{report['device']} x {max(gpus, 1)}: matmul {report['matmul_tflops']} TFLOP/s", flush=True)

    sample_file, longest_row = None, None
    if args.rows == "svg_sample":  # one rows file for every mode (all Qwen2.5 shapes)
        sample_file = work / "rows-svg_sample.json"
        if not sample_file.exists():
            sample_file.write_text(json.dumps(svg_sample_rows()))
        sample_lengths = list(map(len, json.loads(sample_file.read_text())))
        longest_row = max(sample_lengths)  # the audit's longest_row
        report["rows"]["lengths"] = [min(sample_lengths), longest_row]
    jobs = []
    every = max(args.logging_steps, 1)  # the token counts are read from the log: warm-up and measured steps align
    for mode, spec in modes.items():
        shape = shape_of(spec["shape"])
        model_dir = build_model(shape, work / f"model-{shape.name}", tokenizer_dir, device)
        low, high = mode_lengths(args, spec, lengths)
        # the lengths in the name: a warm machine's rows of other lengths are not these
        rows_file = sample_file or work / f"rows-{shape.name}-{low}-{high}.json"
        if not rows_file.exists():
            rows_file.write_text(json.dumps(synthetic_rows(256, shape.vocab, (low, high))))
        # the plan sized for the rows' longest, as the recipes' replan sizes it from the audit (t4_8b's 150-500 tokens:
        # 500, not max_length; the memory estimate and the CUDA graphs' buffers follow it)
        rows_longest = longest_row or max(map(len, json.loads(rows_file.read_text())))
        runs = [(run, {}) for run in RUNS + PEER_RUNS if run in args.runs.split(",")]
        runs += [(f"freetune[{label}]", overrides) for label, overrides in parse_variants(args.variants)]
        if args.like_for_like:
            runs.append((f"freetune[{LIKE_FOR_LIKE[0]}]", dict(LIKE_FOR_LIKE[1])))
        if args.match_peer_memory:  # last: its budget is the peak of a peer run measured before it
            # with --like-for-like, planned for the peer's LoRA too (dropout 0, the only one its fast path takes;
            # the plan then picks the CUDA graphs where they fit); the optimizer stays the plan's choice
            runs.append((MATCHED, {"lora_dropout": 0} if args.like_for_like else {}))
        for run, overrides in runs:
            warmup, measured = (-(-n // every) * every for n in steps[base_run(run)])
            jobs.append(dict(mode=mode, run=run, shape=spec["shape"], cap_gib=spec["cap_gib"],
                             precision=spec["precision"], max_length=max_length, warmup=warmup, steps=measured,
                             model=str(model_dir), tokenizer=str(tokenizer_dir), rows=str(rows_file),
                             longest_row=rows_longest,
                             model_shape=shape.name,
                             work=str(work), world=1, batching="padding_free" if args.tiny else None,
                             overrides=overrides, profile=args.profile, sample_stacks=args.sample_stacks,
                             logging_steps=every, match_peer=run == MATCHED,
                             lora_dropout=recipe_default(spec["recipe"], "lora_dropout"),
                             t4_cublas_workspace=args.t4_cublas_workspace))
    if device == "cuda":
        torch.cuda.empty_cache()
    ddp_jobs = [] if (args.no_ddp or gpus < 2 or "uncapped" not in modes) else [
        {**j, "world": 2} for j in jobs if j["mode"] == "uncapped" and base_run(j["run"]) in ("free_tier", "freetune")]
    # A variant of DDP settings only runs under DDP; its efficiency is against freetune's 1-GPU run.
    jobs = in_rounds([j for j in jobs if not ddp_only(j["overrides"])], args.rounds)
    return report, jobs, ddp_jobs


def mode_lengths(args: argparse.Namespace, spec: dict, tiny: tuple[int, int] | None) -> tuple[int, int]:
    """The synthetic rows' lengths of a mode: --tiny's, else --row-lengths, else the mode's own, else ROW_LENGTHS."""
    if tiny:
        return tiny
    if args.row_lengths:
        return parse_row_lengths(args.row_lengths)
    return spec.get("lengths", ROW_LENGTHS)


def parse_variants(text: str) -> list[tuple[str, dict]]:
    """'label:field=value,field=value;label2:...' -> [(label, {field: value})]; true/false and integers typed."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        label, _, assignments = part.partition(":")
        overrides = {}
        for item in filter(None, assignments.split(",")):
            key, _, value = item.partition("=")
            low = value.strip().lower()
            overrides[key.strip()] = (low == "true") if low in ("true", "false") else (
                int(low) if low.lstrip("-").isdigit() else value.strip())
        out.append((label.strip(), overrides))
    return out


class Schedule:
    """Runs the jobs and records each result in the report (written to `out` after every run)."""

    def __init__(self, args: argparse.Namespace, report: dict, out: Path, log, start: float, gpus: int):
        self.args, self.report, self.out, self.log, self.start, self.gpus = args, report, out, log, start, gpus

    def record(self, result_file: Path, job: dict, rc: int):
        if result_file.exists():
            result = json.loads(result_file.read_text())
        else:
            result = {k: job[k] for k in ("mode", "run", "world")} | {"failed": f"exit {rc}"}
        if self.args.rounds > 1:  # every round's run kept apart; "runs" holds their medians (one_per_run)
            self.report.setdefault("each_round", []).append({**result, "round": job.get("round", 1)})
            self.report["runs"] = one_per_run(self.report["each_round"])
        else:
            self.report["runs"].append(result)
        summarise(self.report)
        self.out.write_text(json.dumps(self.report, indent=1))

    def no_time_left(self, job: dict):
        self.report["runs"].append({k: job[k] for k in ("mode", "run", "world")} | {"failed": "no time left"})

    def in_this_process(self, jobs: list[dict], work: Path):
        for job in jobs:
            if job["run"] in PEER_RUNS:  # always a process of its own, on the peer's site
                proc, result_file = launch(job, [0], self.log)
                self.record(result_file, job, proc.wait())
                continue
            if job.get("match_peer"):
                job = matched_job(job, self.report)
                if "failed" in job:
                    self.report["runs"].append(job)
                    continue
            result_file = work / f"result-{job['mode']}-{job['run']}.json"
            job = {**job, "result": str(result_file)}
            result_file.unlink(missing_ok=True)
            result_file.write_text(json.dumps(run_one(job)))
            self.record(result_file, job, 0)

    def on_gpus(self, jobs: list[dict], ddp_jobs: list[dict]):
        # The uncapped runs first, then the caps. Each uncapped run's DDP run comes right after its 1-GPU run:
        # the efficiency compares the two, and the lent host's speed drifts over minutes (the same run has
        # measured 19k-27k tokens/s in different calls). With --parallel the 1-GPU runs go first, side by side.
        uncapped = [j for j in jobs if j["mode"] == "uncapped"] if not self.args.ddp_only else []
        if self.args.parallel:
            self.single_gpu(uncapped)
            uncapped = []
        for where, job in run_order(uncapped, ddp_jobs):
            if where == "1 GPU":
                self.single_gpu([job])
            else:
                self.both_gpus(job)
        if not self.args.ddp_only:
            self.single_gpu([j for j in jobs if j["mode"] != "uncapped"])

    def single_gpu(self, queue: list[dict]):
        """Single-GPU runs one at a time on GPU 0 (or, with --parallel, one per GPU side by side)."""
        running = {}  # gpu -> (proc, result_file, job)
        free = list(range(max(self.gpus, 1))) if self.args.parallel else [0]
        while queue or running:
            if queue and time.time() - self.start >= self.args.budget_s:
                for job in queue:
                    self.no_time_left(job)
                queue = []
            while queue and free:
                job = queue.pop(0)
                if job.get("match_peer"):
                    job = matched_job(job, self.report)
                    if "failed" in job:
                        self.report["runs"].append(job)
                        continue
                gpu = free.pop(0)
                proc, result_file = launch(job, [gpu], self.log)
                running[gpu] = (proc, result_file, job)
            for gpu, (proc, result_file, job) in list(running.items()):
                if proc.poll() is not None:
                    self.record(result_file, job, proc.returncode)
                    print(f"done: {job['mode']}/{job['run']} (exit {proc.returncode}, "
                          f"{time.time() - self.start:.0f} s)", flush=True)
                    del running[gpu]
                    free.append(gpu)
            time.sleep(1)

    def both_gpus(self, job: dict):
        if time.time() - self.start >= self.args.budget_s:
            self.no_time_left(job)
            return
        proc, result_file = launch(job, [0, 1], self.log)
        proc.wait()
        self.record(result_file, job, proc.returncode)
        print(f"done: DDP {job['mode']}/{job['run']} (exit {proc.returncode}, {time.time() - self.start:.0f} s)",
              flush=True)


def matched_job(job: dict, report: dict) -> dict:
    """freetune[matched]'s job with its budget: the peak allocated of the fastest Unsloth run of its mode that fit,
    measured earlier in this call, + PEER_MEMORY_MARGIN; or a failed record saying there is none to match. make_plan's
    budget is the card's memory (its estimate's total: allocated x ALLOCATOR_SLACK + the CUDA context), the peer's
    figure is allocated memory: the budget is the total whose allocated part is the target (given the allocated
    target itself, the plan sized 2 x 1,024 tokens where 8 x 1,024 fit, issue 49's first call)."""
    by_key = {(r["mode"], r["run"], r.get("world_size")): r for r in report["runs"] if "tokens_per_s" in r}
    peer = fastest_peer(by_key, job["mode"])
    if peer is None or not peer.get("peak_allocated_gib"):
        return {k: job[k] for k in ("mode", "run", "world")} | {
            "failed": "no Unsloth run of this mode fitted before it (nothing to match the memory of)"}
    target = round(peer["peak_allocated_gib"] * (1 + PEER_MEMORY_MARGIN), 3)
    budget = round(target * ALLOCATOR_SLACK + CUDA_CONTEXT_GIB, 3)
    return {**job, "budget_gib": budget, "peak_target_gib": target, "matched_to": peer["run"]}


def in_rounds(jobs: list[dict], rounds: int) -> list[dict]:
    """The single-GPU jobs `rounds` times over, every other round in reverse (A B, B A, A B, ...): the lent host's speed
    drifts over minutes, and so no run always goes first or right after a compile-heavy one."""
    out = []
    for r in range(1, rounds + 1):
        out += [{**j, "round": r} for j in (jobs if r % 2 else jobs[::-1])]
    return out


def one_per_run(each_round: list[dict]) -> list[dict]:
    """One record per (mode, run, processes) over --rounds: the first successful round's, with the median tokens/s of
    its rounds (each in tokens_per_s_rounds) and the highest peak allocated memory; a run that failed in every
    round stays failed."""
    import statistics

    groups: dict = {}
    for r in each_round:
        groups.setdefault((r["mode"], r["run"], r.get("world_size", r.get("world"))), []).append(r)
    out = []
    for runs in groups.values():
        done = [r for r in runs if "tokens_per_s" in r]
        if not done:
            out.append(runs[0])
            continue
        rates = [r["tokens_per_s"] for r in done]
        peaks = [r["peak_allocated_gib"] for r in done if r.get("peak_allocated_gib") is not None]
        merged = {**done[0], "tokens_per_s": round(statistics.median(rates), 1), "tokens_per_s_rounds": rates,
                  "rounds": len(done), "failed_rounds": len(runs) - len(done)}
        merged.pop("round", None)
        if peaks:
            merged["peak_allocated_gib"] = max(peaks)
        out.append(merged)
    return out


def merge_runs(report: dict, theirs: list[dict]) -> None:
    """Add an earlier report's measured runs to this one's. Not a run that failed or was skipped there (it says
    nothing here), nor one this call measured again (the new measurement is the one the ratios use), nor a DDP run
    whose 1-GPU run this call measured again: its efficiency would divide rates of two calls, and the lent host's
    speed changes between calls by more than the DDP loss being measured."""
    key = lambda r: (r["mode"], r["run"], r["world_size"])  # noqa: E731
    mine = {key(r) for r in report["runs"] if "failed" not in r}
    report["runs"] += [r for r in theirs if "failed" not in r and key(r) not in mine
                       and not (r["world_size"] > 1 and (r["mode"], r["run"], 1) in mine)]


def run_order(single: list[dict], ddp: list[dict]) -> list[tuple[str, dict]]:
    """("1 GPU" | "2 GPUs", job) in the order they run: the 1-GPU runs as listed, each DDP run right after the
    1-GPU run of the same name (a DDP-only variant where it is listed), so that an efficiency compares two runs
    measured minutes apart rather than a whole call apart."""
    order, pending = [], list(single)
    for job in ddp:
        own = [i for i, j in enumerate(pending) if j["run"] == job["run"]]
        if own:  # its 1-GPU run, and the ones listed before that
            order += [("1 GPU", j) for j in pending[:own[0] + 1]]
            del pending[:own[0] + 1]
        order.append(("2 GPUs", job))
    return order + [("1 GPU", j) for j in pending]
