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
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

if not __package__:  # run as a file (python scripts/bench.py): its sibling modules by the package's name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from freetune.fixtures import QWEN_PADDED_VOCAB
from freetune.plan import KNOWN_SHAPES, ModelShape
from freetune.plan.memory import ALLOCATOR_SLACK, CUDA_CONTEXT_GIB
from scripts.gc_pauses import GcPauses

REPO = Path(__file__).resolve().parents[1]

ROWS_PER_STEP = 8  # per GPU: batch 1 x accumulation 8 in the free-tier recipe
LORA_RANK = 16
# The cuBLAS workspace PyTorch takes on a T4 (sm75; ':4096:2:16:8', 8 MiB per thread and stream) where an H200 takes
# 32 MiB (a training step holds two: the forward's thread and the backward's, so both tools' peaks carry 48 MiB a T4
# would not). Only with --t4-cublas-workspace: on Hopper so small a workspace costs each matmul about three times the
# host time (scripts/matmul_host_cost.py), for both tools, which a T4's own kernels do not pay.
T4_CUBLAS_WORKSPACE = ":4096:2:16:8"
TINY_SHAPE = ModelShape("tiny", hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=1024,
                        tied_embeddings=True, attention_bias=True)
ARCHITECTURE = {"Qwen2.5-1.5B": "qwen2", "TinyLlama-1.1B": "llama", "Qwen3-8B": "qwen3", "tiny": "qwen2"}
ROW_LENGTHS = (300, 1200)  # the synthetic rows' lengths (cut at MAX_LENGTH), unless a mode or --row-lengths says
MAX_LENGTH = 1024
# Each mode stands for a recipe: freetune's LoRA dropout there is that recipe's default (recipe_default); Unsloth's runs
# use 0, what its fused LoRA path needs.
MODES = {
    "uncapped": dict(shape="qwen2.5-1.5b", cap_gib=0.0, precision="auto", recipe="svg_coder"),
    "t4": dict(shape="qwen2.5-1.5b", cap_gib=14.5, precision="fp16", recipe="svg_coder"),
    "4gb": dict(shape="tinyllama-1.1b", cap_gib=4.0, precision="fp16", recipe="tiny_4gb"),
    # home_assistant's model under the T4 cap (issue 49), on rows as long as that recipe's (150-500 tokens)
    "t4_8b": dict(shape="qwen3-8b", cap_gib=14.5, precision="fp16", recipe="home_assistant", lengths=(150, 500)),
}
RUNS = ("free_tier", "plain_best", "freetune")
ROW_SOURCES = ("synthetic", "svg_sample")
# Unsloth with its offloaded checkpointing, without checkpointing (both padding-free), and (not asked for in issue 25,
# the other candidate for its fastest) padded batches through its per-layer compile, no checkpointing.
PEER_RUNS = ("unsloth", "unsloth_nockpt", "unsloth_padded")
PEER_WORKER = REPO / "scripts" / "bench_unsloth.py"
PEER_SITE_DEFAULT = "/tmp/usite"
# Issue 25's targets: freetune's tokens/s over Unsloth's, per mode (see peer_targets).
TARGET_X = {"4gb": 1.3, "t4": 1.3, "t4_8b": 1.3, "uncapped": 1.8}
LEAN_X = 1.3
# Issue 49's memory target: freetune's peak allocated at most the fastest fitting Unsloth run's + 5%. --match-peer-memory
# plans one more freetune run (freetune[matched]) for exactly that budget, measured after the peer's runs in the call.
MATCHED = "freetune[matched]"
PEER_MEMORY_MARGIN = 0.05
# --like-for-like: freetune's plan with the peer's training settings (scripts/bench_unsloth.py): LoRA dropout 0 (its
# fused LoRA path needs it; svg_coder's recipe uses 0.05, tiny_4gb's 0) and 8-bit AdamW (its notebooks'; freetune's
# plan takes fused AdamW where the fp32 state is small against the budget). Judged against each mode's target like the
# default run.
LIKE_FOR_LIKE = ("like", {"lora_dropout": 0, "optimizer": "adamw_8bit"})
# --variants keys that are not plan fields: experiments on top of freetune's path. The DDP ones change nothing in
# one process, so a variant made only of them runs under DDP only (compared with freetune's own 1-GPU run).
EXPERIMENTS = ("liger", "cpp_wrapper", "combo_kernels", "dense_head", "no_packed_check", "pin_cores", "byte_masks",
               "fp32_absmax", "per_layer_casts", "copied_heads", "trl_empty_cache", "no_triton", "inline_dgrad",
               "skip_guards", "no_asserts", "gc_unfrozen", "lora_dropout",
               "ddp_split", "static_graph", "bucket_view", "bucket_mb", "flat_sync")
