"""Preflight: read the machine before anything loads, and decide the training plan with a reason for each choice.

Most failed free-tier runs die of the machine, not the model: a P100 that current PyTorch cannot use, bf16
asked of a T4, a batch that does not fit. `read_hardware()` reports what is there; `make_plan()` turns it into
decisions (precision, attention, single GPU or DDP, micro-batch and max_length) and refuses a GPU the installed
PyTorch cannot run, before a model is downloaded. The plan shows itself as a table in a notebook.

    python -m freetune.preflight [--json] [--model-shape qwen2.5-1.5b] [--max-length 1024]

Every decision is one function of freetune.choices, which returns the value and the reason the table shows;
make_plan calls them in order as short steps. `for_world` re-decides what depends on the job's size (torchrun's
processes, several hosts) once the job is launched; `replan` re-makes the plan once the data's longest row is known.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace

from freetune import resources
from freetune.choices import (GRAPHS_LOSS_TILE_TOKENS, choose_attention, choose_batching, choose_budget,
                              choose_checkpoint_every, choose_checkpointing, choose_compile, choose_cuda_graphs,
                              choose_embeddings, choose_frozen_dtype, graph_tokens,
                              choose_layout, choose_lora_kernel, choose_loss_tile, choose_mlp_kernel, choose_offload,
                              choose_optimizer, choose_policy, choose_precision, choose_sampler, choose_shape,
                              resolve_policy, varlen_attention_reason)
from freetune.errors import FreetuneError
from freetune.hardware import GPU, Hardware
from freetune.memory import GIB, MemoryEstimate, ModelShape, estimate, fit
from freetune.speed.attention import VARLEN_ATTENTION

# What to pick instead of a GPU the installed PyTorch cannot run, where people meet one (Kaggle's P100).
SUPPORTED_GPU_ADVICE = ('on Kaggle, Settings -> Accelerator -> "GPU T4 x2"; '
                        'on Colab, Runtime -> Change runtime type -> T4 GPU')
# Below these, a run has no room for checkpoints, or for the merged 16-bit model at export.
MIN_FREE_DISK_GIB = 2.0


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
    batching: str = "padded"    # "padding_free" | "grouped" | "padded" (freetune.batching)
    sampler: str = "random"     # "random" | "length_grouped" | "rank_balanced": rows per rank and micro-batch
    gradient_checkpointing: bool = True  # recompute activations in the backward (chosen by memory when "auto")
    lora_kernel: str = "peft"   # "fused" (freetune.kernels: one autograd node per 4-bit LoRA layer) | "peft"
    optimizer: str = "paged_adamw_8bit"  # the Trainer's `optim` (chosen by memory when "auto")
    compile: bool = False       # torch.compile each decoder layer (freetune.kernels.compile_layers)
    frozen_dtype: str = "float32"  # the frozen non-4-bit weights (embeddings, norms, lm_head) and residual stream
    offload_activations: bool = False  # checkpointed layers' inputs kept in pinned host memory, not on the GPU
    loss_tile_tokens: int = 0   # tokens per tile of TRL's chunked loss head (0: TRL's own, 4,096; choose_loss_tile)
    checkpoint_every: int = 1   # with checkpointing on, every n-th decoder layer is checkpointed (1: all of them)
    # "traced" (freetune.fused_mlp: the SwiGLU MLP as one autograd node, gate and up recomputed in its backward) |
    # "chunked" (the same as one op over token chunks) | "layers" (each projection on its own)
    mlp_kernel: str = "layers"
    embeddings_on_host: bool = False  # the input embedding table in host RAM while training (freetune.host_embeddings)
    # > 0: the checkpointed layers' forward and backward replayed as CUDA graphs, padding-free batches padded to a
    # multiple of this many tokens (freetune.graphed_layers); 0: off
    cuda_graph_tokens: int = 0
    model: str = ""             # the model the plan is for, as its config.json describes it
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
            *([("model", self.model, r.get("model", ""))] if self.model else []),
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
            ("MLP kernel", self.mlp_kernel, r.get("mlp_kernel", "")),
            ("input embeddings", "host RAM" if self.embeddings_on_host else "GPU" if self.device == "cuda" else
             "with the model", r.get("embeddings", "")),
            ("optimizer", self.optimizer, r.get("optimizer", "")),
            ("compile", "per decoder layer" if self.compile else "off", r.get("compile", "")),
            ("CUDA graphs", f"per layer, batches in multiples of {self.cuda_graph_tokens} tokens"
             if self.cuda_graph_tokens else "off", r.get("cuda_graphs", "")),
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


@dataclass
class _Sizing:
    """What make_plan's memory steps share: the asks they size against, and freetune.memory.estimate's settings."""

    shape: ModelShape | None
    micro_batch: int | None   # as asked; None: the plan chooses
    rows_per_gpu_step: int
    max_length: int           # as asked
    sized: int                # the row length the memory is sized for: the data's longest row, at most max_length
    budget: float | None
    budget_why: str
    checkpointing_auto: bool
    layout_asked: str
    common: dict = field(default_factory=dict)
    # The largest power of two that divides the rows per step, so the accumulation stays a whole number.
    cap: int = 1


def make_plan(hardware: Hardware | None = None, *, model_shape: ModelShape | str | None = None,
              max_length: int = 1024, micro_batch: int | None = None, grad_accum: int = 8, lora_rank: int = 16,
              lora_targets: str | list[str] = "all-linear", gradient_checkpointing: bool | str = "auto",
              optimizer: str = "auto", force_policy: str | None = None, precision: str = "auto",
              memory_budget_gib: float | None = None, loss_head: str = "chunked", layout: str = "auto",
              compile: str = "auto", longest_row: int | None = None, lora_dropout: float = 0.0) -> Plan:
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
    lora_dropout: the LoRA dropout the run will use; CUDA graphs (freetune.graphed_layers) need 0.
    Raises FreetuneError for a GPU the installed torch cannot run, before anything is loaded.
    """
    asked_for = {k: v for k, v in locals().items() if k != "hardware"}
    hardware = hardware if hardware is not None else read_hardware()
    check_gpus_supported(hardware)
    shape, shape_why = choose_shape(model_shape)
    check_lora_fits_architecture(shape, lora_dropout)
    plan = _precision_step(hardware, force_policy, precision, shape)
    plan.reasons["model"] = shape_why
    plan.model = shape.describe() if shape is not None else f"{model_shape} (shape unknown)" if model_shape else ""
    _layout_step(plan, hardware, layout)
    on, plan.reasons["gradient_checkpointing"] = choose_checkpointing(gradient_checkpointing)
    plan.gradient_checkpointing = True if on is None else on
    if model_shape is not None and shape is None:
        plan.warnings.append(f"no shape for {model_shape!r}: {shape_why}. The memory check is skipped (batch 1, "
                             f"checkpointing on). Run where the Hub is reachable, or set model_id to a local folder "
                             f"with the model's config.json, to size the batch")
    budget, budget_why = choose_budget(hardware, plan.device, memory_budget_gib)
    plan.optimizer, plan.reasons["optimizer"] = choose_optimizer(optimizer, plan.device, shape, budget, lora_rank,
                                                                 lora_targets)
    # Chosen before the memory check (fused and compiled layers change the absmax bytes and what is saved) and again
    # at the end, in case FSDP took over.
    _kernels_step(plan, compile, shape)
    micro_batch = micro_batch or None
    # The memory is sized for rows as long as the data's longest (the audit counts them; replan passes it), not for
    # max_length: short rows (an SVG set's ~150 tokens) would otherwise be planned as 1,024 each.
    sizing = _Sizing(shape=shape, micro_batch=micro_batch, rows_per_gpu_step=(micro_batch or 1) * grad_accum,
                     max_length=max_length, sized=min(max_length, longest_row) if longest_row else max_length,
                     budget=budget, budget_why=budget_why, checkpointing_auto=on is None, layout_asked=layout)
    plan.micro_batch, plan.max_length = micro_batch or 1, sizing.sized
    if shape is not None and budget:
        # CUDA graphs need padding-free rows: asked now (the probe's answer is kept), the batching is chosen later.
        padding_free = choose_batching(plan.policy, [g.capability for g in hardware.gpus], 2, shape,
                                       sizing.sized)[0] == "padding_free"
        _memory_step(plan, sizing, lora_rank=lora_rank, lora_targets=lora_targets, loss_head=loss_head,
                     lora_dropout=lora_dropout if padding_free else None, optimizer_auto=optimizer == "auto")
    else:
        plan.reasons["batch"] = ("as given" if micro_batch else "1 (no model shape to size it against: give "
                                 "model_shape to let the plan choose)")
    _batching_step(plan, hardware, sizing)
    _final_step(plan, hardware, sizing, compile)
    plan.asked = asked_for
    return plan


