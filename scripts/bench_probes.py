"""scripts/bench.py's measuring instruments inside a worker: per-thread CPU time, the Python stack sampler
(--sample-stacks), the step profiler (--profile) and the Timer callback that marks the measured steps."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

from scripts.bench_prepare import LORA_RANK
from scripts.gc_pauses import GcPauses


def thread_cpu() -> dict[int, tuple[str, float, int]]:
    """This process's threads from /proc: {thread id: (name, CPU seconds so far, involuntary context switches)}.
    Two snapshots give each thread's share of a stretch of steps: which threads a rank runs besides its main one,
    and whether the main thread was preempted (its CPU taken by another thread or process)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for tid in os.listdir("/proc/self/task"):
        base = f"/proc/self/task/{tid}"
        try:
            name = Path(f"{base}/comm").read_text().strip()
            stat = Path(f"{base}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # from field 3 (state) on; utime, stime are fields 14, 15
            status = Path(f"{base}/status").read_text()
            preempted = next(int(line.split()[1]) for line in status.splitlines()
                             if line.startswith("nonvoluntary_ctxt_switches"))
            out[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / tick, preempted)
        except (OSError, ValueError, IndexError, StopIteration):
            continue  # a thread that ended between the listing and the read
    return out


def thread_cpu_between(before: dict, after: dict, top: int = 8) -> list[list]:
    """[name (main thread marked), CPU seconds, involuntary switches] of the busiest threads between two snapshots."""
    rows = []
    for tid, (name, cpu, preempted) in after.items():
        _, cpu0, preempted0 = before.get(tid, (name, 0.0, 0))
        label = f"{name} (main)" if tid == os.getpid() else name
        rows.append([label, round(cpu - cpu0, 2), preempted - preempted0])
    return sorted(rows, key=lambda r: -r[1])[:top]


class StackSampler:
    """Where the host's time goes over the measured steps, without torch.profiler's per-op cost (which inflates
    Python-heavy code several times over): a thread that reads every other thread's Python stack every `interval`
    seconds (sys._current_frames) and counts, per thread, the innermost frame ("self") and every function on the
    stack ("inclusive"). A C call (a kernel launch, an ATen op) counts on the Python line that made it; a thread
    running C++ alone (the autograd engine between Python nodes) is not seen. Threads parked in a wait (tqdm's monitor,
    telemetry) are left out. The GIL's switch interval is shortened while it runs so that a sample is taken when due;
    the sampled run is a little slower."""

    # An innermost frame here: a parked thread (a lock, a queue, inductor's compile workers waiting, an idle thread
    # pool's worker: its wait for work is C code under concurrent.futures' _worker), not work.
    IDLE = ("threading.py", "queue.py", "selectors.py", "compile_worker/subproc_pool.py", "compile_worker/timer.py",
            "concurrent/futures/thread.py")

    def __init__(self, interval: float = 0.001):
        self.interval, self.ticks, self.threads, self.self_counts, self.inclusive = interval, 0, {}, {}, {}
        self.stop_event, self.thread, self.switch = threading.Event(), None, None

    def start(self):
        self.switch = sys.getswitchinterval()
        sys.setswitchinterval(self.interval / 4)
        self.thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self.thread.start()

    def stop(self):
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join()
            sys.setswitchinterval(self.switch)

    def _label(self, ident: int) -> str:
        if ident not in self.threads:
            known = threading._active.get(ident)
            main = ident == threading.main_thread().ident
            self.threads[ident] = "main" if main else (known.name if known else f"native-{len(self.threads)}")
        return self.threads[ident]

    def _run(self):
        me = threading.get_ident()
        while not self.stop_event.wait(self.interval):
            self.ticks += 1
            for ident, frame in sys._current_frames().items():
                code = frame.f_code
                if ident == me or code.co_filename.endswith(self.IDLE):
                    continue
                label = self._label(ident)
                key = (label, code.co_filename, frame.f_lineno, code.co_name)
                self.self_counts[key] = self.self_counts.get(key, 0) + 1
                seen = set()
                while frame is not None:
                    code = frame.f_code
                    fn = (label, code.co_filename, code.co_firstlineno, code.co_name)
                    if fn not in seen:
                        seen.add(fn)
                        self.inclusive[fn] = self.inclusive.get(fn, 0) + 1
                    frame = frame.f_back

    def summary(self, top: int = 45, top_inclusive: int = 120) -> dict:
        """Per thread the share of ticks it was seen busy; the top lines by self samples (with the source line) and
        functions by inclusive samples, as shares of the ticks (of wall time)."""
        import linecache

        def name(path: str) -> str:
            parts = Path(path).parts
            return "/".join(parts[-2:]) if len(parts) > 1 else path

        ticks = max(self.ticks, 1)
        busy = {}
        for (label, *_), n in self.self_counts.items():
            busy[label] = busy.get(label, 0) + n
        lines = sorted(self.self_counts.items(), key=lambda kv: -kv[1])[:top]
        funcs = sorted(self.inclusive.items(), key=lambda kv: -kv[1])[:top_inclusive]
        return {"ticks": self.ticks, "interval_s": self.interval,
                "busy": {label: round(n / ticks, 3) for label, n in sorted(busy.items(), key=lambda kv: -kv[1])},
                "self": [[round(n / ticks, 4), f"{label} {name(f)}:{line} {fn}",
                          linecache.getline(f, line).strip()[:100]] for (label, f, line, fn), n in lines],
                "inclusive": [[round(n / ticks, 4), f"{label} {name(f)}:{line} {fn}"]
                              for (label, f, line, fn), n in funcs]}


def profiled_step_summary(prof, wall: float) -> dict:
    """The profiled step's wall time, the GPU's busy time (sum of kernel durations), kernel launches and ATen calls."""
    # not inductor's "## Call CompiledFxGraph" ranges on the GPU's timeline: their kernels are counted already
    from scripts.step_breakdown import is_annotation

    events = prof.events()
    kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    kernels = [e for e in kernels if not is_annotation(e)]
    busy = sum(getattr(e, "device_time", 0) or 0 for e in kernels) / 1e6
    aten = sum(1 for e in events if e.name.startswith("aten::"))
    return {"wall_s": round(wall, 4), "gpu_busy_s": round(busy, 4),
            "gpu_busy_share": round(busy / wall, 3) if wall else None, "kernels": len(kernels), "aten_calls": aten}


def print_profile_tables(prof, cuda: bool, rank: int) -> None:
    """The top kernels (or CPU ops) and, on a GPU, the top host-side ops of the profiled step."""
    averages = prof.key_averages()
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    # One print per table: under torchrun the ranks' lines interleave, a table at a time stays readable.
    print(f"rank {rank}:\n" + averages.table(sort_by=sort, row_limit=18, max_name_column_width=60), flush=True)
    if cuda:
        print(f"rank {rank}:\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30,
                                                  max_name_column_width=60), flush=True)


