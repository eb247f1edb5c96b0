"""scripts/bench.py's --variants experiments: the keys that are not plan fields but change freetune's path (or
DDP's) in a worker process.

Most of them replace a name in another module (torch's inductor settings, TRL, transformers, freetune's own kernels).
Every such replacement is one row of PATCHES: (module, attribute, replacement). The rows an experiment asks for are
looked up before any is applied, and an attribute that is not there (renamed or moved in a new version) stops the run
with the experiment's name: an assignment to a name nobody reads any more would measure the default path under the
experiment's label."""

from __future__ import annotations

import functools
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from freetune.plan import ModelShape
from scripts.bench_prepare import ARCHITECTURE

# --variants keys that are not plan fields: experiments on top of freetune's path. The DDP ones change nothing in
# one process, so a variant made only of them runs under DDP only (compared with freetune's own 1-GPU run).
# (fp32_absmax is a plan setting under an experiment's name: job_plan turns it into keep_8bit_absmax=False.)
EXPERIMENTS = ("liger", "cpp_wrapper", "combo_kernels", "dense_head", "no_packed_check", "pin_cores", "byte_masks",
               "fp32_absmax", "per_layer_casts", "copied_heads", "kv_head_calls", "trl_empty_cache", "no_triton",
               "op_dgrad", "addmm_sums", "out_of_place_backward_sums", "traced_addmm",
               "widening_addmm", "dropout_inductor", "dropout_op", "dropout_backward_kernels",
               "skip_guards", "no_asserts", "gc_unfrozen", "lora_dropout", "full_recompute",
               "optimizer_per_tensor",
               "ddp_split", "static_graph", "bucket_view", "bucket_mb", "flat_sync")

DDP_EXPERIMENTS = ("ddp_split", "static_graph", "bucket_view", "bucket_mb", "flat_sync")


def ddp_only(overrides: dict) -> bool:
    """A --variants run that changes only DDP settings (nothing to measure on one GPU)."""
    return bool(overrides) and all(k in DDP_EXPERIMENTS for k in overrides)


@dataclass(frozen=True)
class Patch:
    """One name an experiment replaces: `attribute` (dotted: 'FreetuneTrainer.training_step') of `module`, set to
    replacement(its current value). optional: a setting older versions lack, left alone where it is not there."""
    module: str
    attribute: str
    replacement: Callable[[Any], Any]
    optional: bool = False


class MissingPatchTarget(RuntimeError):
    """An experiment's target is not where PATCHES says: the experiment would change nothing."""


def _set(value):
    return lambda old: value


def _packed_rows_without_host_check(old):
    """transformers asks the GPU whether the position ids hold packed rows at all (`.all()` on the host) before
    building the attention mask; without that question it builds the block-diagonal mask every time (the varlen
    kernel never reads it)."""
    import torch

    def packed_rows(position_ids):
        first = position_ids[:, :1] - 1
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

    return packed_rows


def _turing_heads_copied(backends: dict) -> dict:
    """The T4 policy's attention with its heads copied into parts. In place: freetune.plan.hardware holds the dict."""
    if "turing" not in backends:
        raise MissingPatchTarget("copied_heads: freetune.speed.attention.POLICY_BACKENDS has no 'turing' policy")
    backends["turing"] = ("efficient_copied",)
    return backends


def _guards_skipped_after_warmup(step):
    """dynamo checks each compiled layer's guards (~900 on a LoRA decoder layer) at every call; after the warm-up
    steps (both graphs compiled: the first layer's input needs no gradient) only the guards that tell the cached
    graphs apart. Unsafe in general (a change no checked guard sees runs the wrong graph): bench runs train only."""
    import torch

    def training_step(self, *args, **kwargs):
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=self.state.global_step >= 2):
            return step(self, *args, **kwargs)

    return training_step


def _with_bucket_view(build):
    """DDP(gradient_as_bucket_view=True): the gradients kept in the buckets (no copy in and out)."""
    def with_bucket_view(self, **kwargs):
        args = build(self, **kwargs)
        for handler in args.get("kwargs_handlers", []):
            if type(handler).__name__ == "DistributedDataParallelKwargs":
                handler.gradient_as_bucket_view = True
        return args

    return with_bucket_view


def _flat_sync(step):
    """DDP's reducer idle (no_sync on every micro-batch); after a step's last micro-batch one all-reduce of all the
    LoRA gradients (flat_all_reduce)."""
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

    return flat_sync_step


