"""Where a profiled training step's GPU time goes, by kernel category and phase (issue 49).

Imports only the standard library (and reads a torch.profiler object it is given), so that both bench.py's workers
and the peer's (scripts/bench_unsloth.py, which has no freetune on its path) use the same rules.

Each GPU kernel is attributed to the CPU op that launched it and that op's ancestors (torch.profiler's kernels per
op, recorded with record_shapes=True), and sorted:
  what:  4-bit dequantisation (bitsandbytes' or freetune's dequantise kernels, inductor's fused decoding of NF4
         bytes; not LoRA dropout's mask bits, whose unpacking inductor fuses into element-wise work), matmul (base
         weights), matmul (LoRA: an operand with the LoRA rank as a dimension), matmul (loss head: an operand with
         the vocabulary as a dimension), attention, loss head (softmax / cross-entropy), optimizer, element-wise
         compiled (inductor's Triton kernels), element-wise eager, other;
  phase: forward, backward, recompute (forward ops run inside the backward: checkpointing), optimizer.
These are rules on names and shapes, not a trace of the code: the shares are close, not exact.
"""

from __future__ import annotations

import re

# Kernel names of 4-bit dequantisation. Inductor names a fused kernel after its ops: freetune's NF4 decoding in a
# compiled graph (freetune.speed.bnb_cpu.decode_4bit) shifts with `>>`, aten's __rshift__; the LoRA dropout mask's
# unpacking (freetune.speed.lora_kernel.unpack_mask) with bitwise_right_shift, which inductor fuses into the SiLU's and
# the norms' backward: element-wise work, counted as dequantisation until 2026-12-06 (16.9 ms of the T4 long-row
# step's 183, docs/performance.md). tests/test_bench.py compiles both and checks their names here.
DEQUANT = re.compile(r"dequant|nf4|kdequantize|__rshift__", re.I)
ATTENTION = re.compile(r"fmha|attention|flash|attn|sdpa", re.I)
MATMUL = re.compile(r"gemm|nvjet|xmma|cutlass|cublas|wgmma|s16816|s1688|matmul|_mm_|splitk", re.I)
LOSS = re.compile(r"softmax|cross_entropy|nll_loss|logsumexp|cross-entropy", re.I)
OPTIMIZER = re.compile(r"optimizer|adam|multi_tensor_apply|_foreach_|opt_step", re.I)
ELEMENTWISE = re.compile(r"elementwise|vectorized|unrolled|copy|cast|fill|memset|memcpy|reduce|index|cat|where",
                         re.I)
TOP_KERNELS = 6  # kernels listed per category in the report and the log

# An op that runs the forward: met before any backward node when walking up from a kernel's op, inside the backward,
# it is checkpointing's recompute. Not aten::matmul or aten::mm: custom backward functions (freetune's fused LoRA,
# Unsloth's) multiply with `@`.
FORWARD_OPS = ("aten::linear", "aten::embedding", "aten::scaled_dot_product_attention", "CompiledFunction",
               "freetune::varlen_efficient", "freetune::qlora_mlp")
# A backward node that is a checkpoint's: what runs inside it before any other backward node is the recompute
# (Unsloth's offloaded checkpointing is an autograd Function of its own).
CHECKPOINT_NODES = re.compile(r"checkpoint|offloaded", re.I)


def is_annotation(event) -> bool:
    """A range on the GPU's timeline that is no kernel: inductor's "## Call CompiledFxGraph ... ##", and the ranges
    record_function marks there (torch.optim's "Optimizer.step#AdamW.step", the profiler's "ProfilerStep#14"). The
    optimizer's range spans its launches: with bitsandbytes' 8-bit AdamW, one kernel per weight, that is ~20 ms of a
    GPU waiting for the host, which counted as 20 ms of optimizer kernels before (no kernel name has a '#')."""
    name = event if isinstance(event, str) else event.name
    return name.startswith("## ") or "#" in name or bool(getattr(event, "is_user_annotation", False))


def chain_of(event) -> list:
    """The CPU op and its ancestors, innermost first."""
    out = []
    while event is not None:
        out.append(event)
        event = getattr(event, "cpu_parent", None)
    return out


def phase_of(names: list[str]) -> str:
    """forward, backward, recompute or optimizer, from the op names innermost first."""
    if any(OPTIMIZER.search(n) for n in names) and not any("Backward" in n for n in names):
        return "optimizer"
    if not any("Backward" in n or "evaluate_function" in n for n in names):
        return "forward"
    for name in names:
        if name in FORWARD_OPS:
            return "recompute"
        if "Backward" in name or "evaluate_function" in name:
            return "recompute" if CHECKPOINT_NODES.search(name) else "backward"
    return "backward"