def host_sync_site(inside_torch: str) -> str:
    """Where a host sync torch warned about was asked for: the innermost three frames outside torch itself (and
    outside this function and the profiler's warning hook that calls it)."""
    import traceback

    frames = [f for f in traceback.extract_stack()[:-2]
              if not f.filename.startswith(inside_torch) and not f.filename.endswith("warnings.py")][-3:]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))


def step_profiler_class():
    from transformers import TrainerCallback

    class StepProfiler(TrainerCallback):
        """torch.profiler over the one optimizer step after the warm-up: wall time, the GPU's busy time (sum of
        kernel durations), kernel launches and ATen calls, and the top kernels / host-side ops printed to the log.
        A step whose GPU is busy for a fraction of its wall time is bound by the host (launches, Python, syncs).
        On a GPU it also lists where that step made the host wait for the GPU (torch's sync debug mode: .item(),
        blocking copies, ...; explicit synchronize calls are not reported), by call site."""

        def __init__(self, warmup: int, cuda: bool, rank: int = 0, vocab: int = 0):
            self.warmup, self.cuda, self.rank, self.prof, self.summary = warmup, cuda, rank, None, {}
            self.vocab = vocab  # tells the loss head's matmuls apart (scripts/step_breakdown.py)
            self.syncs, self.catcher = {}, None
            import torch

            # Where torch itself lives (not "/torch/" in the path: the GPU image keeps transformers and accelerate
            # under /opt/torch/.venv).
            self.inside_torch = str(Path(torch.__file__).parent) + "/"

        def _count_sync(self, message, category, filename, lineno, file=None, line=None):
            site = host_sync_site(self.inside_torch)
            self.syncs[site] = self.syncs.get(site, 0) + 1

        def _catch_host_syncs(self):
            import warnings

            import torch

            self.catcher = warnings.catch_warnings()
            self.catcher.__enter__()
            warnings.simplefilter("always")
            warnings.showwarning = self._count_sync
            torch.cuda.set_sync_debug_mode("warn")

        def on_step_begin(self, args, state, control, **kwargs):
            import torch
            from torch.profiler import ProfilerActivity, profile

            if state.global_step == self.warmup and self.prof is None:
                if self.cuda:
                    torch.cuda.synchronize()
                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
                # FREETUNE_PROFILE_TRACE=folder: the step's Chrome trace, with Python stacks, written there.
                # record_shapes: the breakdown tells LoRA and loss-head matmuls by their operands' shapes
                self.prof = profile(activities=acts, with_stack=bool(os.environ.get("FREETUNE_PROFILE_TRACE")),
                                    record_shapes=self.cuda)
                self.prof.__enter__()
                if self.cuda:
                    self._catch_host_syncs()
                self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            import torch

            if self.prof is None or self.summary or state.global_step != self.warmup + 1:
                return
            if self.cuda:
                torch.cuda.set_sync_debug_mode(0)
                self.catcher.__exit__(None, None, None)
                torch.cuda.synchronize()
            wall = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)
            self.summary = profiled_step_summary(self.prof, wall)
            if self.cuda:
                self.summary["host_syncs"] = dict(sorted(self.syncs.items(), key=lambda kv: -kv[1]))
                from scripts.step_breakdown import breakdown, text

                self.summary["breakdown"] = breakdown(self.prof, LORA_RANK, self.vocab)
                print(f"rank {self.rank}: {text(self.summary['breakdown'])}", flush=True)
            trace_dir = os.environ.get("FREETUNE_PROFILE_TRACE")
            if trace_dir:
                self.prof.export_chrome_trace(str(Path(trace_dir) / f"trace-{os.getpid()}-rank{self.rank}.json"))
            print(f"rank {self.rank}: profile of step {state.global_step}: {self.summary}", flush=True)
            print_profile_tables(self.prof, self.cuda, self.rank)

    return StepProfiler