INDUCTOR = "torch._inductor.config"
# Every name an experiment replaces. A GPU worker process runs one configuration, so what they patch is patched for
# it only (a --tiny run without --spawn runs every job in one process: its patches stay for the runs after it).
PATCHES: dict[str, tuple[Patch, ...]] = {
    # inductor's C++ wrapper: the compiled layers launch kernels from C++
    "cpp_wrapper": (Patch(INDUCTOR, "cpp_wrapper", _set(True)),),
    # inductor's horizontal fusion: independent small kernels of a graph launched as one
    "combo_kernels": (Patch(INDUCTOR, "combo_kernels", _set(True)),),
    # Two host syncs per step that `--profile` finds on the default path, removed at a cost (on a GPU only).
    # dense_head: TRL's loss head picks the labelled positions with a boolean mask (the host waits for the GPU to
    # count them, forward and backward); on devices without Triton it scores every position and zeroes the
    # unlabelled ones instead. That way here too: no sync, but prompt and padding positions go through the head.
    "dense_head": (Patch("trl.trainer.utils", "_use_triton", _set(lambda device: False)),),
    "no_packed_check": (Patch("transformers.masking_utils", "find_packed_sequence_indices",
                              _packed_rows_without_host_check),),
    # the fused LoRA layers' dropout masks saved a byte per element, not packed bits (the backward unpacks only uint8)
    "byte_masks": (Patch("freetune.speed.lora_kernel", "pack_mask", _set(lambda kept: kept)),),
    # The two launch savings of the eighth session, undone to measure them in the same call: each fused layer casts
    # its own LoRA weights (no once-per-forward cast); the memory-efficient attention's heads copied into parts.
    "per_layer_casts": (Patch("freetune.speed.lora_kernel", "cast_adapters_once_per_forward",
                              _set(lambda model, **kwargs: None)),),
    "copied_heads": (Patch("freetune.speed.attention", "POLICY_BACKENDS", _turing_heads_copied),),
    # Issue 49: the memory-efficient attention a kv head at a time even where the plan put every head in one call
    # (Kernels.attention_whole_heads), as before
    "kv_head_calls": (Patch("freetune.speed.attention", "_varlen_call",
                            lambda old: lambda *args, **kwargs: old(*args[:7])),),
    # The two host savings of the ninth session, undone likewise: TRL's offloading context empties the CUDA cache
    # every micro-batch again; the custom ops' eager dequantisation and MLP helpers without Triton kernels.
    # Issue 49: bitsandbytes' 8-bit AdamW as it comes (a launch and a host sync per LoRA weight), not
    # freetune.speed.optimizer's launch per 16 MiB of LoRA weights
    "optimizer_per_tensor": (Patch("freetune.speed.optimizer", "one_launch", _set(lambda optimizer: optimizer)),),
    "trl_empty_cache": (Patch("freetune.reach.trl", "keep_cuda_cache_between_steps", _set(lambda trainer: False)),),
    "no_triton": (Patch("freetune.speed.nf4", "triton_for", _set(lambda t: None)),),
    # the backward's input gradients through freetune::dequantized_mm wherever the layers are compiled, as before issue
    # 49's in-graph dequantisation (freetune.plan.memory.dequantises_backward_in_graph)
    "op_dgrad": (Patch("freetune.speed.nf4", "dequantise_backward_in_graph", lambda old: lambda on: old(False)),),
    # the compiled layers' LoRA sums in place everywhere (freetune.speed.lora_kernel's plus_product), as before issue
    # 49's out-of-place forward sums; or the backward's out of place too, as the seventh session's plan had them
    "addmm_sums": (Patch("freetune.speed.lora_kernel", "_OUT_OF_PLACE_SUMS",
                         _set({"forward": False, "backward": False})),),
    "out_of_place_backward_sums": (Patch("freetune.speed.lora_kernel", "_OUT_OF_PLACE_SUMS",
                                         _set({"forward": True, "backward": True})),),
    # the in-place LoRA sums (the traced MLP's gate and up; the backward's; all under addmm_sums) as a traced addmm_,
    # which copies its input, as before freetune::add_product_
    "traced_addmm": (Patch("freetune.speed.lora_kernel", "_IN_PLACE_SUMS", _set({"op": False})),),
    # a compiled widening projection (an MLP's gate and up) as its base product and an in-place LoRA sum over its
    # output, as before freetune.speed.lora_kernel's base_plus_lora (one product over [x | h])
    "widening_addmm": (Patch("freetune.speed.lora_kernel", "_ONE_PRODUCT", _set({"widening": False})),),
    # LoRA dropout in compiled layers as inductor draws it (a Philox call per element, the dropped input written), as
    # before issue 49's tenth session (freetune.speed.dropout: 8 elements a call, the LoRA-A product from the draws in
    # the same kernel); or the 8-a-call draws with the dropped input written and multiplied apart (dropout_packed)
    "dropout_inductor": (Patch("freetune.speed.dropout", "_DRAW", _set({"how": "inductor"})),),
    "dropout_op": (Patch("freetune.speed.dropout", "_DRAW", _set({"how": "op"})),),
    # the backward's LoRA dropout terms from the bits in one kernel each (freetune.speed.dropout's
    # dropped_grad_a_parts and add_dropped_product_), not the bits unpacked, the dropped input made again for LoRA A's
    # gradient and the input gradient's LoRA product written, then masked and added (issue 49, eleventh session:
    # fewer kernel-ms, more host)
    "dropout_backward_kernels": (Patch("freetune.speed.dropout", "_BACKWARD", _set({"kernels": True})),),
    # Two more host costs of every compiled layer call (tenth session): guards, and the compiled graphs' wrapper
    # code checking every input's size and stride per call.
    "skip_guards": (Patch("freetune.trainer", "FreetuneTrainer.training_step", _guards_skipped_after_warmup),),
    "no_asserts": (Patch(INDUCTOR, "size_asserts", _set(False)), Patch(INDUCTOR, "scalar_asserts", _set(False)),
                   Patch(INDUCTOR, "alignment_asserts", _set(False), optional=True)),
    # the garbage collector walks every object at its full collections, as before
    "gc_unfrozen": (Patch("freetune.trainer", "GarbageFrozenAfterWarmup.on_step_end",
                          _set(lambda self, *args, **kwargs: None)),),
    # the traced MLP computes gate, up and down again in freetune's checkpoint's recompute, as before issue 49's cut
    # (freetune.speed.recompute)
    "full_recompute": (Patch("freetune.speed.recompute", "recomputing",
                             lambda old: lambda on=True: old(False)),),
    # DDP (apply_ddp_experiments)
    "bucket_view": (Patch("transformers", "Trainer._build_accelerator_args", _with_bucket_view),),
    "flat_sync": (Patch("freetune.trainer", "FreetuneTrainer.training_step", _flat_sync),),
    # dynamo's DDPOptimizer back on (compile_layers turns it off), set at the train's start (SplitForDDP)
    "ddp_split": (Patch("torch._dynamo.config", "optimize_ddp", _set(True)),),
}


