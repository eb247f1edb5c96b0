"""make_plan: the machine (freetune.plan.hardware) and what was asked, turned into the training plan in short steps,
each step asking freetune.plan.decisions / freetune.plan.sizing for Decisions and the Plan built from them once, at
the end (its reasons are the decisions' whys). It refuses a GPU the installed PyTorch cannot run, and a model that
cannot fit, before a model is downloaded. `for_world` re-decides what depends on the job's size (torchrun's processes,
several hosts) once the job is launched; `replan` re-makes the plan once the data's longest row is known."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from freetune.errors import FreetuneError
from freetune.plan.decisions import (Decision, choose_attention, choose_batching, choose_budget, choose_checkpointing,
                                     choose_compile, choose_frozen_dtype, choose_layout, choose_load_dtype,
                                     choose_lora_dtype, choose_lora_kernel, choose_mixed_precision, choose_policy,
                                     choose_sampler, choose_shape, needs_varlen_probe, resolve_policy,
                                     varlen_attention, world_size)
from freetune.plan.hardware import Hardware, check_gpus_supported, disk_warnings, probe_varlen, read_hardware
from freetune.plan.memory import MemoryEstimate, dequantises_backward_in_graph, fit, keeps_8bit_absmax
from freetune.plan.record import Plan
from freetune.plan.shapes import ModelShape
from freetune.plan.sizing import (GRAPHS_LOSS_TILE, GRAPHS_OPTIMIZER, MemorySettings, choose_attention_heads,
                                  choose_checkpoint_every, choose_cuda_graphs, choose_embeddings, choose_loss_tile,
                                  choose_mlp_kernel, choose_offload, choose_optimizer, graph_buffer_tokens,
                                  graph_tokens, sharded)

# The shortest rows a plan lowers max_length to before it calls a model too big (memory.fit's min_length).
SHORTEST_ROWS = 256


@dataclass(frozen=True)
class _Sizing:
    """What make_plan's memory steps size against: the asks, and the row length the memory is sized for."""

    shape: ModelShape | None
    micro_batch: int | None   # as asked; None: the plan chooses
    rows_per_gpu_step: int
    max_length: int           # as asked
    sized: int                # the data's longest row, at most max_length
    budget: Decision          # GiB the plan may fill, and why
    checkpointing_auto: bool
    layout_asked: str

    @property
    def cap(self) -> int:
        """The largest power of two that divides the rows per step, so the accumulation stays a whole number."""
        return max(b for b in (1, 2, 4, 8, 16) if self.rows_per_gpu_step % b == 0)

    def estimate(self, settings: MemorySettings, micro_batch: int, **changed) -> MemoryEstimate:
        return settings.estimate(self.shape, self.sized, micro_batch, self.budget.value, **changed)