DDP_EXPERIMENTS = ("ddp_split", "static_graph", "bucket_view", "bucket_mb", "flat_sync")


def recipe_default(recipe: str, name: str):
    """A parameter's default in recipes/<recipe>.py's parameters cell (`name: type = literal  # help`)."""
    import ast

    tree = ast.parse((REPO / "recipes" / f"{recipe}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return ast.literal_eval(node.value)
    raise KeyError(f"recipes/{recipe}.py declares no parameter {name!r}")


def shape_of(name: str) -> ModelShape:
    return TINY_SHAPE if name == "tiny" else KNOWN_SHAPES[name]


def shape_named(name: str) -> ModelShape:
    """The shape a run's report names (its ModelShape.name: 'Qwen3-8B'), for its MFU; any unknown name is an error,
    not the tiny shape (which made the Qwen3-8B runs' MFU read 0.0%)."""
    found = [s for s in (TINY_SHAPE, *KNOWN_SHAPES.values()) if s.name == name]
    if not found:
        raise KeyError(f"no shape named {name!r} in bench's shapes "
                       f"({', '.join(s.name for s in KNOWN_SHAPES.values())})")
    return found[0]


def parse_row_lengths(text: str, max_length: int = MAX_LENGTH) -> tuple[int, int]:
    """--row-lengths: 'MIN,MAX' tokens (uniform, cut at max_length) or 'max' (every row at max_length)."""
    if text.strip().lower() == "max":
        return max_length, max_length
    parts = text.split(",")
    try:
        low, high = (int(p) for p in parts)
    except ValueError:
        raise ValueError(f"--row-lengths {text!r}: give MIN,MAX in tokens (e.g. 300,1200) or 'max' (every row at "
                         f"max_length, {max_length})") from None
    if not 1 <= low <= high:
        raise ValueError(f"--row-lengths {text!r}: need 1 <= MIN <= MAX (rows longer than {max_length} are cut)")
    return low, high


def matmul_flops_per_token(shape: ModelShape) -> int:
    """Weights a token is multiplied with once in the forward: decoder linear layers and the lm_head."""
    return shape.quantized_params + shape.vocab * shape.hidden


# ------------------------------------------------------------------------------------------ preparation --

def build_tokenizer(out: Path) -> Path:
    """A word-level tokenizer with pad 0 and eos 1: the rows are token ids already, the trainer needs only the
    special tokens, and their ids must exist in every vocabulary benchmarked (TinyLlama's is 32,000)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(WordLevel({"<pad>": 0, "</s>": 1, "<unk>": 2}, unk_token="<unk>"))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    tok.save_pretrained(str(out))
    return out


def build_model(shape: ModelShape, out: Path, tokenizer_dir: Path, device: str) -> Path:
    """A random-weight model of `shape` saved to `out` (built on the GPU when there is one: 1.5B weights
    initialise in seconds there, minutes on a CPU)."""
    import torch

    from freetune.fixtures import build_tiny_model

    if (out / "config.json").exists():
        return out
    overrides = dict(intermediate_size=shape.intermediate, num_attention_heads=shape.heads,
                     num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab, pad_token_id=0, eos_token_id=1,
                     bos_token_id=1, tie_word_embeddings=shape.tied_embeddings)
    if shape.head_dim:  # Qwen3's 128 (the tiny fixture's qwen3 config says 16)
        overrides["head_dim"] = shape.head_dim
    with torch.device(device):
        build_tiny_model(out, ARCHITECTURE[shape.name], hidden_size=shape.hidden, num_layers=shape.layers,
                         tokenizer_dir=tokenizer_dir, **overrides)
    return out


def svg_sample_rows() -> list[list[int]]:
    """The bundled SVG sample as svg_coder's notebook trains on it (--embedded): each row a chat with the recipe's
    system prompt, rendered by Qwen2.5's chat template and tokenizer (the offline fixture's) into token ids."""
    import freetune

    tokenizer = freetune.model.load_tokenizer(str(freetune.fixtures.cached_tiny_model("qwen2")))
    rows = freetune.data.normalize(freetune.data.load_rows(str(freetune.fixtures.sample_data_path("svg"))))
    rows = freetune.data.as_chat(rows, recipe_default("svg_coder", "system_prompt"))
    return [tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)
            ["input_ids"] for row in rows]


def synthetic_rows(n: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    """n rows of random token ids with lengths uniform in `lengths` (SFT rows are this spread, and the spread
    is what padding wastes)."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def measure_matmul_tflops(device: str) -> dict:
    """The GPU's dense 16-bit matmul rate, measured: 8192^3 bf16 (and fp16) products, best of a few timings."""
    import torch

    out = {}
    n = 8192 if device == "cuda" else 512
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if device == "cpu":
            dtype = torch.float32
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(3):
            a @ b
        best = float("inf")
        for _ in range(5):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(10):
                    a @ b
                end.record()
                torch.cuda.synchronize()
                best = min(best, start.elapsed_time(end) / 1000 / 10)
            else:
                t = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - t)
        out[name if device == "cuda" else "fp32"] = 2 * n ** 3 / best / 1e12
        if device == "cpu":
            break
    return out


