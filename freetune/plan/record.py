"""The training plan as small frozen records, each with its values and the reasons for them (the table a notebook
shows), its warnings and the memory estimate it was sized with. freetune.plan.make builds it; the run reads it
(`plan.batch.micro_batch`, `plan.kernels.lora`, `plan.memory.estimate`) and never re-asks the planner."""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field, fields, replace

from freetune.plan.memory import MemoryEstimate


@dataclass(frozen=True)
class Precision:
    """The dtypes, from the GPU's policy."""

    compute_dtype: str = "float32"  # "float16" | "bfloat16" | "float32": 4-bit matmuls and non-quantised weights
    mixed: str = "no"               # "fp16" | "bf16" | "no": the Trainer's autocast mode
    policy: str = ""                # "turing" | "ampere" | "cpu"
    lora_dtype: str = "float32"
    frozen_dtype: str = "float32"   # the frozen non-4-bit weights (embeddings, norms, lm_head) and residual stream
    why: dict = field(default_factory=dict)

    @property
    def load_dtype(self) -> str:
        """The dtype the model's non-quantised weights load in: the compute dtype, never the checkpoint's."""
        return self.compute_dtype

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.compute_dtype)


@dataclass(frozen=True)
class Layout:
    """Where the run goes: the device, how the GPUs share the model, and how rows reach each rank."""

    device: str = "cpu"             # "cuda" or "cpu"
    kind: str = "cpu"               # "single" | "ddp" | "fsdp" | "cpu"
    world_size: int = 1             # processes (one per GPU) under DDP
    sampler: str = "random"         # "random" | "length_grouped" | "rank_balanced": rows per rank and micro-batch
    why: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Batch:
    """The rows of each step."""

    micro_batch: int = 1            # rows per GPU per forward pass
    grad_accum: int = 1             # micro-batches per optimizer step
    max_length: int = 1024          # tokens per row; longer rows are cut
    batching: str = "padded"        # "padding_free" | "grouped" | "padded" (freetune.speed.batching)
    why: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Kernels:
    """How the forward and backward run."""

    attention: str = "sdpa"         # "sdpa" | "eager" | "flash_attention_2" | "freetune_varlen" (freetune.speed.attention)
    # freetune_varlen through the memory-efficient kernel (a T4's): a layer's grouped-query heads in one kernel call, k
    # and v copied for them, where the plan's memory allows (freetune.speed.attention_efficient's "whole" layout)
    attention_whole_heads: bool = False
    lora: str = "peft"              # "fused" (freetune.speed.lora_kernel: one autograd node per 4-bit LoRA layer) | "peft"
    # "traced" (freetune.speed.mlp: the SwiGLU MLP as one autograd node, gate and up recomputed in its backward) |
    # "chunked" (the same as one op over token chunks) | "layers" (each projection on its own)
    mlp: str = "layers"
    compile: bool = False           # torch.compile each decoder layer (freetune.speed.compiled_layers.compile_layers)
    # > 0: the checkpointed layers' forward and backward replayed as CUDA graphs, padding-free batches padded to a
    # multiple of this many tokens (freetune.speed.cuda_graphs); 0: off
    cuda_graph_tokens: int = 0
    # The largest padded batch the graphs' buffers hold: micro_batch rows of the length the memory was sized for (the
    # data's longest row, once replan has it), in whole multiples; a longer batch runs without the graphs. 0: off.
    cuda_graph_max_tokens: int = 0
    loss_tile_tokens: int = 0       # tokens per tile of TRL's chunked loss head (0: TRL's own, 4,096; choose_loss_tile)
    why: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Memory:
    """What the memory estimate decided, and the estimate."""

    checkpointing: bool = True      # recompute activations in the backward (chosen by memory when "auto")
    checkpoint_every: int = 1       # with checkpointing on, every n-th decoder layer is checkpointed (1: all of them)
    offload_activations: bool = False  # checkpointed layers' inputs kept in pinned host memory, not on the GPU
    optimizer: str = "paged_adamw_8bit"  # the Trainer's `optim` (chosen by memory when "auto")
    embeddings_on_host: bool = False  # the input embedding table in host RAM (freetune.speed.host_embeddings)
    # The fused LoRA layers keep double-quantised weights' absmax values 8-bit (freetune.speed.nf4.quant_args: every use
    # is in a compiled layer), not an fp32 copy (freetune.plan.memory.keeps_8bit_absmax); decided with the kernels.
    keep_8bit_absmax: bool = False
    estimate: MemoryEstimate | None = None
    why: dict = field(default_factory=dict)

    def checkpointing_text(self) -> str:
        if not self.checkpointing:
            return "off"
        if self.checkpoint_every > 1:
            return f"every {self.checkpoint_every} layers"
        return "on, offloaded to host memory" if self.offload_activations else "on"