def check_lora_fits_architecture(shape: ModelShape | None, lora_dropout: float) -> None:
    """Refuse, before anything loads, LoRA settings peft cannot apply to this architecture."""
    if shape is not None and shape.experts and lora_dropout:
        raise FreetuneError(
            f"{shape.name} is a mixture of experts ({shape.experts} per layer): peft adapts its experts' weights "
            f"through its ParamWrapper, which takes no LoRA dropout (lora_dropout={lora_dropout:g}). "
            f"Set lora_dropout = 0.0")


def _precision_step(hardware: Hardware, force_policy: str | None, precision: str,
                    shape: ModelShape | None = None) -> Plan:
    """The precision policy (a T4's fp16, Ampere's bf16, a CPU's fp32) and the dtypes and attention it implies."""
    policy, compute_why, warnings = choose_policy(hardware, resolve_policy(force_policy, precision))
    compute_dtype, mixed, reasons = choose_precision(policy)
    reasons["compute_dtype"] = compute_why
    frozen_dtype, reasons["frozen_dtype"] = choose_frozen_dtype(policy, compute_dtype)
    attention, reasons["attention"] = choose_attention(hardware, policy, shape)
    return Plan(device="cpu" if policy == "cpu" else "cuda", compute_dtype=compute_dtype, mixed_precision=mixed,
                attn_implementation=attention, reasons=reasons, lora_dtype="float32", policy=policy,
                frozen_dtype=frozen_dtype, warnings=warnings)


