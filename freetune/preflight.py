"""Preflight: read the machine before anything loads, and decide the training plan with a reason for each choice.

Most failed free-tier runs die of the machine, not the model: a P100 that current PyTorch cannot use, bf16
asked of a T4, a batch that does not fit. `read_hardware()` reports what is there; `make_plan()` turns it into
decisions (precision, attention, single GPU or DDP, micro-batch and max_length) and refuses a GPU the installed
PyTorch cannot run, before a model is downloaded. The plan shows itself as a table in a notebook.

    python -m freetune.preflight [--json] [--model-shape qwen2.5-1.5b] [--max-length 1024]

The precision policy, and why:
- Turing (T4, sm_75): fp16 tensor cores, no fast bf16. Compute in fp16 with fp16 mixed precision (loss
  scaling). The non-quantised weights load in fp16 even when the checkpoint says bfloat16: bf16 tensors on the
  fp16 path fail with `"_amp_foreach_non_finite_check_and_unscale_cuda" not implemented for 'BFloat16'`.
  LoRA weights stay fp32 (the GradScaler refuses to unscale fp16 gradients, and fp16 weights lose small updates).
- Ampere and newer (sm_80+): bf16, which has fp32's range and needs no loss scaling.
- No GPU: fp32 on the CPU (checks and smoke runs).
"""

from __future__ import annotations

import argparse
import html
import json
import os
import platform as _platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field

from freetune import resources
from freetune.errors import FreetuneError
from freetune.memory import GIB, MemoryEstimate, ModelShape, estimate, fit

POLICIES = ("turing", "ampere")
LAYOUTS = ("auto", "single", "ddp", "fsdp")
# What to pick instead of a GPU the installed PyTorch cannot run, where people meet one (Kaggle's P100).
SUPPORTED_GPU_ADVICE = ('on Kaggle, Settings -> Accelerator -> "GPU T4 x2"; '
                        'on Colab, Runtime -> Change runtime type -> T4 GPU')
# Below these, a run has no room for checkpoints, or for the merged 16-bit model at export.
MIN_FREE_DISK_GIB = 2.0


@dataclass(frozen=True)
class GPU:
    name: str
    capability: tuple[int, int]
    memory_gib: float

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