def timer_class():
    """Timer, a TrainerCallback (defined here so that transformers is imported only by the workers)."""
    import torch
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        """Wall time at the end of the warm-up and of the measured steps (the GPU drained at both marks), the CPU
        time of each of this process's threads in between, and where each measured step's host time went (both
        printed by every rank: under DDP, which rank's host is the slower one, and where the other one waits).
        Last in the callback list: its step end comes after the stop callback's."""

        def __init__(self, warmup: int, measured: int, cuda: bool, rank: int, sampler: StackSampler | None = None):
            self.warmup, self.measured, self.total_steps = warmup, measured, warmup + measured
            self.cuda, self.rank, self.sampler = cuda, rank, sampler
            self.marks, self.threads_at_warmup, self.busiest = {}, None, []
            self.phases, self.begin, self.pre_optimizer, self.end = [], None, None, None
            self.gc = GcPauses()

        def on_step_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.pre_optimizer = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            now = time.perf_counter()
            warmup, total_steps = self.warmup, self.total_steps
            if warmup < state.global_step <= total_steps:  # a measured step (the warm-up's end set self.end)
                self.phases.append([self.pre_optimizer - self.begin, now - self.pre_optimizer, self.begin - self.end])
            self.end = now
            if state.global_step in (warmup, total_steps):
                if self.cuda:
                    torch.cuda.synchronize()
                self.marks[state.global_step] = time.perf_counter()
                if state.global_step == warmup:
                    self.threads_at_warmup = thread_cpu()
                    self.gc.start()
                    if self.sampler is not None:
                        self.sampler.start()
                elif self.threads_at_warmup is not None:
                    self.gc.stop()
                    if self.sampler is not None:
                        self.sampler.stop()
                    self.busiest = thread_cpu_between(self.threads_at_warmup, thread_cpu())
                    self.print_host_time()

        def print_host_time(self):
            wall = self.marks[self.total_steps] - self.marks[self.warmup]
            print(f"rank {self.rank}: CPU seconds per thread over the {self.measured} measured steps ({wall:.2f} s "
                  f"wall; involuntary switches): " + ", ".join(f"{n} {c:.2f} s ({p})"
                                                               for n, c, p in self.busiest), flush=True)
            print(f"rank {self.rank}: host ms per measured step, median (max): " + ", ".join(
                f"{name} {ms[0]:.1f} ({ms[1]:.1f})" for name, ms in self.phase_summary().items()), flush=True)
            print(f"rank {self.rank}: garbage collections over the measured steps (count, total ms, longest ms): "
                  f"{self.gc.summary()}", flush=True)

        def phase_summary(self) -> dict:
            """Median and max host milliseconds per step of: forward + backward (and the syncs inside them), the
            optimizer and the step-end callbacks, and the gap to the next step (logging, the next batch)."""
            names = ("forward_backward", "optimizer_step_end", "log_and_next_batch")
            out = {}
            for i, name in enumerate(names):
                values = sorted(1000 * p[i] for p in self.phases)
                if values:
                    out[name] = [round(values[len(values) // 2], 1), round(values[-1], 1)]
            return out

    return Timer