# The flat setting -> (record, field) it lives in: what Plan.build and Plan.replace accept.
FLAT = {
    "compute_dtype": ("precision", "compute_dtype"), "mixed_precision": ("precision", "mixed"),
    "policy": ("precision", "policy"), "lora_dtype": ("precision", "lora_dtype"),
    "frozen_dtype": ("precision", "frozen_dtype"),
    "device": ("layout", "device"), "layout": ("layout", "kind"), "world_size": ("layout", "world_size"),
    "sampler": ("layout", "sampler"),
    "micro_batch": ("batch", "micro_batch"), "grad_accum": ("batch", "grad_accum"),
    "max_length": ("batch", "max_length"), "batching": ("batch", "batching"),
    "attn_implementation": ("kernels", "attention"), "attention_whole_heads": ("kernels", "attention_whole_heads"),
    "lora_kernel": ("kernels", "lora"),
    "mlp_kernel": ("kernels", "mlp"), "compile": ("kernels", "compile"),
    "cuda_graph_tokens": ("kernels", "cuda_graph_tokens"),
    "cuda_graph_max_tokens": ("kernels", "cuda_graph_max_tokens"), "loss_tile_tokens": ("kernels", "loss_tile_tokens"),
    "gradient_checkpointing": ("memory", "checkpointing"), "checkpoint_every": ("memory", "checkpoint_every"),
    "offload_activations": ("memory", "offload_activations"), "optimizer": ("memory", "optimizer"),
    "embeddings_on_host": ("memory", "embeddings_on_host"), "keep_8bit_absmax": ("memory", "keep_8bit_absmax"),
    "memory": ("memory", "estimate"),
}
# A reason's key -> the record that carries it (the rest: the plan's own `why`: machine, model).
WHY_OF = {
    "precision": ("compute_dtype", "mixed_precision", "load_dtype", "lora_dtype", "frozen_dtype", "policy"),
    "layout": ("layout", "sampler"),
    "batch": ("batch", "batching", "max_length"),
    "kernels": ("attention", "lora_kernel", "mlp_kernel", "compile", "cuda_graphs", "loss_tile"),
    "memory": ("gradient_checkpointing", "offload", "optimizer", "embeddings", "memory"),
}
RECORDS = {"precision": Precision, "layout": Layout, "batch": Batch, "kernels": Kernels, "memory": Memory}