# ----------------------------------------------------------------------------------------------- worker --

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

    # An innermost frame here: a parked thread (a lock, a queue, inductor's compile workers waiting), not work.
    IDLE = ("threading.py", "queue.py", "selectors.py", "compile_worker/subproc_pool.py", "compile_worker/timer.py")

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


def _step_profiler_class():
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
            import traceback

            # The innermost frames outside torch itself: the code that asked for the value.
            frames = [f for f in traceback.extract_stack()[:-1]
                      if not f.filename.startswith(self.inside_torch) and not f.filename.endswith("warnings.py")][-3:]
            site = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))
            self.syncs[site] = self.syncs.get(site, 0) + 1

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
                    import warnings

                    self.catcher = warnings.catch_warnings()
                    self.catcher.__enter__()
                    warnings.simplefilter("always")
                    warnings.showwarning = self._count_sync
                    torch.cuda.set_sync_debug_mode("warn")
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
            events = self.prof.events()
            kernels = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
            # not inductor's "## Call CompiledFxGraph" ranges on the GPU's timeline: their kernels are counted already
            from scripts.step_breakdown import is_annotation

            kernels = [e for e in kernels if not is_annotation(e.name)]
            busy = sum(getattr(e, "device_time", 0) or 0 for e in kernels) / 1e6
            aten = sum(1 for e in events if e.name.startswith("aten::"))
            self.summary = {"wall_s": round(wall, 4), "gpu_busy_s": round(busy, 4),
                            "gpu_busy_share": round(busy / wall, 3) if wall else None,
                            "kernels": len(kernels), "aten_calls": aten}
            if self.cuda:
                self.summary["host_syncs"] = dict(sorted(self.syncs.items(), key=lambda kv: -kv[1]))
                from scripts.step_breakdown import breakdown, text

                self.summary["breakdown"] = breakdown(self.prof, LORA_RANK, self.vocab)
                print(f"rank {self.rank}: {text(self.summary['breakdown'])}", flush=True)
            trace_dir = os.environ.get("FREETUNE_PROFILE_TRACE")
            if trace_dir:
                self.prof.export_chrome_trace(str(Path(trace_dir) / f"trace-{os.getpid()}-rank{self.rank}.json"))
            averages = self.prof.key_averages()
            print(f"rank {self.rank}: profile of step {state.global_step}: {self.summary}", flush=True)
            sort = "self_device_time_total" if self.cuda else "self_cpu_time_total"
            # One print per table: under torchrun the ranks' lines interleave, a table at a time stays readable.
            print(f"rank {self.rank}:\n" + averages.table(sort_by=sort, row_limit=18, max_name_column_width=60),
                  flush=True)
            if self.cuda:
                print(f"rank {self.rank}:\n" + averages.table(sort_by="self_cpu_time_total", row_limit=30,
                                                                max_name_column_width=60), flush=True)

    return StepProfiler


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
    config = freetune.train.make_config(
        paths, plan, max_steps=total_steps + (1 if job.get("profile") else 0),  # the plan's batch and optimizer
        learning_rate=1e-4, max_length=job["max_length"], logging_steps=job.get("logging_steps", 1),
        save_steps=100_000, seed=0)
    ddp_experiment_callbacks = apply_ddp_experiments(experiments, config)
    sampler = StackSampler() if job.get("sample_stacks") else None
    timer = _timer_class()(job["warmup"], job["steps"], cuda, ctx.rank, sampler)
    # The profiled step comes after the measured ones: the profiler's own overhead stays out of the timings. Every
    # rank profiles the same step (under DDP the ranks wait for each other, so one rank's wait is the other's work);
    # the report keeps rank 0's summary, the log has every rank's tables.
    profiler = _step_profiler_class()(total_steps, cuda, ctx.rank, shape.vocab) if job.get("profile") else None
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


def _timer_class():
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


def train_run(job: dict, model, tokenizer, dataset, config, plan, paths, callbacks: list, ctx) -> list[dict]:
    """Train the job's run, freetune's path or the plain stack; the log history (rank 0's; [] on other ranks)."""
    import torch
    from trl import SFTTrainer

    import freetune
    from freetune.model import adapter_dtype_guard

    cuda = torch.cuda.is_available()
    if not job["run"].startswith("freetune"):
        # The plain stack as it comes: the Trainer's defaults that freetune.train.make_config changes to cut host
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
        "estimate_gib": round(plan.memory.estimate.peak_allocated_gib, 3) if plan.memory.estimate is not None else None,
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
    settings = {k: v for k, v in plan.memory.estimate.settings.items() if k not in ("model", "max_length", "micro_batch")}
    settings.update(gradient_checkpointing=plan.memory.checkpointing, optimizer=plan.memory.optimizer,
                    lora_kernel=plan.kernels.lora, frozen_dtype=plan.precision.frozen_dtype,
                    offload_activations=plan.memory.offload_activations, mlp_kernel=plan.kernels.mlp,
                    loss_tile_tokens=plan.kernels.loss_tile_tokens)
    return round(estimate(shape, max_length=tokens, micro_batch=1, **settings).peak_allocated_gib, 3)