def _layout_step(plan: Plan, hardware: Hardware, layout: str) -> None:
    """One process, DDP or FSDP (the memory step may still shard), and the machine the plan is for."""
    plan.layout, plan.world_size, plan.reasons["layout"] = choose_layout(hardware, layout, plan.device)
    plan.machine = hardware.summary()
    built = {g.sm for g in hardware.gpus}
    plan.reasons["machine"] = (f"torch {hardware.torch or '?'}" + (f", CUDA {hardware.cuda}" if hardware.cuda else "")
                               + (f", built for {', '.join(sorted(built))}" if built and hardware.arch_list else ""))


def _kernels_step(plan: Plan, compile: str, shape: ModelShape | None) -> None:
    plan.lora_kernel, plan.reasons["lora_kernel"] = choose_lora_kernel(plan.device, plan.layout)
    plan.compile, plan.reasons["compile"] = choose_compile(compile, plan.device, plan.layout, shape)


def _memory_step(plan: Plan, sizing: _Sizing, **lora) -> None:
    """Checkpointing (when "auto"), offloading, the micro-batch and max_length that fit; FSDP where DDP cannot."""
    sizing.common = dict(lora_rank=lora["lora_rank"], lora_targets=lora["lora_targets"],
                         gradient_checkpointing=plan.gradient_checkpointing, optimizer=plan.optimizer,
                         compute_dtype=plan.compute_dtype, device=plan.device, world_size=plan.world_size,
                         loss_head=lora["loss_head"], lora_kernel=plan.lora_kernel, frozen_dtype=plan.frozen_dtype,
                         compiled=plan.compile)
    sizing.cap = max(b for b in (1, 2, 4, 8, 16) if sizing.rows_per_gpu_step % b == 0)
    if sizing.checkpointing_auto:
        _checkpointing_by_memory(plan, sizing)
    common = sizing.common
    if (plan.gradient_checkpointing and plan.device == "cuda" and plan.layout != "fsdp"
            and common.get("checkpoint_every", 1) == 1):
        offload, plan.reasons["offload"] = choose_offload(sizing.shape, sizing.budget, sizing.sized,
                                                          sizing.micro_batch or sizing.cap, common)
        common["offload_activations"] = offload
    common["mlp_kernel"], plan.reasons["mlp_kernel"] = choose_mlp_kernel(sizing.shape, sizing.budget, sizing.sized,
                                                                         common)
    common["loss_tile_tokens"], plan.reasons["loss_tile"] = choose_loss_tile(common)
    common["embeddings_on_host"], plan.reasons["embeddings"] = choose_embeddings(sizing.shape, common, plan.layout)
    graphs, plan.reasons["cuda_graphs"] = choose_cuda_graphs(common, plan.layout, lora["lora_dropout"], sizing.shape)
    if graphs:
        common["cuda_graphs"] = True
        common["loss_tile_tokens"] = GRAPHS_LOSS_TILE_TOKENS
        plan.reasons["loss_tile"] = (f"{GRAPHS_LOSS_TILE_TOKENS:,} tokens per tile: the CUDA graphs' buffers are "
                                     f"paid for here")
        if lora["optimizer_auto"] and plan.optimizer == "adamw_torch_fused":
            plan.optimizer = common["optimizer"] = "adamw_8bit"
            plan.reasons["optimizer"] = ("8-bit AdamW: a quarter of fused AdamW's state, which pays for the CUDA "
                                         "graphs' buffers; its per-tensor launches run while the GPU works through "
                                         "the graphs")
    warnings_before = len(plan.warnings)
    _fit_batch(plan, sizing)
    _shard_if_needed(plan, sizing, warnings_before)
    _refuse_what_cannot_fit(plan, sizing)
    plan.reasons["memory"] = f"{sizing.budget_why}; {plan.memory.breakdown()}"