@dataclass
class Hardware:
    """What preflight reads. Every field has a default so tests can describe a machine by hand."""

    gpus: list[GPU] = field(default_factory=list)
    arch_list: list[str] = field(default_factory=list)  # torch.cuda.get_arch_list(): what this torch was built for
    bf16_supported: bool = False                        # native bf16 (compute capability 8.0+), not emulated
    python: str = field(default_factory=_platform.python_version)
    torch: str = ""
    cuda: str | None = None                             # the CUDA version torch was built with
    driver: str | None = None                           # the NVIDIA driver (nvidia-smi)
    flash_attn: bool = False                            # the flash_attn package is importable
    sdpa: bool = True                                   # torch has scaled_dot_product_attention (2.0+)
    work_dir: str = "."
    checkpoint_dir: str = "."
    disk_free_gib: dict = field(default_factory=dict)   # folder -> GiB free
    ram_total_gib: float | None = None
    ram_available_gib: float | None = None
    torchrun_world_size: int | None = None              # WORLD_SIZE when launched by torchrun

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)

    def built_for(self, gpu: GPU) -> bool | None:
        """Whether the installed torch has kernels for this GPU (None: the arch list is unknown)."""
        return torch_supports(gpu.capability, self.arch_list) if self.arch_list else None

    def summary(self) -> str:
        if not self.gpus:
            return "no GPU (CPU only)"
        names = sorted({g.name for g in self.gpus})
        first = self.gpus[0]
        return (f"{self.gpu_count} x {' / '.join(names)} ({first.sm}, "
                f"{min(g.memory_gib for g in self.gpus):.1f} GiB)")

    def report(self) -> str:
        """The hardware report, a few lines of plain text."""
        versions = f"Python {self.python} | torch {self.torch or '?'}"
        if self.cuda:
            versions += f" (CUDA {self.cuda})"
        if self.driver:
            versions += f" | NVIDIA driver {self.driver}"
        lines = [versions]
        if not self.gpus:
            lines.append("GPU: none visible to torch")
        for i, gpu in enumerate(self.gpus):
            built = {True: "yes", False: "NO", None: "unknown"}[self.built_for(gpu)]
            lines.append(f"GPU {i}: {gpu.name}, compute capability {gpu.capability[0]}.{gpu.capability[1]} "
                         f"({gpu.sm}), {gpu.memory_gib:.1f} GiB, torch built for it: {built}")
        if self.gpus:
            lines.append(f"bf16: {'yes' if self.bf16_supported else 'no (native bf16 needs compute capability 8.0+)'}"
                         f"; torch built for: {', '.join(self.arch_list) or 'unknown'}")
        disk = ", ".join(f"{gib:.1f} GiB free in {folder}" for folder, gib in self.disk_free_gib.items())
        lines.append(f"disk: {disk or 'unknown'}")
        if self.ram_total_gib is not None:
            available = f" ({self.ram_available_gib:.1f} GiB available)" if self.ram_available_gib is not None else ""
            lines.append(f"RAM: {self.ram_total_gib:.1f} GiB{available}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["gpus"] = [{**asdict(g), "sm": g.sm, "torch_built_for_it": self.built_for(g)} for g in self.gpus]
        data["gpu_count"] = self.gpu_count
        return data


def torch_supports(capability: tuple[int, int], arch_list: list[str]) -> bool:
    """Whether a torch built for arch_list runs on a GPU of this compute capability.

    A cubin built for sm_XY runs on the same major version with minor >= Y (sm_80 code runs on an sm_86 card);
    PTX (compute_XY) is compiled at load time for any GPU of capability >= X.Y.
    """
    major, minor = capability
    for arch in arch_list:
        match = re.fullmatch(r"(sm|compute)_(\d+)[a-z]?", arch)
        if not match:
            continue
        arch_major, arch_minor = divmod(int(match.group(2)), 10)
        if match.group(1) == "sm" and arch_major == major and arch_minor <= minor:
            return True
        if match.group(1) == "compute" and (arch_major, arch_minor) <= (major, minor):
            return True
    return False


def _disk_free_gib(folder: str) -> float | None:
    try:
        return round(resources.free_disk_bytes(folder) / GIB, 1)
    except OSError:
        return None


def _ram_gib() -> tuple[float | None, float | None]:
    return tuple(None if n is None else round(n / GIB, 1) for n in resources.ram_bytes())


def _driver_version() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def read_hardware(work_dir: str = ".", checkpoint_dir: str = ".") -> Hardware:
    """Read this machine: versions, GPUs and what torch was built for, bf16, free disk, RAM.

    Reads device properties only: no tensor is created, so no memory is taken on the GPUs.
    """
    import importlib.util

    import torch

    gpus: list[GPU] = []
    arch_list: list[str] = []
    bf16 = False
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append(GPU(props.name, (props.major, props.minor), round(props.total_memory / GIB, 2)))
        arch_list = list(torch.cuda.get_arch_list())
        try:
            bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
        except TypeError:  # torch < 2.3 has no including_emulation (and reports native support only)
            bf16 = bool(torch.cuda.is_bf16_supported())
    disk = {}
    for folder in dict.fromkeys([work_dir, checkpoint_dir]):
        free = _disk_free_gib(folder)
        if free is not None:
            disk[folder] = free
    ram_total, ram_available = _ram_gib()
    world = os.environ.get("WORLD_SIZE") if "LOCAL_RANK" in os.environ else None
    return Hardware(
        gpus=gpus, arch_list=arch_list, bf16_supported=bf16, torch=torch.__version__, cuda=torch.version.cuda,
        driver=_driver_version() if gpus else None,
        flash_attn=importlib.util.find_spec("flash_attn") is not None,
        sdpa=hasattr(torch.nn.functional, "scaled_dot_product_attention"),
        work_dir=work_dir, checkpoint_dir=checkpoint_dir, disk_free_gib=disk,
        ram_total_gib=ram_total, ram_available_gib=ram_available,
        torchrun_world_size=int(world) if world else None,
    )


@dataclass
class Plan:
    device: str                 # "cuda" or "cpu"
    compute_dtype: str          # "float16" | "bfloat16" | "float32": 4-bit matmuls and non-quantised weights
    mixed_precision: str        # "fp16" | "bf16" | "no": the Trainer's autocast mode
    attn_implementation: str    # "sdpa" | "eager" | "flash_attention_2" | "freetune_varlen" (freetune.fast)
    reasons: dict = field(default_factory=dict)
    layout: str | None = None   # "single" | "ddp" | "fsdp" | "cpu" (None: from device)
    world_size: int = 1         # processes (one per GPU) under DDP
    micro_batch: int = 1        # rows per GPU per forward pass
    grad_accum: int = 1         # micro-batches per optimizer step
    max_length: int = 1024      # tokens per row; longer rows are cut
    lora_dtype: str = "float32"
    policy: str = ""            # "turing" | "ampere" | "cpu"
    batching: str = "padded"    # "padding_free" | "grouped" | "padded" (freetune.fast)
    sampler: str = "random"     # "random" | "length_grouped" | "rank_balanced": rows per rank and micro-batch
    gradient_checkpointing: bool = True  # recompute activations in the backward (chosen by memory when "auto")
    lora_kernel: str = "peft"   # "fused" (freetune.kernels: one autograd node per 4-bit LoRA layer) | "peft"
    optimizer: str = "paged_adamw_8bit"  # the Trainer's `optim` (chosen by memory when "auto")
    compile: bool = False       # torch.compile each decoder layer (freetune.kernels.compile_layers)
    frozen_dtype: str = "float32"  # the frozen non-4-bit weights (embeddings, norms, lm_head) and residual stream
    offload_activations: bool = False  # checkpointed layers' inputs kept in pinned host memory, not on the GPU
    loss_tile_tokens: int = 0   # tokens per tile of TRL's chunked loss head (0: TRL's own, 4,096)
    checkpoint_every: int = 1   # with checkpointing on, every n-th decoder layer is checkpointed (1: all of them)
    asked: dict = field(default_factory=dict)  # make_plan's arguments (hardware apart), for replan
    memory: MemoryEstimate | None = None
    machine: str = ""
    warnings: list = field(default_factory=list)

    def __post_init__(self):
        if self.layout is None:
            self.layout = "cpu" if self.device == "cpu" else "single"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.compute_dtype)

    @property
    def load_dtype(self) -> str:
        """The dtype the model's non-quantised weights load in: the compute dtype, never the checkpoint's."""
        return self.compute_dtype

    @property
    def rows_per_step(self) -> int:
        return self.micro_batch * self.grad_accum * self.world_size

    def rows(self) -> list[tuple[str, str, str]]:
        """(choice, value, why) for each decision."""
        r = self.reasons
        batch = f"{self.micro_batch} x {self.grad_accum}"
        if self.world_size > 1:
            batch += f" x {self.world_size} GPUs"
        batch += f" = {self.rows_per_step} rows/step"
        rows = [
            ("machine", self.machine or self.device, r.get("machine", "")),
            ("layout", self.layout if self.layout not in ("ddp", "fsdp") else f"{self.layout} x {self.world_size}",
             r.get("layout", "")),
            ("compute dtype", self.compute_dtype, r.get("compute_dtype", "")),
            ("mixed precision", self.mixed_precision, r.get("mixed_precision", "")),
            ("base weights", f"4-bit NF4, rest {self.frozen_dtype}",
             "; ".join(filter(None, (r.get("frozen_dtype", ""), r.get("load_dtype", ""))))),
            ("LoRA weights", self.lora_dtype, r.get("lora_dtype", "")),
            ("attention", self.attn_implementation, r.get("attention", "")),
            ("batch", batch, r.get("batch", "")),
            ("batching", self.batching, r.get("batching", "")),
            ("sampler", self.sampler, r.get("sampler", "")),
            ("checkpointing", self.checkpointing_text(), r.get("gradient_checkpointing", "")),
            ("LoRA kernel", self.lora_kernel, r.get("lora_kernel", "")),
            ("optimizer", self.optimizer, r.get("optimizer", "")),
            ("compile", "per decoder layer" if self.compile else "off", r.get("compile", "")),
            ("max_length", str(self.max_length), r.get("max_length", "")),
        ]
        if self.memory is not None:
            budget = f" of {self.memory.budget_gib:.1f}" if self.memory.budget_gib is not None else ""
            rows.append(("memory", f"~{self.memory.total_gib:.1f}{budget} GiB", r.get("memory", "")))
        return rows

    def checkpointing_text(self) -> str:
        if not self.gradient_checkpointing:
            return "off"
        if self.checkpoint_every > 1:
            return f"every {self.checkpoint_every} layers"
        return "on, offloaded to host memory" if self.offload_activations else "on"

    def one_line(self) -> str:
        """Batch, checkpointing and memory in one line (what a replan may change)."""
        memory = f", ~{self.memory.total_gib:.1f} GiB" if self.memory is not None else ""
        return (f"{self.micro_batch} x {self.grad_accum} rows per step, checkpointing {self.checkpointing_text()}, "
                f"max_length {self.max_length}{memory}")

    def table(self) -> str:
        """The plan as a short plain-text table, then its warnings."""
        rows = [("choice", "value", "why"), *self.rows()]
        w0 = max(len(a) for a, _, _ in rows)
        w1 = max(len(b) for _, b, _ in rows)
        lines = [f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows]
        lines.insert(1, f"{'-' * w0}  {'-' * w1}  {'-' * 3}")
        lines += [f"WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_html_(self) -> str:
        cells = "".join(f"<tr><td><b>{html.escape(a)}</b></td><td><code>{html.escape(b)}</code></td>"
                        f"<td style='text-align:left'>{html.escape(c)}</td></tr>" for a, b, c in self.rows())
        warnings = "".join(f"<p style='color:#b45309'><b>Warning:</b> {html.escape(w)}</p>" for w in self.warnings)
        return (f"<table><thead><tr><th>choice</th><th>value</th><th style='text-align:left'>why</th></tr></thead>"
                f"<tbody>{cells}</tbody></table>{warnings}")

    def to_dict(self) -> dict:
        data = {k: v for k, v in asdict(self).items() if k != "memory"}
        data["load_dtype"] = self.load_dtype
        data["rows_per_step"] = self.rows_per_step
        data["memory"] = self.memory.to_dict() if self.memory is not None else None
        return data


def check_gpus_supported(hardware: Hardware) -> None:
    """Refuse a GPU the installed torch has no kernels for (Kaggle's P100 is sm_60; current wheels start at sm_75)."""
    for gpu in hardware.gpus:
        if hardware.built_for(gpu) is False:
            built = [divmod(int(m.group(1)), 10) for a in hardware.arch_list
                     if (m := re.fullmatch(r"sm_(\d+)[a-z]?", a))]
            minimum = f" (compute capability {min(built)[0]}.{min(built)[1]} or newer)" if built else ""
            raise FreetuneError(
                f"This GPU, {gpu.name} (compute capability {gpu.capability[0]}.{gpu.capability[1]}, {gpu.sm}), "
                f"is too old for the installed PyTorch {hardware.torch}, which was built for "
                f"{', '.join(hardware.arch_list)}: nothing can train on it. Pick a supported GPU{minimum} "
                f"instead: {SUPPORTED_GPU_ADVICE}.")


def choose_policy(hardware: Hardware, force_policy: str | None) -> tuple[str, str, list[str]]:
    """('turing' | 'ampere' | 'cpu', why, warnings). The why is the compute dtype's reason."""
    if not hardware.gpus:
        warnings = ([f"precision forced to the {force_policy} policy, but there is no GPU: fp32 on the CPU"]
                    if force_policy else [])
        return "cpu", "no GPU: fp32 on the CPU (16-bit math there is slow or unsupported); for checks and smoke runs", \
            warnings
    slowest = min(hardware.gpus, key=lambda g: g.capability)
    if force_policy == "turing":
        return "turing", f"forced (precision='fp16'): the T4 policy, fp16, on {slowest.name}", []
    if force_policy == "ampere":
        if slowest.capability < (8, 0) or not hardware.bf16_supported:
            return "ampere", f"forced (precision='bf16') on {slowest.name}", [
                f"bf16 forced on {slowest.name} ({slowest.sm}), which has no native bf16: expect slow or failing "
                f"kernels. Use precision='auto' (fp16) on this GPU"]
        return "ampere", f"forced (precision='bf16') on {slowest.name}", []
    if slowest.capability >= (8, 0) and hardware.bf16_supported:
        return "ampere", f"{slowest.name} is {slowest.sm} (Ampere or newer): bf16, fp32's range at 16-bit cost", []
    if slowest.capability >= (8, 0):
        return "turing", f"{slowest.name} is {slowest.sm} but this torch reports no bf16 on it: fp16", []
    return "turing", f"{slowest.name} is {slowest.sm} (Turing or older): fp16 tensor cores, no fast bf16", []


def choose_precision(policy: str) -> tuple[str, str, dict]:
    """(compute dtype, mixed precision mode, reasons for the weights' dtypes) for a policy."""
    if policy == "cpu":
        return "float32", "no", {
            "mixed_precision": "no autocast on the CPU",
            "load_dtype": "fp32 like the compute",
            "lora_dtype": "fp32"}
    if policy == "turing":
        return "float16", "fp16", {
            "mixed_precision": "fp16 autocast with loss scaling (GradScaler)",
            "load_dtype": "fp16 even if the checkpoint says bfloat16: bf16 tensors on the fp16 path fail with "
                          "'_amp_foreach_non_finite_check_and_unscale_cuda' not implemented for 'BFloat16'",
            "lora_dtype": "fp32 (peft autocast_adapter_dtype): the GradScaler cannot unscale fp16 gradients, "
                          "and fp16 weights lose small updates"}
    return "bfloat16", "bf16", {
        "mixed_precision": "bf16 autocast; no loss scaling needed",
        "load_dtype": "bf16, the dtype the compute runs in",
        "lora_dtype": "fp32 (peft autocast_adapter_dtype): bf16 weights lose small updates"}


def choose_attention(hardware: Hardware, policy: str) -> tuple[str, str]:
    """(attn_implementation, why): sdpa by default, FlashAttention 2 where installed and sm80+, eager only if
    torch has no sdpa."""
    if not hardware.sdpa:
        return "eager", "this torch has no scaled_dot_product_attention (torch < 2.0): eager"
    if (policy == "ampere" and hardware.flash_attn and hardware.gpus
            and all(g.capability >= (8, 0) for g in hardware.gpus)):
        return "flash_attention_2", "flash-attn is installed and every GPU is sm80+: FlashAttention 2"
    if policy == "turing":
        return "sdpa", "PyTorch's fused attention (memory-efficient kernel on Turing); never the seq x seq matrix"
    if policy == "ampere":
        why = "PyTorch's fused attention (FlashAttention kernel on sm80+)"
        return "sdpa", why + ("; pip install flash-attn to use FlashAttention 2 directly" if not hardware.flash_attn
                              else "")
    return "sdpa", "PyTorch's fused attention, which also runs on a CPU"


def choose_layout(hardware: Hardware) -> tuple[str, int, str]:
    """(layout, world_size, why)."""
    if not hardware.gpus:
        return "cpu", 1, "no GPU"
    n = hardware.torchrun_world_size or hardware.gpu_count
    if n == 1:
        extra = (f" (torchrun started 1 process; {hardware.gpu_count} GPUs visible)"
                 if hardware.gpu_count > 1 else "")
        return "single", 1, "one GPU" + extra
    return "ddp", n, (f"{n} GPUs: DDP, one full model copy per GPU, through torchrun --nproc_per_node={n}; one "
                      f"process seeing {n} GPUs would make the Trainer use nn.DataParallel, which SFTTrainer refuses")


def _resolve_policy(force_policy: str | None, precision: str) -> str | None:
    from_precision = {"auto": None, "fp16": "turing", "bf16": "ampere"}
    if precision not in from_precision:
        raise FreetuneError(f"precision must be 'auto', 'fp16' or 'bf16', not {precision!r}.")
    if force_policy is not None and force_policy not in POLICIES:
        raise FreetuneError(f"force_policy must be one of {POLICIES} or None, not {force_policy!r}.")
    wanted = from_precision[precision]
    if force_policy and wanted and force_policy != wanted:
        raise FreetuneError(f"force_policy={force_policy!r} contradicts precision={precision!r}: give one of them.")
    return force_policy or wanted


def _resolve_shape(model_shape) -> ModelShape | None:
    if model_shape is None or isinstance(model_shape, ModelShape):
        return model_shape
    try:
        return ModelShape.named(str(model_shape))
    except KeyError:
        return None  # an unknown hub id: the plan still decides precision and layout, without a memory check


def make_plan(hardware: Hardware | None = None, *, model_shape: ModelShape | str | None = None,
              max_length: int = 1024, micro_batch: int | None = None, grad_accum: int = 8, lora_rank: int = 16,
              lora_targets: str | list[str] = "all-linear", gradient_checkpointing: bool | str = "auto",
              optimizer: str = "auto", force_policy: str | None = None, precision: str = "auto",
              memory_budget_gib: float | None = None, loss_head: str = "chunked", layout: str = "auto",
              compile: str = "auto", longest_row: int | None = None) -> Plan:
    """Decide the training plan for this machine (read now unless `hardware` is given), each choice with its reason.

    model_shape: a ModelShape, a known name or hub id ('Qwen/Qwen2.5-Coder-1.5B-Instruct'), or a local model
        folder; with it the plan sizes the batch to the GPU's memory. Unknown names skip the memory check.
    micro_batch: None or 0 lets the plan choose: the largest power of two that fits, splitting the
        grad_accum rows per optimizer step into micro-batches (1 x 8 becomes 8 x 1 where memory allows: the
        same rows per step, several times the tokens per second). A number is kept, and warned about if it
        does not fit.
    gradient_checkpointing: "on" / "off" (or True / False), or "auto": off when the whole micro-batch fits the
        memory budget without it (it recomputes every layer's forward in the backward, ~30% of a step), else on.
    optimizer: a Trainer `optim` name, or "auto": on a GPU fused AdamW (fp32 state, one launch for all LoRA
        weights) when its state is a small share of the memory, else paged 8-bit AdamW (a quarter of the state,
        but one launch and a few Python calls per LoRA tensor: ~30-45 ms per step for 392 tensors on an H200).
    force_policy / precision: 'turing' / 'fp16' or 'ampere' / 'bf16' overrides the detected GPU (benchmarks,
        the T4 path checked on a bigger GPU).
    memory_budget_gib: plan for this much GPU memory instead of the card's (e.g. a 4 GiB card emulated with
        torch.cuda.set_per_process_memory_fraction).
    layout: "auto" chooses from the machine and the memory estimate: one GPU -> single; several GPUs -> DDP when
        one full 4-bit copy (with one row of max_length) fits each GPU, else FSDP (the weights, gradients and
        optimizer state sharded over the GPUs). "single", "ddp" or "fsdp" forces that choice.
    compile: "auto" (on a GPU, not under FSDP), "on" or "off": torch.compile each decoder layer
        (freetune.kernels.compile_layers).
    longest_row: tokens of the data's longest row (freetune.audit counts them): the batch is sized for rows that
        long, not for max_length (`replan` re-makes a plan with it once the data is audited).
    Raises FreetuneError for a GPU the installed torch cannot run, before anything is loaded.
    """
    asked_for = {k: v for k, v in locals().items() if k != "hardware"}
    hardware = hardware if hardware is not None else read_hardware()
    check_gpus_supported(hardware)
    policy, reasons_compute, warnings = choose_policy(hardware, _resolve_policy(force_policy, precision))
    compute_dtype, mixed, reasons = choose_precision(policy)
    reasons["compute_dtype"] = reasons_compute
    frozen_dtype, reasons["frozen_dtype"] = choose_frozen_dtype(policy, compute_dtype)
    attention, reasons["attention"] = choose_attention(hardware, policy)
    if layout not in LAYOUTS:
        raise FreetuneError(f"layout must be one of {LAYOUTS}, not {layout!r}.")
    auto_layout, world_size, reasons["layout"] = choose_layout(hardware)
    device = "cpu" if policy == "cpu" else "cuda"
    asked = layout
    if layout == "auto" or device == "cpu" and layout != "fsdp":
        layout = auto_layout
    elif layout != auto_layout:
        reasons["layout"] = (f"{layout} as asked (layout={layout!r}), over {world_size} process(es)" if layout != "single"
                             else "single as asked (layout='single'): one process on one GPU")
        if layout == "single":
            world_size = 1
    machine = hardware.summary()
    built = {g.sm for g in hardware.gpus}
    reasons["machine"] = (f"torch {hardware.torch or '?'}" + (f", CUDA {hardware.cuda}" if hardware.cuda else "")
                          + (f", built for {', '.join(sorted(built))}" if built and hardware.arch_list else ""))

    micro_batch = micro_batch or None
    rows_per_gpu_step = (micro_batch or 1) * grad_accum
    # A recipe parameter is a string ("auto" / "on" / "off": papermill cannot read a `bool | str` annotation);
    # library callers may pass a bool.
    choices = {"auto": None, None: None, "on": True, True: True, "off": False, False: False}
    if gradient_checkpointing not in choices:
        raise FreetuneError(f"gradient_checkpointing = {gradient_checkpointing!r}: use 'auto' (on unless the batch fits "
                            f"without it), 'on' or 'off'.")
    checkpointing_auto = choices[gradient_checkpointing] is None
    gradient_checkpointing = True if checkpointing_auto else choices[gradient_checkpointing]
    reasons["gradient_checkpointing"] = "as given" if not checkpointing_auto else (
        "on: no model shape to check the memory against, so the safe side")
    shape = _resolve_shape(model_shape)
    if model_shape is not None and shape is None:
        warnings.append(f"no known shape for {model_shape!r}: the memory check is skipped. Pass model_shape as a "
                        f"local folder or a freetune.memory.ModelShape to size the batch")
    if device == "cuda":
        budget = memory_budget_gib or min(g.memory_gib for g in hardware.gpus)
        budget_why = "set by memory_budget_gib" if memory_budget_gib else "the smallest GPU's memory"
    else:
        budget = memory_budget_gib or hardware.ram_available_gib or hardware.ram_total_gib
        budget_why = "set by memory_budget_gib" if memory_budget_gib else "the CPU RAM available"
    optimizer, reasons["optimizer"] = choose_optimizer(optimizer, device, shape, budget, lora_rank, lora_targets)

    from freetune.kernels import choose_compile, choose_lora_kernel

    # Chosen before the memory check (the fused layers keep fp32 absmax values, compiled layers save less) and again
    # below if FSDP takes over.
    lora_kernel, reasons["lora_kernel"] = choose_lora_kernel(device, layout)
    compiled, reasons["compile"] = choose_compile(compile, device, layout)
    memory = None
    # The memory is sized for rows as long as the data's longest (the audit counts them; replan passes it), not for
    # max_length: short rows (an SVG set's ~150 tokens) would otherwise be planned as 1,024 each.
    sized = min(max_length, longest_row) if longest_row else max_length
    chosen_batch, chosen_length = micro_batch or 1, sized
    warnings_before_memory = len(warnings)
    if shape is not None and budget:
        common = dict(lora_rank=lora_rank, lora_targets=lora_targets, gradient_checkpointing=gradient_checkpointing,
                      optimizer=optimizer, compute_dtype=compute_dtype, device=device, world_size=world_size,
                      loss_head=loss_head, lora_kernel=lora_kernel, frozen_dtype=frozen_dtype, compiled=compiled)
        # Powers of two that divide the rows per step, so the accumulation stays a whole number.
        cap = max(b for b in (1, 2, 4, 8, 16) if rows_per_gpu_step % b == 0)
        if checkpointing_auto:
            # A full micro-batch without recompute beats a bigger one with it only if it fits whole: batch size
            # is worth more tokens/s than the ~30% the recompute costs, so checkpointing goes only when both hold.
            whole = micro_batch or cap
            bare = estimate(shape, max_length=sized, micro_batch=whole,
                            **{**common, "gradient_checkpointing": False})
            bare.budget_gib = budget
            gradient_checkpointing = not bare.fits
            common["gradient_checkpointing"] = gradient_checkpointing
            reasons["gradient_checkpointing"] = (
                f"on: without it {whole} x {sized} tokens would need ~{bare.total_gib:.1f} of {budget:.1f} GiB"
                if gradient_checkpointing else
                f"off: {whole} x {sized} tokens fit without it (~{bare.total_gib:.1f} of {budget:.1f} GiB), "
                f"which saves recomputing every layer in the backward (~30% of a step)")
            if gradient_checkpointing and device == "cuda" and layout != "fsdp":
                every, why = choose_checkpoint_every(shape, budget, sized, whole, common)
                if every > 1:
                    common["checkpoint_every"] = every
                    reasons["gradient_checkpointing"] = why
        if gradient_checkpointing and device == "cuda" and layout != "fsdp" and common.get("checkpoint_every", 1) == 1:
            offload, reasons["offload"] = choose_offload(shape, budget, sized, micro_batch or cap, common)
            common["offload_activations"] = offload
        if micro_batch is None:
            chosen_batch, chosen_length, memory, why = fit(shape, budget, max_length=sized,
                                                           max_micro_batch=cap, **common)
            reasons["batch"] = f"{shape.name}: {why}" + (
                f" (the data's longest row; rows are cut at max_length {max_length})" if sized < max_length else "")
            if not memory.fits:
                warnings.append(f"{shape.name} {why}")
            elif chosen_length < sized:
                warnings.append(f"max_length lowered from {max_length} to {chosen_length} so that one row fits "
                                f"in {budget:.1f} GiB: longer rows are cut")
        else:
            fitted_batch, fitted_length, _, _ = fit(shape, budget, max_length=sized,
                                                    max_micro_batch=micro_batch, **common)
            memory = estimate(shape, max_length=sized, micro_batch=micro_batch, **common)
            memory.budget_gib = budget
            reasons["batch"] = f"micro_batch {micro_batch} as given; ~{memory.total_gib:.1f} GiB for {shape.name}"
            if not memory.fits:
                advice = (f"use micro_batch={fitted_batch} with grad_accum={rows_per_gpu_step // fitted_batch} "
                          f"(same rows per step)" if fitted_length == sized and fitted_batch < micro_batch
                          else "lower max_length or lora_rank, or pick a smaller model or a bigger GPU")
                warnings.append(f"micro_batch {micro_batch} x {sized} tokens needs ~{memory.total_gib:.1f} GiB "
                                f"({memory.breakdown()}), more than {budget:.1f} GiB: {advice}")
        # DDP needs one full 4-bit copy per GPU plus one row of max_length; when even that does not fit and
        # there are several GPUs, shard the model over them instead (FSDP): each holds 1/N of the weights, the
        # LoRA gradients and the optimizer state.
        one_row = estimate(shape, max_length=sized, micro_batch=1, **common)
        one_row.budget_gib = budget
        if layout == "fsdp" or (asked == "auto" and layout == "ddp" and world_size > 1 and not one_row.fits):
            common["shards"] = max(world_size, 1)
            common["offload_activations"] = False  # FSDP's own path; not combined with TRL's offloading here
            common["compiled"] = False  # FSDP runs eagerly (kernels.choose_compile)
            del warnings[warnings_before_memory:]  # they were about the unsharded layout
            if micro_batch is None:
                chosen_batch, chosen_length, memory, why = fit(shape, budget, max_length=sized,
                                                               max_micro_batch=cap, **common)
            else:
                memory = estimate(shape, max_length=sized, micro_batch=micro_batch, **common)
                memory.budget_gib = budget
                why = f"micro_batch {micro_batch} as given; ~{memory.total_gib:.1f} of {budget:.1f} GiB"
            reasons["batch"] = f"{shape.name} sharded over {world_size} GPU(s): {why}"
            if layout != "fsdp":
                reasons["layout"] = (f"{world_size} GPUs: FSDP, because one full copy per GPU (DDP) needs "
                                     f"~{one_row.total_gib:.1f} GiB for one row of {sized} tokens, more than "
                                     f"{budget:.1f} GiB; sharded over {world_size}, ~{memory.total_gib:.1f} GiB each. "
                                     f"torchrun --nproc_per_node={world_size}, wrapped per decoder layer")
                layout = "fsdp"
            if not memory.fits:
                warnings.append(f"{shape.name} does not fit even sharded over {world_size} GPU(s): {why}")
        reasons["memory"] = f"{budget_why}; {memory.breakdown()}"
    else:
        reasons["batch"] = ("as given" if micro_batch else "1 (no model shape to size it against: give "
                            "model_shape to let the plan choose)")
    grad_accum_out = max(1, rows_per_gpu_step // chosen_batch)
    from freetune.fast import VARLEN_ATTENTION, VARLEN_KERNEL_NAMES, choose_batching, choose_sampler, varlen_backend

    batching, batch_attention, reasons["batching"] = choose_batching(
        policy, [g.capability for g in hardware.gpus], chosen_batch)
    # Processes, not GPUs: a CPU job under torchrun has several ranks too.
    sampler, reasons["sampler"] = choose_sampler(batching, max(world_size, hardware.torchrun_world_size or 1))
    if batch_attention == VARLEN_ATTENTION:
        attention = VARLEN_ATTENTION
        reasons["attention"] = (f"padding-free rows through PyTorch's variable-length "
                                f"{VARLEN_KERNEL_NAMES.get(varlen_backend(), 'attention')} kernel (freetune.fast); "
                                f"anything else through sdpa")
    if world_size > 1:
        reasons["batch"] += f"; {world_size} GPUs x {chosen_batch} x {grad_accum_out} rows per optimizer step"
    chosen_length = max_length if chosen_length >= sized else chosen_length  # lowered only when a row did not fit
    reasons["max_length"] = ("as given" if chosen_length == max_length else f"lowered from {max_length} to fit")
    warnings += _disk_warnings(hardware, shape)
    lora_kernel, reasons["lora_kernel"] = choose_lora_kernel(device, layout)
    compiled, reasons["compile"] = choose_compile(compile, device, layout)

    offload = bool(memory is not None and memory.settings.get("offload_activations") and gradient_checkpointing)
    if offload:
        reasons["gradient_checkpointing"] += f"; {reasons['offload']}"
    return Plan(device=device, compute_dtype=compute_dtype, mixed_precision=mixed, attn_implementation=attention,
                reasons=reasons, layout=layout, world_size=world_size, micro_batch=chosen_batch,
                grad_accum=grad_accum_out, max_length=chosen_length, lora_dtype="float32", policy=policy,
                memory=memory, machine=machine, warnings=warnings, batching=batching, sampler=sampler,
                gradient_checkpointing=gradient_checkpointing, lora_kernel=lora_kernel, optimizer=optimizer,
                compile=compiled, frozen_dtype=frozen_dtype, offload_activations=offload,
                checkpoint_every=memory.settings.get("checkpoint_every", 1) if memory is not None else 1,
                asked=asked_for)


def replan(plan: Plan, hardware: Hardware | None = None, **changes) -> Plan:
    """The plan make_plan gives for the same arguments with `changes` (e.g. the data's longest_row once the audit has
    counted it), on this machine (read now unless `hardware` is given)."""
    changes = {k: v for k, v in changes.items() if v is not None}  # None: not known (e.g. no tokenizer counted)
    if not changes or not plan.asked:  # nothing new, or a plan made by hand (no arguments to replan from)
        return plan
    asked = {**plan.asked, **changes}
    if isinstance(asked.get("model_shape"), dict):  # a plan read back from a job file (dataclasses.asdict)
        asked["model_shape"] = ModelShape(**asked["model_shape"])
    return make_plan(hardware, **asked)


def choose_frozen_dtype(policy: str, compute_dtype: str) -> tuple[str, str]:
    """(dtype of the frozen non-4-bit weights, why)."""
    if policy == "cpu":
        return "float32", "a CPU run is a check: fp32 as peft's prepare_model_for_kbit_training leaves them"
    return compute_dtype, (f"the frozen embeddings, norms and head stay {compute_dtype}, as loaded: nothing trains "
                           f"them, so peft's fp32 upcast would only double their memory and that of the residual "
                           f"stream every layer saves")


# Partial checkpointing keeps every other layer's activations, sized from an estimate: it must fit with this margin.
PARTIAL_CHECKPOINT_MARGIN = 1.10


def choose_checkpoint_every(shape, budget_gib: float, max_length: int, micro_batch: int,
                            common: dict) -> tuple[int, str]:
    """(n, why): checkpoint only every n-th decoder layer (transformers' every_n_layers), the largest n whose estimate
    fits the budget with PARTIAL_CHECKPOINT_MARGIN to spare; 1 (every layer) when none does. The layers left out keep
    their activations and skip the recompute: memory the card has spare, spent on speed."""
    settings = {**common, "gradient_checkpointing": True}
    for every in (8, 4, 3, 2):
        est = estimate(shape, max_length=max_length, micro_batch=micro_batch, **settings, checkpoint_every=every)
        if est.total_gib * PARTIAL_CHECKPOINT_MARGIN <= budget_gib:
            checkpointed = -(-shape.layers // every)
            return every, (f"on for {checkpointed} of {shape.layers} layers (every {every}): all of them off would "
                           f"need more than {budget_gib:.1f} GiB; this way ~{est.total_gib:.1f} GiB, and only "
                           f"those layers are recomputed in the backward")
    return 1, ""


# Checkpointed layers' inputs are offloaded to host memory when they take more than this share of the memory budget.
OFFLOAD_MIN_SHARE = 0.10


def choose_offload(shape, budget_gib: float, max_length: int, micro_batch: int, common: dict) -> tuple[bool, str]:
    """(offload the checkpointed layers' inputs to pinned host memory?, why). The copies overlap with the layers'
    compute (TRL's activation offloading, on a stream of its own); worth it when those inputs are a real share of
    the budget: what they free goes to a larger micro-batch, longer rows, or headroom on a small card."""
    settings = {**common, "gradient_checkpointing": True}
    kept = estimate(shape, max_length=max_length, micro_batch=micro_batch, **settings)
    offloaded = estimate(shape, max_length=max_length, micro_batch=micro_batch,
                         **{**settings, "offload_activations": True})
    freed = kept.activations_gib - offloaded.activations_gib
    if freed > OFFLOAD_MIN_SHARE * budget_gib:
        return True, (f"the layers' saved inputs ({freed:.2f} GiB at {micro_batch} x {max_length} tokens) wait in "
                      f"pinned host memory until their backward, copied alongside the compute")
    return False, (f"the layers' saved inputs stay on the GPU ({freed:.2f} GiB, under {OFFLOAD_MIN_SHARE:.0%} of "
                   f"{budget_gib:.1f} GiB)")


# Fused AdamW's fp32 state (8 bytes per LoRA weight, 2 for paged 8-bit) is taken when the difference stays under
# this share of the GPU memory budget.
FUSED_ADAMW_MAX_SHARE = 0.02


def choose_optimizer(optimizer: str, device: str, shape, budget_gib: float | None, lora_rank: int,
                     lora_targets) -> tuple[str, str]:
    """(Trainer optim name, why)."""
    if device == "cpu" and ("8bit" in optimizer or "paged" in optimizer or optimizer == "auto"):
        # bitsandbytes' 8-bit optimisers need CUDA; the CPU run uses plain AdamW.
        return "adamw_torch", "a CPU run: PyTorch's AdamW (bitsandbytes' 8-bit optimizers need CUDA)"
    if optimizer != "auto":
        return optimizer, "as given"
    if shape is None or not budget_gib:
        return "paged_adamw_8bit", "paged 8-bit AdamW: no model shape to size the fp32 state against"
    extra_gib = shape.lora_params(lora_rank, lora_targets) * 6 / 2**30
    if extra_gib <= FUSED_ADAMW_MAX_SHARE * budget_gib:
        return "adamw_torch_fused", (f"fused AdamW: one launch updates every LoRA weight (8-bit AdamW launches per "
                                     f"tensor); its fp32 state costs {extra_gib * 1024:.0f} MiB more, "
                                     f"<= {FUSED_ADAMW_MAX_SHARE:.0%} of {budget_gib:.1f} GiB")
    return "paged_adamw_8bit", (f"paged 8-bit AdamW: fp32 state would cost {extra_gib * 1024:.0f} MiB more, over "
                                f"{FUSED_ADAMW_MAX_SHARE:.0%} of {budget_gib:.1f} GiB")


def _disk_warnings(hardware: Hardware, shape: ModelShape | None) -> list[str]:
    # Checkpoints are small (the adapter and its optimizer state); the merged export writes the whole model in
    # 16 bits, which is what needs the room.
    need = MIN_FREE_DISK_GIB + (shape.total_params * 2 / GIB if shape is not None else 0)
    return [f"only {free:.1f} GiB free in {folder}: checkpoints and the merged 16-bit export need ~{need:.1f} GiB. "
            f"Free some space or point output_dir elsewhere"
            for folder, free in hardware.disk_free_gib.items() if free < need]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freetune.preflight",
                                     description="Report this machine and the training plan freetune would use.")
    parser.add_argument("--json", action="store_true", help="print the hardware and plan as JSON")
    parser.add_argument("--work-dir", default=".", help="working folder (free disk is reported for it)")
    parser.add_argument("--checkpoint-dir", default=".", help="checkpoint folder (free disk is reported for it)")
    parser.add_argument("--model-shape", default=None,
                        help="size the batch for this model: a known name (qwen2.5-1.5b, qwen2.5-coder-1.5b, "
                             "qwen3-8b, tinyllama-1.1b), a hub id of one, or a local model folder")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per row")
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per forward pass (0: choose)")
    parser.add_argument("--grad-accum", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp16", "bf16"])
    parser.add_argument("--budget-gib", type=float, default=None, help="plan for this much GPU memory")
    args = parser.parse_args(argv)

    hardware = read_hardware(args.work_dir, args.checkpoint_dir)
    try:
        plan = make_plan(hardware, model_shape=args.model_shape, max_length=args.max_length,
                         micro_batch=args.micro_batch, grad_accum=args.grad_accum, lora_rank=args.lora_rank,
                         precision=args.precision, memory_budget_gib=args.budget_gib)
    except FreetuneError as exc:
        if args.json:
            print(json.dumps({"hardware": hardware.to_dict(), "error": str(exc)}, indent=2))
        print(f"preflight refused: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "plan": plan.to_dict()}, indent=2))
    else:
        print(hardware.report())
        print()
        print(plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