def apply_experiments(experiments: dict, shape: ModelShape, local_rank: int) -> None:
    """The experiments a --variants run asks for that change freetune's path itself (before the model loads):
    cpp_wrapper, combo_kernels, dense_head, no_packed_check, pin_cores, byte_masks, per_layer_casts,
    copied_heads, trl_empty_cache, no_triton, inline_dgrad, skip_guards, no_asserts, gc_unfrozen, liger. A GPU worker
    process runs one configuration, so what they patch is patched for it only (a --tiny run without --spawn runs every
    job in one process: its patches stay for the runs after it)."""
    import torch

    if experiments.get("pin_cores"):
        # The step is host-bound, and two processes on the lent host slowed each other down (two_processes_contention).
        # Each process keeps to its own half of the host's cores (the 1-GPU run to the half rank 0 gets), and torch's
        # CPU thread pool to that size: no thread of one rank runs on the other's cores.
        cores = sorted(os.sched_getaffinity(0))
        half = len(cores) // 2
        own = cores[local_rank * half:(local_rank + 1) * half] or cores
        os.sched_setaffinity(0, own)
        torch.set_num_threads(len(own))
        print(f"pin_cores: local rank {local_rank} on cores {own[0]}-{own[-1]}", flush=True)

    if experiments.get("cpp_wrapper"):  # inductor's C++ wrapper: the compiled layers launch kernels from C++
        import torch._inductor.config

        torch._inductor.config.cpp_wrapper = True
    if experiments.get("combo_kernels"):
        # inductor's horizontal fusion: independent small kernels of a graph launched as one
        import torch._inductor.config

        torch._inductor.config.combo_kernels = True
    # Two host syncs per step that `--profile` finds on the default path, removed at a cost (on a GPU only):
    if experiments.get("dense_head"):
        # TRL's loss head picks the labelled positions with a boolean mask (hidden[mask], labels[mask]: the host
        # waits for the GPU to count them, in the forward and again in the backward); on devices without Triton it
        # scores every position and zeroes the unlabelled ones instead. That way here too: no sync, but prompt and
        # padding positions go through the vocabulary projection.
        import trl.trainer.utils

        trl.trainer.utils._use_triton = lambda device: False
    if experiments.get("no_packed_check"):
        # transformers asks the GPU whether the position ids hold packed rows at all (`.all()` on the host) before
        # building the attention mask; without that question it builds the block-diagonal mask every time (the
        # varlen kernel never reads it).
        import transformers.masking_utils

        def packed_rows(position_ids):
            first = position_ids[:, :1] - 1
            return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

        transformers.masking_utils.find_packed_sequence_indices = packed_rows
    if experiments.get("byte_masks"):  # the fused LoRA layers' dropout masks saved a byte per element, not packed bits
        import freetune.speed.lora_kernel

        freetune.speed.lora_kernel.pack_mask = lambda kept: kept  # the backward unpacks only uint8 masks
    # The two launch savings of the eighth session, undone to measure them in the same call:
    if experiments.get("per_layer_casts"):  # each fused layer casts its own LoRA weights (no once-per-forward cast)
        import freetune.speed.lora_kernel

        freetune.speed.lora_kernel.cast_adapters_once_per_forward = lambda model: None
    if experiments.get("copied_heads"):  # the memory-efficient attention's heads copied into parts, as before
        import freetune.speed.attention

        freetune.speed.attention.POLICY_BACKENDS["turing"] = ("efficient_copied",)
    # The two host savings of the ninth session, undone likewise:
    if experiments.get("trl_empty_cache"):  # TRL's offloading context empties the CUDA cache every micro-batch again
        import freetune.reach.trl

        freetune.reach.trl.keep_cuda_cache_between_steps = lambda trainer: False
    if experiments.get("no_triton"):  # the custom ops' eager dequantisation and MLP helpers without Triton kernels
        import freetune.speed.nf4

        freetune.speed.nf4.triton_for = lambda t: None
    # The backward's input gradients d W written into the compiled graphs, not through freetune::dequantized_mm
    # (fewer op calls; inductor places the dequantisation, which the op exists to prevent: watch the peak; the
    # tenth session's result is in docs/history.md)
    if experiments.get("inline_dgrad"):
        import freetune.speed.nf4

        dequantize = freetune.speed.nf4._dequantize
        freetune.speed.nf4.times_dequantized = (
            lambda d, packed, absmax, spec, table=None: d @ dequantize(packed, absmax, spec, table))
    # Two more host costs of every compiled layer call (tenth session):
    if experiments.get("skip_guards"):
        # dynamo checks each compiled layer's guards (~900 on a LoRA decoder layer) at every call; after the warm-up
        # steps (both graphs compiled: the first layer's input needs no gradient) only the guards that tell the cached
        # graphs apart. Unsafe in general (a change no checked guard sees runs the wrong graph): bench runs train only.
        import freetune.trainer

        step = freetune.trainer.FreetuneTrainer.training_step

        def training_step(self, *args, **kwargs):
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=self.state.global_step >= 2):
                return step(self, *args, **kwargs)

        freetune.trainer.FreetuneTrainer.training_step = training_step
    if experiments.get("no_asserts"):  # the compiled graphs' wrapper code checks every input's size and stride per call
        import torch._inductor.config

        torch._inductor.config.size_asserts = False
        torch._inductor.config.scalar_asserts = False
        if hasattr(torch._inductor.config, "alignment_asserts"):
            torch._inductor.config.alignment_asserts = False
    if experiments.get("gc_unfrozen"):  # the garbage collector walks every object at its full collections, as before
        import freetune.trainer

        freetune.trainer.GarbageFrozenAfterWarmup.on_step_end = lambda self, *args, **kwargs: None
    if experiments.get("liger"):  # Liger's Triton RMSNorm, SwiGLU and RoPE (not its loss: TRL's head is chunked)
        import liger_kernel.transformers as liger

        getattr(liger, f"apply_liger_kernel_to_{ARCHITECTURE[shape.name]}")(
            rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)