def category_of(kernel: str, names: list[str], shapes: list, lora_rank: int, vocab: int) -> str:
    """What a kernel does (module docstring), from its name, its ops' names and the innermost op's input shapes."""
    if DEQUANT.search(kernel):
        return "4-bit dequantisation"
    if ATTENTION.search(kernel) or any(ATTENTION.search(n) for n in names[:4]):
        return "attention"
    if MATMUL.search(kernel):
        dims = {d for shape in shapes or [] if isinstance(shape, (list, tuple)) for d in shape}
        if vocab in dims or any(LOSS.search(n) for n in names):
            return "matmul (loss head)"
        if lora_rank in dims:
            return "matmul (LoRA)"
        return "matmul (base weights)"
    if any(DEQUANT.search(n) for n in names[:3]):  # a non-matmul kernel inside a dequantising op
        return "4-bit dequantisation"
    if LOSS.search(kernel) or any(LOSS.search(n) for n in names):
        return "loss head (softmax, cross-entropy)"
    if OPTIMIZER.search(kernel) or any(OPTIMIZER.search(n) for n in names):
        return "optimizer"
    if kernel.startswith("triton_") or kernel.startswith("_") and "kernel" in kernel:
        return "element-wise (compiled / Triton)"
    if ELEMENTWISE.search(kernel):
        return "element-wise (eager)"
    return "other"


def breakdown(prof, lora_rank: int, vocab: int) -> dict:
    """{"by_category": {what: ms}, "by_phase": {phase: ms}, "by_phase_category": {phase: {what: ms}}, "top_kernels":
    {what: [[kernel, calls, ms], ...]}, "total_ms", "attributed_ms"} over a torch.profiler profile's GPU kernels."""
    by_cat, by_phase, both, by_kernel = {}, {}, {}, {}
    seen_us = 0.0

    def count(what: str, phase: str, kernel: str, us: float) -> None:
        by_cat[what] = by_cat.get(what, 0.0) + us
        by_phase[phase] = by_phase.get(phase, 0.0) + us
        both.setdefault(phase, {})[what] = both.setdefault(phase, {}).get(what, 0.0) + us
        calls_us = by_kernel.setdefault(what, {}).setdefault(kernel, [0, 0.0])
        calls_us[0] += 1
        calls_us[1] += us

    for event in prof.events():
        kernels = [k for k in getattr(event, "kernels", None) or [] if not is_annotation(k.name)]
        if not kernels:
            continue
        chain = chain_of(event)
        names = [e.name for e in chain]
        shapes = getattr(event, "input_shapes", None) or []
        phase = phase_of(names)
        for kernel in kernels:
            us = float(getattr(kernel, "duration", 0) or 0)
            what = "optimizer" if phase == "optimizer" else category_of(kernel.name, names, shapes, lora_rank, vocab)
            count(what, phase, kernel.name, us)
            seen_us += us
    # Every kernel on the GPU's timeline (not the ranges marked there, is_annotation: they span kernels already
    # counted, or a wait for the host): those no op claimed (a library that launches through ctypes, as bitsandbytes'
    # dequantisation does under Unsloth) are sorted by their name alone, phase "unattributed".
    on_gpu = {}
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and not is_annotation(e):
            on_gpu[e.name] = on_gpu.get(e.name, 0.0) + float(getattr(e, "device_time", 0) or 0)
    claimed = {}
    for event in prof.events():
        for kernel in getattr(event, "kernels", None) or []:
            claimed[kernel.name] = claimed.get(kernel.name, 0.0) + float(getattr(kernel, "duration", 0) or 0)
    for name, us in on_gpu.items():
        rest = us - claimed.get(name, 0.0)
        if rest > 1.0:
            count(category_of(name, [], [], lora_rank, vocab), "unattributed", name, rest)
    device_us = sum(on_gpu.values())
    ms = lambda d: {k: round(v / 1000, 2) for k, v in sorted(d.items(), key=lambda kv: -kv[1])}  # noqa: E731
    # per category its kernels with the most time: [name (cut to 90 characters), calls, ms]
    top = {what: [[name[:90], calls, round(us / 1000, 2)]
                  for name, (calls, us) in sorted(named.items(), key=lambda kv: -kv[1][1])[:TOP_KERNELS]]
           for what, named in by_kernel.items()}
    return {"total_ms": round(device_us / 1000, 2), "attributed_ms": round(seen_us / 1000, 2),
            "by_category": ms(by_cat), "by_phase": ms(by_phase),
            "by_phase_category": {p: ms(d) for p, d in both.items()}, "top_kernels": top}


def text(result: dict) -> str:
    total = result["total_ms"] or 1.0
    lines = [f"GPU kernel time of the profiled step: {result['total_ms']} ms ({result['attributed_ms']} ms attributed "
             f"to an op, the rest by kernel name)", "  by what:"]
    lines += [f"    {k:38s} {v:9.2f} ms  {v / total:6.1%}" for k, v in result["by_category"].items()]
    lines += ["  by phase:"] + [f"    {k:38s} {v:9.2f} ms  {v / total:6.1%}" for k, v in result["by_phase"].items()]
    lines += ["  the kernels with the most time, per category (calls, ms):"]
    for what in result["by_category"]:
        lines += [f"    {what}:"] + [f"      {calls:5d} {ms:9.2f}  {name}"
                                     for name, calls, ms in result.get("top_kernels", {}).get(what, [])]
    return "\n".join(lines)