@dataclass
class _Draft:
    """The decisions made so far, by name: make_plan's steps fill it in, and the Plan is built from it once."""

    policy: Decision
    hardware: Hardware
    model: Decision = None
    layout: Decision = None
    checkpointing: Decision = None
    optimizer: Decision = None
    lora_kernel: Decision = None
    compile: Decision = None
    attention: Decision = None
    settings: MemorySettings = None   # the memory estimate's settings, once the memory step sized them
    checkpoint_every: Decision = None
    offload: Decision = None
    mlp_kernel: Decision = None
    loss_tile: Decision = None
    embeddings: Decision = None
    cuda_graphs: Decision = None
    attention_heads: Decision = None  # the memory-efficient attention's grouped-query heads in one call
    batch: Decision = None            # the micro-batch
    fitted_length: int = 0            # the row length the batch fits at (the sized one, or lowered to fit)
    memory: Decision = None
    batching: Decision = None
    sampler: Decision = None
    warnings: list = field(default_factory=list)

    @property
    def device(self) -> str:
        return "cpu" if self.policy.value == "cpu" else "cuda"

    @property
    def world_size(self) -> int:
        return world_size(self.hardware, self.layout.value)


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
        (freetune.speed.compiled_layers.compile_layers).
    longest_row: tokens of the data's longest row (freetune.audit counts them): the batch is sized for rows that
        long, not for max_length (`replan` re-makes a plan with it once the data is audited).
    lora_dropout: the LoRA dropout the run will use; CUDA graphs (freetune.speed.cuda_graphs) need 0.
    Raises FreetuneError for a GPU the installed torch cannot run, before anything is loaded.
    """
    asked_for = {k: v for k, v in locals().items() if k != "hardware"}
    hardware = hardware if hardware is not None else read_hardware()
    check_gpus_supported(hardware)
    draft = _Draft(policy=choose_policy(hardware, resolve_policy(force_policy, precision)), hardware=hardware)
    draft.warnings += draft.policy.warnings
    draft.model = choose_shape(model_shape)
    shape = draft.model.value
    check_lora_fits_architecture(shape, lora_dropout)
    draft.attention = choose_attention(hardware, draft.policy.value, shape)
    draft.layout = choose_layout(hardware, layout, draft.device)
    draft.checkpointing = choose_checkpointing(gradient_checkpointing)
    if model_shape is not None and shape is None:
        draft.warnings.append(f"no shape for {model_shape!r}: {draft.model.why}. The memory check is skipped (batch "
                              f"1, checkpointing on). Run where the Hub is reachable, or set model_id to a local "
                              f"folder with the model's config.json, to size the batch")
    budget = choose_budget(hardware, draft.device, memory_budget_gib)
    draft.optimizer = choose_optimizer(optimizer, draft.device, shape, budget.value, lora_rank, lora_targets)
    # Chosen before the memory check (fused and compiled layers change the absmax bytes and what is saved) and again
    # at the end, in case FSDP took over.
    _kernels_step(draft, compile)
    micro_batch = micro_batch or None
    # The memory is sized for rows as long as the data's longest (the audit counts them; replan passes it), not for
    # max_length: short rows (an SVG set's ~150 tokens) would otherwise be planned as 1,024 each.
    sizing = _Sizing(shape=shape, micro_batch=micro_batch, rows_per_gpu_step=(micro_batch or 1) * grad_accum,
                     max_length=max_length, sized=min(max_length, longest_row) if longest_row else max_length,
                     budget=budget, checkpointing_auto=draft.checkpointing.value is None, layout_asked=layout)
    draft.batch, draft.fitted_length = Decision(micro_batch or 1, ""), sizing.sized
    if shape is not None and budget.value:
        # CUDA graphs need padding-free rows: asked now (the probe's answer is kept), the batching is chosen later.
        padding_free = _batching(draft, 2, sizing.sized).value == "padding_free"
        _memory_step(draft, sizing, lora_rank=lora_rank, lora_targets=lora_targets, loss_head=loss_head,
                     lora_dropout=lora_dropout if padding_free else None, optimizer_auto=optimizer == "auto")
    else:
        draft.batch = Decision(draft.batch.value, "as given" if micro_batch else
                               "1 (no model shape to size it against: give model_shape to let the plan choose)")
    _batching_step(draft, sizing)
    draft.warnings += disk_warnings(hardware, shape)
    _kernels_step(draft, compile)  # for the final layout
    return _build(draft, sizing, asked_for)


def check_lora_fits_architecture(shape: ModelShape | None, lora_dropout: float) -> None:
    """Refuse, before anything loads, LoRA settings peft cannot apply to this architecture."""
    if shape is not None and shape.experts and lora_dropout:
        raise FreetuneError(
            f"{shape.name} is a mixture of experts ({shape.experts} per layer): peft adapts its experts' weights "
            f"through its ParamWrapper, which takes no LoRA dropout (lora_dropout={lora_dropout:g}). "
            f"Set lora_dropout = 0.0")


def _kernels_step(draft: _Draft, compile: str) -> None:
    draft.lora_kernel = choose_lora_kernel(draft.device, draft.layout.value)
    draft.compile = choose_compile(compile, draft.device, draft.layout.value, draft.model.value)


def _batching(draft: _Draft, micro_batch: int, length: int) -> Decision:
    """The batching at micro_batch rows of `length` tokens, with this GPU's variable-length kernel probed where it
    matters."""
    policy, shape = draft.policy.value, draft.model.value
    varlen = (probe_varlen(policy) if needs_varlen_probe(policy, draft.hardware, micro_batch, shape, length)
              else None)
    return choose_batching(policy, micro_batch, shape, length, varlen)


def _memory_step(draft: _Draft, sizing: _Sizing, **lora) -> None:
    """Checkpointing (when "auto"), offloading, the kernels that weigh memory, the micro-batch and max_length that
    fit; FSDP where DDP cannot."""
    settings = MemorySettings(
        lora_rank=lora["lora_rank"], lora_targets=lora["lora_targets"],
        gradient_checkpointing=draft.checkpointing.value is not False, optimizer=draft.optimizer.value,
        compute_dtype=choose_load_dtype(draft.policy.value).value, device=draft.device, world_size=draft.world_size,
        loss_head=lora["loss_head"], lora_kernel=draft.lora_kernel.value,
        frozen_dtype=choose_frozen_dtype(draft.policy.value).value, compiled=draft.compile.value)
    if sizing.checkpointing_auto:
        settings = _checkpointing_by_memory(draft, sizing, settings)
    if (settings.gradient_checkpointing and draft.device == "cuda" and draft.layout.value != "fsdp"
            and settings.checkpoint_every == 1):
        draft.offload = choose_offload(sizing.shape, sizing.budget.value, sizing.sized,
                                       sizing.micro_batch or sizing.cap, settings)
        settings = replace(settings, offload_activations=draft.offload.value)
    # the loss tile and the embeddings' place first: the MLP kernel's choice weighs one row against what is left
    draft.loss_tile = choose_loss_tile(settings)
    settings = replace(settings, loss_tile_tokens=draft.loss_tile.value)
    draft.embeddings = choose_embeddings(sizing.shape, settings, draft.layout.value)
    settings = replace(settings, embeddings_on_host=draft.embeddings.value)
    draft.mlp_kernel = choose_mlp_kernel(sizing.shape, sizing.budget.value, sizing.sized, settings)
    settings = replace(settings, mlp_kernel=draft.mlp_kernel.value)
    draft.cuda_graphs = choose_cuda_graphs(settings, draft.layout.value, lora["lora_dropout"], sizing.shape)
    if draft.cuda_graphs.value:
        draft.loss_tile = GRAPHS_LOSS_TILE
        settings = replace(settings, cuda_graphs=True, loss_tile_tokens=GRAPHS_LOSS_TILE.value)
        if lora["optimizer_auto"] and draft.optimizer.value in ("adamw_torch_fused", "paged_adamw_8bit"):
            draft.optimizer = GRAPHS_OPTIMIZER
            settings = replace(settings, optimizer=GRAPHS_OPTIMIZER.value)
    warnings_before = len(draft.warnings)
    draft.settings = settings
    _fit_batch(draft, sizing)
    _shard_if_needed(draft, sizing, warnings_before)
    _refuse_what_cannot_fit(draft, sizing)
    draft.memory = Decision(draft.memory.value, f"{sizing.budget.why}; {draft.memory.value.breakdown()}")


def _checkpointing_by_memory(draft: _Draft, sizing: _Sizing, settings: MemorySettings) -> MemorySettings:
    """"auto": off when the whole micro-batch fits without it; on, for every n-th layer only where that fits."""
    # A full micro-batch without recompute beats a bigger one with it only if it fits whole: batch size is worth more
    # tokens/s than the ~30% the recompute costs, so checkpointing goes only when both hold.
    sized, budget = sizing.sized, sizing.budget.value
    whole = sizing.micro_batch or sizing.cap
    bare = sizing.estimate(settings, whole, gradient_checkpointing=False)
    on = not bare.fits
    draft.checkpointing = Decision(on, (
        f"on: without it {whole} x {sized} tokens would need ~{bare.total_gib:.1f} of {budget:.1f} GiB" if on else
        f"off: {whole} x {sized} tokens fit without it (~{bare.total_gib:.1f} of {budget:.1f} GiB), "
        f"which saves recomputing every layer in the backward (~30% of a step)"))
    settings = replace(settings, gradient_checkpointing=on)
    if on and draft.device == "cuda" and draft.layout.value != "fsdp":
        every = choose_checkpoint_every(sizing.shape, budget, sized, whole, settings)
        if every.value > 1:
            draft.checkpoint_every = every
            settings = replace(settings, checkpoint_every=every.value)
    return settings


def _fit_batch(draft: _Draft, sizing: _Sizing) -> None:
    """The largest micro-batch that fits (or the one asked for, with advice when it does not)."""
    shape, sized, budget, asked = sizing.shape, sizing.sized, sizing.budget.value, sizing.micro_batch
    settings = draft.settings
    if asked is None:
        batch, draft.fitted_length, memory, why = fit(shape, budget, max_length=sized, max_micro_batch=sizing.cap,
                                                      **settings.__dict__)
        draft.memory = Decision(memory, "")
        draft.batch = Decision(batch, f"{shape.name}: {why}" + (
            f" (the data's longest row; rows are cut at max_length {sizing.max_length})"
            if sized < sizing.max_length else ""))
        if not memory.fits:
            draft.warnings.append(f"{shape.name} {why}")
        elif draft.fitted_length < sized:
            draft.warnings.append(f"max_length lowered from {sizing.max_length} to {draft.fitted_length} so that one "
                                  f"row fits in {budget:.1f} GiB: longer rows are cut")
        return
    fitted_batch, fitted_length, _, _ = fit(shape, budget, max_length=sized, max_micro_batch=asked,
                                            **settings.__dict__)
    memory = sizing.estimate(settings, asked)
    draft.memory = Decision(memory, "")
    draft.batch = Decision(asked, f"micro_batch {asked} as given; ~{memory.total_gib:.1f} GiB for {shape.name}")
    if not memory.fits:
        advice = (f"use micro_batch={fitted_batch} with grad_accum={sizing.rows_per_gpu_step // fitted_batch} "
                  f"(same rows per step)" if fitted_length == sized and fitted_batch < asked
                  else "lower max_length or lora_rank, or pick a smaller model or a bigger GPU")
        draft.warnings.append(f"micro_batch {asked} x {sized} tokens needs ~{memory.total_gib:.1f} GiB "
                              f"({memory.breakdown()}), more than {budget:.1f} GiB: {advice}")


def _shard_if_needed(draft: _Draft, sizing: _Sizing, warnings_before: int) -> None:
    """FSDP when asked, or when several GPUs cannot each hold one full copy and one row (DDP): each GPU then holds 1/N
    of the weights, the LoRA gradients and the optimizer state."""
    shape, sized, budget, asked = sizing.shape, sizing.sized, sizing.budget.value, sizing.micro_batch
    one_row = sizing.estimate(draft.settings, 1)
    world = draft.world_size
    if not (draft.layout.value == "fsdp" or (sizing.layout_asked == "auto" and draft.layout.value == "ddp"
                                             and world > 1 and not one_row.fits)):
        return
    draft.settings = settings = sharded(draft.settings, world)
    draft.embeddings = Decision(False, "on the GPUs: FSDP shards the table with the model's root unit")
    del draft.warnings[warnings_before:]  # they were about the unsharded layout
    if asked is None:
        batch, draft.fitted_length, memory, why = fit(shape, budget, max_length=sized, max_micro_batch=sizing.cap,
                                                      **settings.__dict__)
    else:
        batch, memory = asked, sizing.estimate(settings, asked)
        why = f"micro_batch {asked} as given; ~{memory.total_gib:.1f} of {budget:.1f} GiB"
    draft.memory = Decision(memory, "")
    draft.batch = Decision(batch, f"{shape.name} sharded over {world} GPU(s): {why}")
    if draft.layout.value != "fsdp":
        draft.layout = Decision("fsdp", f"{world} GPUs: FSDP, because one full copy per GPU (DDP) needs "
                                        f"~{one_row.total_gib:.1f} GiB for one row of {sized} tokens, more than "
                                        f"{budget:.1f} GiB; sharded over {world}, ~{memory.total_gib:.1f} GiB each. "
                                        f"torchrun --nproc_per_node={world}, wrapped per decoder layer")
    if not memory.fits:
        draft.warnings.append(f"{shape.name} does not fit even sharded over {world} GPU(s): {why}")


def _refuse_what_cannot_fit(draft: _Draft, sizing: _Sizing) -> None:
    """Refuse, before any weights are downloaded, a model that cannot train on this GPU even one short row at a time,
    and say what size of model would."""
    if draft.device != "cuda" or draft.memory.value.fits:
        return
    shape, budget = sizing.shape, sizing.budget.value
    length = min(SHORTEST_ROWS, sizing.sized)
    one_row = draft.settings.estimate(shape, length, 1)
    if one_row.total_gib <= budget:
        return
    overhead = one_row.overhead_gib
    share = max(0.0, budget - overhead) / max(one_row.total_gib - overhead, 1e-9)
    experts = (f", of which {shape.expert_params / 1e9:.1f} B are experts' weights that stay 16-bit"
               if shape.experts else "")
    raise FreetuneError(
        f"{shape.name} cannot train on this GPU: {shape.total_params / 1e9:.1f} B parameters{experts}; even one row of "
        f"{length} tokens needs ~{one_row.total_gib:.1f} GiB ({one_row.breakdown()}), and the plan has {budget:.1f} "
        f"GiB ({sizing.budget.why}). A model of this kind fits up to about {shape.total_params * share / 1e9:.1f} B "
        f"parameters: set model_id to a smaller model, or use a GPU with ~{one_row.total_gib:.0f} GiB or more. "
        f"Nothing was downloaded.")


def _batching_step(draft: _Draft, sizing: _Sizing) -> None:
    """How a micro-batch's rows are laid out, which rank gets which, and the attention that follows."""
    draft.batching = _batching(draft, draft.batch.value, draft.fitted_length)
    # Processes, not GPUs: a CPU job under torchrun has several ranks too.
    draft.sampler = choose_sampler(draft.batching.value, max(draft.world_size, draft.hardware.torchrun_world_size or 1))
    if draft.batching.value == "padding_free":
        probe = probe_varlen(draft.policy.value)
        draft.attention = varlen_attention(probe)
        shape = sizing.shape
        if (probe is not None and probe.efficient and shape is not None and shape.kv_heads < shape.heads
                and draft.settings is not None and draft.memory is not None and draft.memory.value.fits):
            draft.attention_heads, estimate = choose_attention_heads(
                shape, sizing.budget.value, draft.fitted_length, draft.batch.value, draft.settings)
            if draft.attention_heads.value:  # the estimate the plan shows counts the copies
                draft.settings = replace(draft.settings, attention_whole_heads=True)
                draft.memory = Decision(estimate, f"{sizing.budget.why}; {estimate.breakdown()}")
    if draft.world_size > 1:
        grad_accum = max(1, sizing.rows_per_gpu_step // draft.batch.value)
        draft.batch = Decision(draft.batch.value, draft.batch.why + (
            f"; {draft.world_size} GPUs x {draft.batch.value} x {grad_accum} rows per optimizer step"))


def _build(draft: _Draft, sizing: _Sizing, asked: dict) -> Plan:
    """The Plan from the draft's decisions: what the final layout allows of the kernels the memory step chose."""
    settings = draft.settings or MemorySettings()  # no memory step: the estimate's defaults (nothing chosen)
    fitted, max_length = draft.fitted_length, sizing.max_length
    length = Decision(max_length, "as given") if fitted >= sizing.sized else \
        Decision(fitted, f"lowered from {max_length} to fit")
    gradient_checkpointing = draft.checkpointing.value is not False
    checkpointing_why = (draft.checkpoint_every or draft.checkpointing).why
    offload = settings.offload_activations and gradient_checkpointing
    if offload:
        checkpointing_why += f"; {draft.offload.why}"
    graphs = (settings.cuda_graphs and draft.batching.value == "padding_free" and draft.layout.value == "single"
              and draft.lora_kernel.value == "fused" and draft.compile.value)
    cuda_graphs = draft.cuda_graphs
    if settings.cuda_graphs and not graphs:
        cuda_graphs = Decision(False, "off: the final layout has no padding-free, fused, compiled layers")
    # the graphs' buffers hold the batches the memory estimate was sized for (the data's longest row, once known)
    multiple = graph_tokens(draft.batch.value, fitted) if graphs else 0
    graph_max_tokens = graph_buffer_tokens(draft.batch.value, fitted, multiple) if graphs else 0
    mlp_kernel = draft.mlp_kernel
    if settings.mlp_kernel != "layers" and draft.lora_kernel.value != "fused":  # FSDP took over after the memory step
        mlp_kernel = Decision("layers", "the final layout has no fused LoRA layers")
    mlp = mlp_kernel.value if mlp_kernel is not None else "layers"
    policy = draft.policy.value
    reasons = {"compute_dtype": draft.policy.why, "mixed_precision": choose_mixed_precision(policy).why,
               "load_dtype": choose_load_dtype(policy).why, "lora_dtype": choose_lora_dtype(policy).why,
               "frozen_dtype": choose_frozen_dtype(policy).why, "machine": _machine_why(draft.hardware),
               "gradient_checkpointing": checkpointing_why, "max_length": length.why}
    named = {"attention": draft.attention, "model": draft.model, "layout": draft.layout, "optimizer": draft.optimizer,
             "lora_kernel": draft.lora_kernel, "compile": draft.compile, "offload": draft.offload,
             "mlp_kernel": mlp_kernel, "loss_tile": draft.loss_tile, "embeddings": draft.embeddings,
             "cuda_graphs": cuda_graphs, "batch": draft.batch, "memory": draft.memory, "batching": draft.batching,
             "sampler": draft.sampler}
    reasons.update({key: decision.why for key, decision in named.items() if decision is not None})
    if dequantises_backward_in_graph(draft.lora_kernel.value, draft.compile.value, mlp, bool(multiple)):
        reasons["compile"] += ("; the backward dequantises the 4-bit weights inside these graphs, not through an op "
                               "per weight (one layer's 16-bit weights counted in the memory estimate)")
    whole_heads = bool(draft.attention_heads and draft.attention_heads.value)
    if draft.attention_heads is not None:
        reasons["attention"] += f"; {draft.attention_heads.why}"
    return Plan.build(
        device=draft.device, compute_dtype=choose_load_dtype(policy).value,
        mixed_precision=choose_mixed_precision(policy).value, attn_implementation=draft.attention.value,
        attention_whole_heads=whole_heads,
        reasons=reasons, layout=draft.layout.value, world_size=draft.world_size, micro_batch=draft.batch.value,
        grad_accum=max(1, sizing.rows_per_gpu_step // draft.batch.value), max_length=length.value,
        lora_dtype=choose_lora_dtype(policy).value, policy=policy, batching=draft.batching.value,
        sampler=draft.sampler.value, gradient_checkpointing=gradient_checkpointing,
        lora_kernel=draft.lora_kernel.value, optimizer=draft.optimizer.value, compile=draft.compile.value,
        frozen_dtype=choose_frozen_dtype(policy).value, offload_activations=offload,
        loss_tile_tokens=settings.loss_tile_tokens, checkpoint_every=settings.checkpoint_every, mlp_kernel=mlp,
        embeddings_on_host=settings.embeddings_on_host,
        cuda_graph_tokens=multiple, cuda_graph_max_tokens=graph_max_tokens,
        keep_8bit_absmax=keeps_8bit_absmax(draft.lora_kernel.value, draft.compile.value, mlp),
        model=_model_text(draft, asked["model_shape"]), asked=asked,
        memory=draft.memory.value if draft.memory is not None else None,
        machine=draft.hardware.summary(), warnings=draft.warnings)


def _machine_why(hardware: Hardware) -> str:
    built = {g.sm for g in hardware.gpus}
    return (f"torch {hardware.torch or '?'}" + (f", CUDA {hardware.cuda}" if hardware.cuda else "")
            + (f", built for {', '.join(sorted(built))}" if built and hardware.arch_list else ""))


def _model_text(draft: _Draft, model_shape) -> str:
    shape = draft.model.value
    return shape.describe() if shape is not None else f"{model_shape} (shape unknown)" if model_shape else ""


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
    reasons = dict(plan.reasons)
    changed = {}
    if hosts > 1 and processes > plan.layout.world_size:
        reasons["layout"] = (f"{hosts} hosts x {processes // hosts} process(es) = {processes} ranks through "
                             f"torchrun's c10d rendezvous; " + plan.reasons.get("layout", ""))
        changed["world_size"] = processes
    sampler = choose_sampler(plan.batch.batching, processes)
    reasons["sampler"] = sampler.why
    return plan.replace(reasons=reasons, sampler=sampler.value, **changed)