def patch_targets(experiments: dict, patches: dict = PATCHES) -> list[tuple[object, str, Patch]]:
    """(owner, name, patch) of every patch the experiments asked for (true or set) need, each looked up now: an
    experiment whose target is missing raises MissingPatchTarget, naming it, before anything is replaced."""
    out = []
    for experiment in [name for name in patches if experiments.get(name)]:
        for patch in patches[experiment]:
            *path, name = patch.attribute.split(".")
            try:
                owner = functools.reduce(getattr, path, importlib.import_module(patch.module))
            except AttributeError:
                owner = None
            if owner is not None and hasattr(owner, name):
                out.append((owner, name, patch))
            elif not patch.optional:
                raise MissingPatchTarget(
                    f"--variants experiment {experiment}: {patch.module}.{patch.attribute} is not there (renamed or "
                    f"moved in this version?), so the experiment would change nothing; point its row of PATCHES in "
                    f"scripts/bench_experiments.py at the new name, or leave {experiment} out of --variants")
    return out


def replace_targets(targets: list[tuple[object, str, Patch]]) -> None:
    for owner, name, patch in targets:
        setattr(owner, name, patch.replacement(getattr(owner, name)))


def check_experiments(variants: list[tuple[str, dict]]) -> None:
    """Every experiment of every --variants run has its targets (in the scheduler, before any model is built)."""
    for _, overrides in variants:
        patch_targets(overrides)


def pin_cores(local_rank: int) -> None:
    """The step is host-bound, and two processes on the lent host slowed each other down (two_processes_contention).
    Each process keeps to its own half of the host's cores (the 1-GPU run to the half rank 0 gets), and torch's CPU
    thread pool to that size: no thread of one rank runs on the other's cores."""
    import torch

    cores = sorted(os.sched_getaffinity(0))
    half = len(cores) // 2
    own = cores[local_rank * half:(local_rank + 1) * half] or cores
    os.sched_setaffinity(0, own)
    torch.set_num_threads(len(own))
    print(f"pin_cores: local rank {local_rank} on cores {own[0]}-{own[-1]}", flush=True)


def apply_experiments(experiments: dict, shape: ModelShape, local_rank: int) -> None:
    """The experiments a --variants run asks for that change freetune's path itself (before the model loads): the
    rows of PATCHES but the DDP ones (apply_ddp_experiments), pin_cores and liger."""
    replace_targets(patch_targets({k: v for k, v in experiments.items() if k not in DDP_EXPERIMENTS}))
    if experiments.get("pin_cores"):
        pin_cores(local_rank)
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
    from transformers import TrainerCallback

    for experiment, field in (("static_graph", "ddp_static_graph"), ("bucket_mb", "ddp_bucket_cap_mb")):
        if experiments.get(experiment):
            if not hasattr(config, field):
                raise MissingPatchTarget(f"--variants experiment {experiment}: the training arguments have no "
                                         f"{field} (renamed in this transformers?)")
            setattr(config, field, True if experiment == "static_graph" else int(experiments[experiment]))
    replace_targets(patch_targets({k: experiments.get(k) for k in ("bucket_view", "flat_sync")}))
    if not experiments.get("ddp_split"):
        return []
    split = patch_targets({"ddp_split": True})

    class SplitForDDP(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):  # after compile_layers, before any compile
            replace_targets(split)

    return [SplitForDDP()]


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