def apply_ddp_experiments(experiments: dict, config) -> list:
    """The DDP settings a --variants run asks for, on `config` (and the Trainer); returns callbacks to add.

    ddp_split=true:   dynamo's DDPOptimizer back on (freetune.speed.compiled_layers.compile_layers turns it off):
                      each compiled layer cut where a gradient bucket fills;
    static_graph=true: DDP(static_graph=True), the reducer's per-step bookkeeping done once;
    bucket_view=true:  DDP(gradient_as_bucket_view=True), the gradients kept in the buckets (no copy in and out);
    bucket_mb=N:       DDP(bucket_cap_mb=N);
    flat_sync=true:    DDP's reducer never syncs (no_sync on every micro-batch); after the last micro-batch of a step,
                       one all-reduce of all the LoRA gradients, flattened (flat_all_reduce). DDP's per-parameter
                       work is gone (a profile counted ~1,180 more ATen calls per step under DDP: copies into and out
                       of its buckets, a scaling per gradient); the all-reduce no longer overlaps the backward.
                       train()'s replica check still compares the ranks' weights at the end."""
    from transformers import Trainer, TrainerCallback

    if experiments.get("static_graph"):
        config.ddp_static_graph = True
    if experiments.get("bucket_mb"):
        config.ddp_bucket_cap_mb = int(experiments["bucket_mb"])
    if experiments.get("bucket_view"):
        build = Trainer._build_accelerator_args  # this worker process runs one configuration: patched for it only

        def with_bucket_view(self, **kwargs):
            args = build(self, **kwargs)
            for handler in args.get("kwargs_handlers", []):
                if type(handler).__name__ == "DistributedDataParallelKwargs":
                    handler.gradient_as_bucket_view = True
            return args

        Trainer._build_accelerator_args = with_bucket_view
    if experiments.get("flat_sync"):
        from freetune.trainer import FreetuneTrainer

        step = FreetuneTrainer.training_step  # this worker process runs one configuration: patched for it only

        def flat_sync_step(self, model, inputs, num_items_in_batch=None):
            if not hasattr(model, "no_sync"):  # not wrapped in DDP (one process)
                return step(self, model, inputs, num_items_in_batch)
            with model.no_sync():
                loss = step(self, model, inputs, num_items_in_batch)
            if self.accelerator.sync_gradients:  # the step's last micro-batch
                params = [p for p in model.parameters() if p.requires_grad]
                if self.state.global_step == 0:
                    print(f"flat_sync: the step's gradients ({len(params)} tensors) averaged in one "
                          f"all-reduce; DDP's reducer idle", flush=True)
                flat_all_reduce(params)
            return loss

        FreetuneTrainer.training_step = flat_sync_step
    callbacks = []
    if experiments.get("ddp_split"):
        class SplitForDDP(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):  # after compile_layers, before any compile
                import torch._dynamo

                torch._dynamo.config.optimize_ddp = True

        callbacks.append(SplitForDDP())
    return callbacks


