"""scripts/bench.py's --variants experiments: the keys that are not plan fields but change freetune's path (or
DDP's) in a worker process."""

from __future__ import annotations

import os

from freetune.plan import ModelShape
from scripts.bench_prepare import ARCHITECTURE


# --variants keys that are not plan fields: experiments on top of freetune's path. The DDP ones change nothing in
# one process, so a variant made only of them runs under DDP only (compared with freetune's own 1-GPU run).
EXPERIMENTS = ("liger", "cpp_wrapper", "combo_kernels", "dense_head", "no_packed_check", "pin_cores", "byte_masks",
               "fp32_absmax", "per_layer_casts", "copied_heads", "trl_empty_cache", "no_triton", "inline_dgrad",
               "skip_guards", "no_asserts", "gc_unfrozen", "lora_dropout",
               "ddp_split", "static_graph", "bucket_view", "bucket_mb", "flat_sync")

DDP_EXPERIMENTS = ("ddp_split", "static_graph", "bucket_view", "bucket_mb", "flat_sync")

def ddp_only(overrides: dict) -> bool:
    """A --variants run that changes only DDP settings (nothing to measure on one GPU)."""
    return bool(overrides) and all(k in DDP_EXPERIMENTS for k in overrides)


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