# The shortest rows a plan lowers max_length to before it calls a model too big (memory.fit's min_length).
SHORTEST_ROWS = 256


def _refuse_what_cannot_fit(plan: Plan, sizing: _Sizing) -> None:
    """Refuse, before any weights are downloaded, a model that cannot train on this GPU even one short row at a time,
    and say what size of model would."""
    if plan.device != "cuda" or plan.memory is None or plan.memory.fits:
        return
    shape, budget = sizing.shape, sizing.budget
    one_row = estimate(shape, max_length=min(SHORTEST_ROWS, sizing.sized), micro_batch=1, **sizing.common)
    if one_row.total_gib <= budget:
        return
    overhead = one_row.overhead_gib
    share = max(0.0, budget - overhead) / max(one_row.total_gib - overhead, 1e-9)
    experts = (f", of which {shape.expert_params / 1e9:.1f} B are experts' weights that stay 16-bit"
               if shape.experts else "")
    raise FreetuneError(
        f"{shape.name} cannot train on this GPU: {shape.total_params / 1e9:.1f} B parameters{experts}; even one row of "
        f"{min(SHORTEST_ROWS, sizing.sized)} tokens needs ~{one_row.total_gib:.1f} GiB ({one_row.breakdown()}), and "
        f"the plan has {budget:.1f} GiB ({sizing.budget_why}). A model of this kind fits up to about "
        f"{shape.total_params * share / 1e9:.1f} B parameters: set model_id to a smaller model, or use a GPU with "
        f"~{one_row.total_gib:.0f} GiB or more. Nothing was downloaded.")


def _estimate_at(sizing: _Sizing, micro_batch: int, **changed) -> MemoryEstimate:
    """The memory estimate at `micro_batch` rows of the sized length, with the sizing's settings (some `changed`),
    against the plan's budget."""
    est = estimate(sizing.shape, max_length=sizing.sized, micro_batch=micro_batch, **{**sizing.common, **changed})
    est.budget_gib = sizing.budget
    return est


def _checkpointing_by_memory(plan: Plan, sizing: _Sizing) -> None:
    """"auto": off when the whole micro-batch fits without it; on, for every n-th layer only where that fits."""
    # A full micro-batch without recompute beats a bigger one with it only if it fits whole: batch size is worth more
    # tokens/s than the ~30% the recompute costs, so checkpointing goes only when both hold.
    shape, sized, budget, common = sizing.shape, sizing.sized, sizing.budget, sizing.common
    whole = sizing.micro_batch or sizing.cap
    bare = _estimate_at(sizing, whole, gradient_checkpointing=False)
    plan.gradient_checkpointing = not bare.fits
    common["gradient_checkpointing"] = plan.gradient_checkpointing
    plan.reasons["gradient_checkpointing"] = (
        f"on: without it {whole} x {sized} tokens would need ~{bare.total_gib:.1f} of {budget:.1f} GiB"
        if plan.gradient_checkpointing else
        f"off: {whole} x {sized} tokens fit without it (~{bare.total_gib:.1f} of {budget:.1f} GiB), "
        f"which saves recomputing every layer in the backward (~30% of a step)")
    if plan.gradient_checkpointing and plan.device == "cuda" and plan.layout != "fsdp":
        every, why = choose_checkpoint_every(shape, budget, sized, whole, common)
        if every > 1:
            common["checkpoint_every"] = every
            plan.reasons["gradient_checkpointing"] = why