# ----------------------------------------------------------------------------------------- orchestrator --

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
               __file__, "--worker", str(job_file)]
    else:
        cmd = [sys.executable, __file__, "--worker", str(job_file)]
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    parser.add_argument("--variants", default="",
                        help="extra freetune runs with plan choices changed, ';'-separated 'label:field=value,...' "
                             "(e.g. 'eager:compile=false;peft:lora_kernel=peft,optimizer=paged_adamw_8bit'); also the "
                             "experiments liger=true (Liger's RMSNorm/SwiGLU/RoPE, liger-kernel installed), "
                             "cpp_wrapper=true (inductor's C++ wrapper), combo_kernels=true (inductor's horizontal "
                             "fusion), byte_masks=true (dropout masks a byte per "
                             "element, as before freetune.speed.lora_kernel.pack_mask; with mlp_kernel=layers only), "
                             "fp32_absmax=true (the fused layers' fp32 absmax copy where compiled ones keep 8-bit), "
                             "per_layer_casts=true (each layer casts its own LoRA weights), copied_heads=true (the "
                             "T4 attention's heads copied into parts), trl_empty_cache=true (TRL's offloading "
                             "empties the CUDA cache every micro-batch), no_triton=true (the custom ops' element-wise "
                             "work without freetune.speed.triton_kernels), inline_dgrad=true (the backward's input "
                             "gradients inside the compiled graphs, not through freetune::dequantized_mm), "
                             "skip_guards=true (after two steps dynamo checks only the guards that tell the layers' "
                             "graphs apart), no_asserts=true (no size/stride checks in the compiled graphs' "
                             "wrappers), gc_unfrozen=true (no gc.freeze after the warm-up), "
                             "lora_dropout=0 (freetune with the peer's LoRA: no dropout; default: the mode's "
                             "recipe's), "
                             "dense_head=true and no_packed_check=true (two host syncs per step removed), "
                             "pin_cores=true (apply_experiments) and "
                             "the DDP settings ddp_split=true, "
                             "static_graph=true, bucket_view=true, bucket_mb=N, flat_sync=true (apply_ddp_experiments; "
                             "a variant of only these runs under DDP only). 'label:' alone repeats freetune's runs")
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
                             "AdamW), judged against the mode's target like the default run (LIKE_FOR_LIKE)")
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
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
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
    return args


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

    sample_file, longest_row = None, None  # synthetic rows: cut at max_length, the plan sizes for it
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
        runs = [(run, {}) for run in RUNS + PEER_RUNS if run in args.runs.split(",")]
        runs += [(f"freetune[{label}]", overrides) for label, overrides in parse_variants(args.variants)]
        if args.like_for_like:
            runs.append((f"freetune[{LIKE_FOR_LIKE[0]}]", dict(LIKE_FOR_LIKE[1])))
        if args.match_peer_memory:  # last: its budget is the peak of a peer run measured before it
            runs.append((MATCHED, {}))
        for run, overrides in runs:
            warmup, measured = (-(-n // every) * every for n in steps[base_run(run)])
            jobs.append(dict(mode=mode, run=run, shape=spec["shape"], cap_gib=spec["cap_gib"],
                             precision=spec["precision"], max_length=max_length, warmup=warmup, steps=measured,
                             model=str(model_dir), tokenizer=str(tokenizer_dir), rows=str(rows_file),
                             longest_row=longest_row,
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


def counts_as_failure(run: dict) -> bool:
    """A run that failed. A peer run out of memory is a measurement (that setting does not fit the cap; the x Unsloth
    ratios and the targets use the fastest one that fits), not a failure of the benchmark."""
    return "failed" in run and not (run["run"] in PEER_RUNS and run.get("out_of_memory"))


def merge_runs(report: dict, theirs: list[dict]) -> None:
    """Add an earlier report's measured runs to this one's. Not a run that failed or was skipped there (it says
    nothing here), nor one this call measured again (the new measurement is the one the ratios use), nor a DDP run
    whose 1-GPU run this call measured again: its efficiency would divide rates of two calls, and the lent host's
    speed changes between calls by more than the DDP loss being measured."""
    key = lambda r: (r["mode"], r["run"], r["world_size"])  # noqa: E731
    mine = {key(r) for r in report["runs"] if "failed" not in r}
    report["runs"] += [r for r in theirs if "failed" not in r and key(r) not in mine
                       and not (r["world_size"] > 1 and (r["mode"], r["run"], 1) in mine)]


def base_run(run: str) -> str:
    """'freetune[label]' (a --variants run) -> 'freetune'."""
    return run.split("[")[0]


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


def flat_all_reduce(params: list) -> None:
    """Average the gradients of `params` over the ranks in one all-reduce per dtype (the flat_sync experiment)."""
    import torch
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    by_dtype = {}
    for p in params:
        if p.grad is None:  # every rank must send the same layout
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads).div_(dist.get_world_size())
        dist.all_reduce(flat)
        torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))


def ddp_only(overrides: dict) -> bool:
    """A --variants run that changes only DDP settings (nothing to measure on one GPU)."""
    return bool(overrides) and all(k in DDP_EXPERIMENTS for k in overrides)


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


def summarise(report: dict) -> None:
    """Ratios and MFU, filled into each run (idempotent)."""
    peak_tflops = report["matmul_tflops"].get("bf16") or report["matmul_tflops"].get("fp32")
    by_key = {(r["mode"], r["run"], r["world_size"]): r for r in report["runs"] if "tokens_per_s" in r}
    for (mode, run, world), r in by_key.items():
        n = matmul_flops_per_token(shape_named(r["model_shape"]))
        per_gpu = r["tokens_per_s"] / world
        r["mfu_6n"] = round(6 * n * per_gpu / (peak_tflops * 1e12), 4)
        r["mfu_4n"] = round(4 * n * per_gpu / (peak_tflops * 1e12), 4)
        for ref in ("free_tier", "plain_best"):
            base = by_key.get((mode, ref, world))
            if base and ref != run:
                r[f"x_{ref}"] = round(r["tokens_per_s"] / base["tokens_per_s"], 2)
        # A variant without its own 1-GPU run (--ddp-only) is compared with freetune's.
        one = by_key.get((mode, run, 1)) or by_key.get((mode, base_run(run), 1))
        if world > 1 and one:
            r["ddp_efficiency"] = round(r["tokens_per_s"] / (world * one["tokens_per_s"]), 3)
        peer = fastest_peer(by_key, mode)
        if peer and world == 1 and run not in PEER_RUNS:
            r["x_unsloth"] = round(r["tokens_per_s"] / peer["tokens_per_s"], 2)
    targets = peer_targets(report["runs"])
    if targets:
        report["targets"] = targets


def fastest_peer(by_key: dict, mode: str) -> dict | None:
    """The fastest Unsloth run of `mode` that fits (a run that ran out of memory has no rate, so is not there)."""
    peers = [by_key[(mode, p, 1)] for p in PEER_RUNS if (mode, p, 1) in by_key]
    return max(peers, key=lambda r: r["tokens_per_s"], default=None)


def peer_targets(runs: list[dict]) -> list[dict]:
    """Issue 25's targets, for each mode a peer was asked in: [{mode, target, met (None: nothing to compare), detail}].
    4gb: freetune's tokens/s >= 1.3x Unsloth's offloaded-checkpointing run at no more peak allocated memory;
    t4: >= 1.3x the fastest Unsloth run that fits; uncapped: >= 1.8x the fastest Unsloth run, and a lean point (a
    --variants run labelled lean...) at a peak <= Unsloth's offloaded run's and >= 1.3x its tokens/s. A
    --like-for-like run (freetune[like]) is judged against its mode's target too, on a line of its own."""
    measured = {(r["mode"], r["run"]): r for r in runs if "tokens_per_s" in r and r["world_size"] == 1}
    asked = {r["mode"] for r in runs if r["run"] in PEER_RUNS}
    out = []
    for mode in [m for m in TARGET_X if m in asked]:
        offloaded = measured.get((mode, "unsloth"))
        fastest = max((measured[(mode, p)] for p in PEER_RUNS if (mode, p) in measured),
                      key=lambda r: r["tokens_per_s"], default=None)
        like = f"freetune[{LIKE_FOR_LIKE[0]}]"
        for run, settings in (("freetune", ""), (like, "like for like, ")):
            ours = measured.get((mode, run))
            if run == like and ours is None:
                continue
            if mode == "4gb":
                out.append(_target(mode, f"{settings}>= {TARGET_X[mode]}x Unsloth (offloaded), peak <=", ours,
                                   offloaded, TARGET_X[mode], memory=True))
            else:
                out.append(_target(mode, f"{settings}>= {TARGET_X[mode]}x the fastest Unsloth that fits", ours,
                                   fastest, TARGET_X[mode], memory=False))
        if mode != "uncapped":  # issue 49: every freetune run of the mode against the fastest that fits, at its memory
            for run in sorted(r for m, r in measured if m == mode and base_run(r) == "freetune"):
                out.append(_target(mode, f"issue 49: >= {TARGET_X[mode]}x the fastest Unsloth that fits, peak <= "
                                         f"its + {PEER_MEMORY_MARGIN:.0%}", measured[(mode, run)], fastest,
                                   TARGET_X[mode], memory=True, margin=PEER_MEMORY_MARGIN))
        if mode == "uncapped":
            leans = [r for (m, run), r in measured.items() if m == mode and run.startswith("freetune[lean")]
            for lean in leans or [None]:
                out.append(_target(mode, f"lean point: >= {LEAN_X}x Unsloth (offloaded), peak <=", lean, offloaded,
                                   LEAN_X, memory=True))
    return out


def _target(mode: str, target: str, ours: dict | None, peer: dict | None, x: float, memory: bool,
            margin: float = 0.0) -> dict:
    if ours is None or peer is None:
        missing = ("no --variants run labelled lean..." if "lean" in target else "no freetune run") if ours is None \
            else "no Unsloth run to compare with (not run, or out of memory)"
        return {"mode": mode, "target": target, "met": None, "detail": f"not measured: {missing}"}
    ratio = ours["tokens_per_s"] / peer["tokens_per_s"]
    met = ratio >= x
    detail = (f"{ours['run']} {ours['tokens_per_s']:,.0f} tok/s vs {peer['run']} {peer['tokens_per_s']:,.0f}: "
              f"{ratio:.2f}x")
    if memory:
        mine, theirs = ours.get("peak_allocated_gib"), peer.get("peak_allocated_gib")
        met = met and mine is not None and theirs is not None and mine <= theirs * (1 + margin)
        detail += f", peak allocated {mine} vs {theirs} GiB"
    return {"mode": mode, "target": target, "met": met, "detail": detail}


def loss_agreement(runs: list[dict]) -> list[str]:
    """Per mode and peer run: the largest difference between its per-step losses and freetune's over the steps both
    logged (same rows in the same order; freetune's LoRA dropout and kernels differ, so close rather than equal)."""
    ours = {r["mode"]: r for r in runs if r["run"] == "freetune" and r.get("world_size") == 1 and r.get("losses")}
    lines = []
    for r in runs:
        mine = ours.get(r["mode"])
        if r["run"] in PEER_RUNS and r.get("losses") and mine and mine["logging_steps"] == r["logging_steps"]:
            pairs = list(zip(mine["losses"], r["losses"]))
            lines.append(f"  {r['mode']:9s} {r['run']} vs freetune over {len(pairs)} logged steps: largest loss "
                         f"difference {max(abs(a - b) for a, b in pairs):.3f} (first step {pairs[0][1]:.3f} vs "
                         f"{pairs[0][0]:.3f})")
    return lines


def table(report: dict) -> str:
    """The runs' table; with the peer, issue 25's targets and the per-step losses' agreement under it."""
    cols = ["mode", "run", "GPUs", "batch", "ckpt", "batching", "sampler", "attn", "LoRA", "GPU busy", "tok/s",
            "step s", "alloc GiB", "resv GiB",
            "MFU 6N", "MFU 4N", "x free", "x plain", "x Unsloth", "DDP eff"]
    lines, failed = [cols], []
    for r in report["runs"]:
        if "failed" in r:
            failed.append([r["mode"], r["run"], str(r["world"]), "FAILED: " + r["failed"]])
            continue
        lines.append([r["mode"], r["run"], str(r["world_size"]), f"{r['micro_batch']}x{r['grad_accum']}",
                      r.get("checkpointing") or ("off" if not r["gradient_checkpointing"] else
                                                 "offload" if r.get("offload_activations") else "on"), r["batching"],
                      r.get("sampler", ""), r.get("attention", ""),
                      r.get("lora_kernel", "") + ("" if r.get("mlp_kernel", "layers") == "layers"
                                                  else f"+{r['mlp_kernel']}"),
                      f"{r['profile']['gpu_busy_share']:.0%}" if r.get("profile", {}).get("gpu_busy_share") else "",
                      f"{r['tokens_per_s']:.0f}",
                      f"{r['step_s']:.2f}", f"{r.get('peak_allocated_gib', r.get('peak_rss_gib', 0)):.2f}",
                      f"{r.get('peak_reserved_gib', 0):.2f}", f"{r.get('mfu_6n', 0):.1%}",
                      f"{r.get('mfu_4n', 0):.1%}", str(r.get("x_free_tier", "")), str(r.get("x_plain_best", "")),
                      str(r.get("x_unsloth", "")), str(r.get("ddp_efficiency", ""))])
    # A failed run's reason runs on past the columns rather than widening them.
    widths = [max(len(row[i]) for row in lines + [f[:3] for f in failed] if i < len(row)) for i in range(len(cols))]
    text = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines + failed]
    if report.get("targets"):
        text += ["", "targets (issue 25; tok/s and peak allocated, freetune vs Unsloth):"] + [
            f"  {t['mode']:9s} {t['target']}: {'-' if t['met'] is None else 'met' if t['met'] else 'NOT met'}: "
            f"{t['detail']}" for t in report["targets"]]
    agreement = loss_agreement(report["runs"])
    if agreement:
        text += ["", "per-step losses:"] + agreement
    return "\n".join(text)


if __name__ == "__main__":
    sys.exit(main())