@dataclass(frozen=True)
class Plan:
    """The plan, frozen: make_plan, replan and for_world return a new one; nothing changes one in place."""

    precision: Precision = field(default_factory=Precision)
    layout: Layout = field(default_factory=Layout)
    batch: Batch = field(default_factory=Batch)
    kernels: Kernels = field(default_factory=Kernels)
    memory: Memory = field(default_factory=Memory)
    model: str = ""             # the model the plan is for, as its config.json describes it
    asked: dict = field(default_factory=dict)  # make_plan's arguments (hardware apart), for replan
    machine: str = ""
    warnings: list = field(default_factory=list)
    why: dict = field(default_factory=dict)  # the reasons no record carries (machine, model)

    @classmethod
    def build(cls, reasons: dict | None = None, **settings) -> Plan:
        """A plan from flat settings (FLAT's names: micro_batch=4, lora_kernel="fused", ...) and reasons keyed by
        decision; each lands in its record. The layout defaults to "cpu" or "single" from the device."""
        if "layout" not in settings or settings["layout"] is None:
            settings["layout"] = "cpu" if settings.get("device", "cpu") == "cpu" else "single"
        return cls().replace(reasons=reasons or {}, **settings)

    def replace(self, reasons: dict | None = None, **settings) -> Plan:
        """A copy with flat settings changed (FLAT's names) and, when given, all the reasons replaced."""
        top = {k: settings.pop(k) for k in list(settings) if k in ("model", "asked", "machine", "warnings")}
        unknown = set(settings) - set(FLAT)
        if unknown:
            raise TypeError(f"Plan has no setting {sorted(unknown)}; the settings are {sorted(FLAT)}")
        records = {}
        for name in RECORDS:
            changes = {FLAT[k][1]: v for k, v in settings.items() if FLAT[k][0] == name}
            if reasons is not None:
                changes["why"] = {k: v for k, v in reasons.items() if k in WHY_OF[name]}
            records[name] = replace(getattr(self, name), **changes)
        if reasons is not None:
            owned = {k for keys in WHY_OF.values() for k in keys}
            top["why"] = {k: v for k, v in reasons.items() if k not in owned}
        return replace(self, **records, **top)

    @property
    def reasons(self) -> dict:
        """Every decision's why, keyed by decision (the records' own, merged)."""
        merged = dict(self.why)
        for name in RECORDS:
            merged.update(getattr(self, name).why)
        return merged

    @property
    def rows_per_step(self) -> int:
        return self.batch.micro_batch * self.batch.grad_accum * self.layout.world_size

    def rows(self) -> list[tuple[str, str, str]]:
        """(choice, value, why) for each decision."""
        r = self.reasons
        p, lay, b, k, m = self.precision, self.layout, self.batch, self.kernels, self.memory
        batch = f"{b.micro_batch} x {b.grad_accum}"
        if lay.world_size > 1:
            batch += f" x {lay.world_size} GPUs"
        batch += f" = {self.rows_per_step} rows/step"
        rows = [
            ("machine", self.machine or lay.device, r.get("machine", "")),
            *([("model", self.model, r.get("model", ""))] if self.model else []),
            ("layout", lay.kind if lay.kind not in ("ddp", "fsdp") else f"{lay.kind} x {lay.world_size}",
             r.get("layout", "")),
            ("compute dtype", p.compute_dtype, r.get("compute_dtype", "")),
            ("mixed precision", p.mixed, r.get("mixed_precision", "")),
            ("base weights", f"4-bit NF4, rest {p.frozen_dtype}",
             "; ".join(filter(None, (r.get("frozen_dtype", ""), r.get("load_dtype", ""))))),
            ("LoRA weights", p.lora_dtype, r.get("lora_dtype", "")),
            ("attention", k.attention + (", heads in one call" if k.attention_whole_heads else ""),
             r.get("attention", "")),
            ("batch", batch, r.get("batch", "")),
            ("batching", b.batching, r.get("batching", "")),
            ("sampler", lay.sampler, r.get("sampler", "")),
            ("checkpointing", m.checkpointing_text(), r.get("gradient_checkpointing", "")),
            ("LoRA kernel", k.lora, r.get("lora_kernel", "")),
            ("MLP kernel", k.mlp, r.get("mlp_kernel", "")),
            ("input embeddings", "host RAM" if m.embeddings_on_host else "GPU" if lay.device == "cuda" else
             "with the model", r.get("embeddings", "")),
            ("optimizer", m.optimizer, r.get("optimizer", "")),
            ("compile", "per decoder layer" if k.compile else "off", r.get("compile", "")),
            ("CUDA graphs", f"per layer, batches in multiples of {k.cuda_graph_tokens} tokens"
             + (f" up to {k.cuda_graph_max_tokens}" if k.cuda_graph_max_tokens else "")
             if k.cuda_graph_tokens else "off", r.get("cuda_graphs", "")),
            ("max_length", str(b.max_length), r.get("max_length", "")),
        ]
        if m.estimate is not None:
            budget = f" of {m.estimate.budget_gib:.1f}" if m.estimate.budget_gib is not None else ""
            rows.append(("memory", f"~{m.estimate.total_gib:.1f}{budget} GiB", r.get("memory", "")))
        return rows

    def one_line(self) -> str:
        """Batch, checkpointing and memory in one line (what a replan may change)."""
        estimate = self.memory.estimate
        memory = f", ~{estimate.total_gib:.1f} GiB" if estimate is not None else ""
        return (f"{self.batch.micro_batch} x {self.batch.grad_accum} rows per step, checkpointing "
                f"{self.memory.checkpointing_text()}, max_length {self.batch.max_length}{memory}")

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
        """The plan as JSON-able records (the Kaggle job file's "plan"; from_dict reads it back)."""
        data = asdict(self)
        data["memory"]["estimate"] = self.memory.estimate.to_dict() if self.memory.estimate is not None else None
        data["rows_per_step"] = self.rows_per_step
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        """A plan from to_dict's (or dataclasses.asdict's) records; the memory estimate is not read back (a job
        re-sizes on its own machine, freetune.plan.for_world)."""
        records = {}
        for name, record in RECORDS.items():
            known = {f.name for f in fields(record)} - {"estimate"}
            records[name] = record(**{k: v for k, v in (data.get(name) or {}).items() if k in known})
        top = {k: data[k] for k in ("model", "asked", "machine", "warnings", "why") if k in data}
        return cls(**records, **top)