def _fit_batch(plan: Plan, sizing: _Sizing) -> None:
    """The largest micro-batch that fits (or the one asked for, with advice when it does not)."""
    shape, sized, budget, common, asked = sizing.shape, sizing.sized, sizing.budget, sizing.common, sizing.micro_batch
    if asked is None:
        plan.micro_batch, plan.max_length, plan.memory, why = fit(shape, budget, max_length=sized,
                                                                  max_micro_batch=sizing.cap, **common)
        plan.reasons["batch"] = f"{shape.name}: {why}" + (
            f" (the data's longest row; rows are cut at max_length {sizing.max_length})"
            if sized < sizing.max_length else "")
        if not plan.memory.fits:
            plan.warnings.append(f"{shape.name} {why}")
        elif plan.max_length < sized:
            plan.warnings.append(f"max_length lowered from {sizing.max_length} to {plan.max_length} so that one row "
                                 f"fits in {budget:.1f} GiB: longer rows are cut")
        return
    fitted_batch, fitted_length, _, _ = fit(shape, budget, max_length=sized, max_micro_batch=asked, **common)
    plan.memory = _estimate_at(sizing, asked)
    plan.reasons["batch"] = f"micro_batch {asked} as given; ~{plan.memory.total_gib:.1f} GiB for {shape.name}"
    if not plan.memory.fits:
        advice = (f"use micro_batch={fitted_batch} with grad_accum={sizing.rows_per_gpu_step // fitted_batch} "
                  f"(same rows per step)" if fitted_length == sized and fitted_batch < asked
                  else "lower max_length or lora_rank, or pick a smaller model or a bigger GPU")
        plan.warnings.append(f"micro_batch {asked} x {sized} tokens needs ~{plan.memory.total_gib:.1f} GiB "
                             f"({plan.memory.breakdown()}), more than {budget:.1f} GiB: {advice}")


def _shard_if_needed(plan: Plan, sizing: _Sizing, warnings_before: int) -> None:
    """FSDP when asked, or when several GPUs cannot each hold one full copy and one row (DDP): each GPU then holds 1/N
    of the weights, the LoRA gradients and the optimizer state."""
    shape, sized, budget, common, asked = sizing.shape, sizing.sized, sizing.budget, sizing.common, sizing.micro_batch
    one_row = _estimate_at(sizing, 1)
    world = plan.world_size
    if not (plan.layout == "fsdp" or (sizing.layout_asked == "auto" and plan.layout == "ddp" and world > 1
                                      and not one_row.fits)):
        return
    common["shards"] = max(world, 1)
    common["offload_activations"] = False  # FSDP's own path; not combined with TRL's offloading here
    common["compiled"] = False  # FSDP runs eagerly (choices.choose_compile)
    common["embeddings_on_host"] = False
    common["cuda_graphs"] = False
    plan.reasons["embeddings"] = "on the GPUs: FSDP shards the table with the model's root unit"
    del plan.warnings[warnings_before:]  # they were about the unsharded layout
    if asked is None:
        plan.micro_batch, plan.max_length, plan.memory, why = fit(shape, budget, max_length=sized,
                                                                  max_micro_batch=sizing.cap, **common)
    else:
        plan.memory = _estimate_at(sizing, asked)
        why = f"micro_batch {asked} as given; ~{plan.memory.total_gib:.1f} of {budget:.1f} GiB"
    plan.reasons["batch"] = f"{shape.name} sharded over {world} GPU(s): {why}"
    if plan.layout != "fsdp":
        plan.reasons["layout"] = (f"{world} GPUs: FSDP, because one full copy per GPU (DDP) needs "
                                  f"~{one_row.total_gib:.1f} GiB for one row of {sized} tokens, more than "
                                  f"{budget:.1f} GiB; sharded over {world}, ~{plan.memory.total_gib:.1f} GiB each. "
                                  f"torchrun --nproc_per_node={world}, wrapped per decoder layer")
        plan.layout = "fsdp"
    if not plan.memory.fits:
        plan.warnings.append(f"{shape.name} does not fit even sharded over {world} GPU(s): {why}")


