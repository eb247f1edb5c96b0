"""The training plan as one record: every decision's value, its reason (the table a notebook shows), its warnings and
the memory estimate it was sized with. freetune.plan.make builds it; the run reads it and never re-asks the planner."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field

from freetune.plan.memory import MemoryEstimate


@dataclass(frozen=True)
class Plan:
    """The plan, frozen: make_plan, replan and for_world return a new one; nothing changes one in place."""

    device: str                 # "cuda" or "cpu"
    compute_dtype: str          # "float16" | "bfloat16" | "float32": 4-bit matmuls and non-quantised weights
    mixed_precision: str        # "fp16" | "bf16" | "no": the Trainer's autocast mode
    attn_implementation: str    # "sdpa" | "eager" | "flash_attention_2" | "freetune_varlen" (freetune.speed.attention)
    reasons: dict = field(default_factory=dict)
    layout: str | None = None   # "single" | "ddp" | "fsdp" | "cpu" (None: from device)
    world_size: int = 1         # processes (one per GPU) under DDP
    micro_batch: int = 1        # rows per GPU per forward pass
    grad_accum: int = 1         # micro-batches per optimizer step
    max_length: int = 1024      # tokens per row; longer rows are cut
    lora_dtype: str = "float32"
    policy: str = ""            # "turing" | "ampere" | "cpu"
    batching: str = "padded"    # "padding_free" | "grouped" | "padded" (freetune.speed.batching)
    sampler: str = "random"     # "random" | "length_grouped" | "rank_balanced": rows per rank and micro-batch
    gradient_checkpointing: bool = True  # recompute activations in the backward (chosen by memory when "auto")
    lora_kernel: str = "peft"   # "fused" (freetune.speed.lora_kernel: one autograd node per 4-bit LoRA layer) | "peft"
    optimizer: str = "paged_adamw_8bit"  # the Trainer's `optim` (chosen by memory when "auto")
    compile: bool = False       # torch.compile each decoder layer (freetune.speed.compiled_layers.compile_layers)
    frozen_dtype: str = "float32"  # the frozen non-4-bit weights (embeddings, norms, lm_head) and residual stream
    offload_activations: bool = False  # checkpointed layers' inputs kept in pinned host memory, not on the GPU
    loss_tile_tokens: int = 0   # tokens per tile of TRL's chunked loss head (0: TRL's own, 4,096; choose_loss_tile)
    checkpoint_every: int = 1   # with checkpointing on, every n-th decoder layer is checkpointed (1: all of them)
    # "traced" (freetune.speed.mlp: the SwiGLU MLP as one autograd node, gate and up recomputed in its backward) |
    # "chunked" (the same as one op over token chunks) | "layers" (each projection on its own)
    mlp_kernel: str = "layers"
    embeddings_on_host: bool = False  # the input embedding table in host RAM while training (freetune.speed.host_embeddings)
    # > 0: the checkpointed layers' forward and backward replayed as CUDA graphs, padding-free batches padded to a
    # multiple of this many tokens (freetune.speed.cuda_graphs); 0: off
    cuda_graph_tokens: int = 0
    # The fused LoRA layers keep double-quantised weights' absmax values 8-bit (freetune.speed.nf4.quant_args: every use
    # is in a compiled layer), not an fp32 copy (freetune.plan.memory.keeps_8bit_absmax); decided with the kernels.
    keep_8bit_absmax: bool = False
    model: str = ""             # the model the plan is for, as its config.json describes it
    asked: dict = field(default_factory=dict)  # make_plan's arguments (hardware apart), for replan
    memory: MemoryEstimate | None = None
    machine: str = ""
    warnings: list = field(default_factory=list)

    def __post_init__(self):
        if self.layout is None:
            object.__setattr__(self, "layout", "cpu" if self.device == "cpu" else "single")

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