def _batching_step(plan: Plan, hardware: Hardware, sizing: _Sizing) -> None:
    """The accumulation that keeps the rows per step, how a micro-batch's rows are laid out, and which rank gets which."""
    plan.grad_accum = max(1, sizing.rows_per_gpu_step // plan.micro_batch)
    plan.batching, attention, plan.reasons["batching"] = choose_batching(
        plan.policy, [g.capability for g in hardware.gpus], plan.micro_batch, sizing.shape, plan.max_length)
    # Processes, not GPUs: a CPU job under torchrun has several ranks too.
    plan.sampler, plan.reasons["sampler"] = choose_sampler(plan.batching,
                                                           max(plan.world_size, hardware.torchrun_world_size or 1))
    if attention == VARLEN_ATTENTION:
        plan.attn_implementation = VARLEN_ATTENTION
        plan.reasons["attention"] = varlen_attention_reason()
    if plan.world_size > 1:
        plan.reasons["batch"] += (f"; {plan.world_size} GPUs x {plan.micro_batch} x {plan.grad_accum} rows per "
                                  f"optimizer step")


def _final_step(plan: Plan, hardware: Hardware, sizing: _Sizing, compile: str) -> None:
    """max_length as given unless a row did not fit, the disk, the kernels for the final layout, offloading."""
    if plan.max_length >= sizing.sized:  # lowered only when a row did not fit
        plan.max_length = sizing.max_length
    plan.reasons["max_length"] = ("as given" if plan.max_length == sizing.max_length
                                  else f"lowered from {sizing.max_length} to fit")
    plan.warnings += _disk_warnings(hardware, sizing.shape)
    _kernels_step(plan, compile, sizing.shape)
    memory = plan.memory
    plan.offload_activations = bool(memory is not None and memory.settings.get("offload_activations")
                                    and plan.gradient_checkpointing)
    if plan.offload_activations:
        plan.reasons["gradient_checkpointing"] += f"; {plan.reasons['offload']}"
    plan.checkpoint_every = memory.settings.get("checkpoint_every", 1) if memory is not None else 1
    plan.mlp_kernel = memory.settings.get("mlp_kernel", "layers") if memory is not None else "layers"
    plan.loss_tile_tokens = memory.settings.get("loss_tile_tokens", 0) if memory is not None else 0
    plan.embeddings_on_host = bool(memory is not None and memory.settings.get("embeddings_on_host"))
    graphs = bool(memory is not None and memory.settings.get("cuda_graphs") and plan.batching == "padding_free"
                  and plan.layout == "single" and plan.lora_kernel == "fused" and plan.compile)
    plan.cuda_graph_tokens = graph_tokens(plan.micro_batch, plan.max_length) if graphs else 0
    if memory is not None and memory.settings.get("cuda_graphs") and not graphs:
        plan.reasons["cuda_graphs"] = "off: the final layout has no padding-free, fused, compiled layers"
    if plan.mlp_kernel != "layers" and plan.lora_kernel != "fused":  # FSDP took over after the memory step
        plan.mlp_kernel, plan.reasons["mlp_kernel"] = "layers", "the final layout has no fused LoRA layers"


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


def for_world(plan: Plan, processes: int, hosts: int = 1) -> Plan:
    """The plan for a torchrun job of `processes` ranks over `hosts` machines, which the machine that planned could not
    see (it planned for its own GPUs): each optimizer step's rows are shared by every rank of the job, and the
    sampler follows the processes (a CPU job under torchrun has several ranks too). Returns a copy."""
    job = replace(plan, reasons=dict(plan.reasons))
    if hosts > 1 and processes > plan.world_size:
        job.reasons["layout"] = (f"{hosts} hosts x {processes // hosts} process(es) = {processes} ranks through "
                                 f"torchrun's c10d rendezvous; " + plan.reasons.get("layout", ""))
        job.world_size = processes
    job.sampler, job.reasons["sampler"] = choose_sampler(plan.batching, processes)
    return job


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
