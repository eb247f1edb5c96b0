"""The Trainer's settings of a run (TRL's SFTConfig), made from the plan and the recipe's parameters: the plan's batch,
max_length, precision, device, checkpointing, batching and sampler; the run's steps, learning rate, logging and
checkpoints; the host-sync and DDP/FSDP settings that keep a small model's step from waiting on the host."""

from __future__ import annotations

import math
import os

from freetune import params as param_rules  # not `params`: make_config takes a recipe's parameters under that name
from freetune import tracking
from freetune.distributed import COLLECTIVE_TIMEOUT_S, print0
from freetune.errors import FreetuneError
from freetune.plan import Plan
from freetune.plan.sizing import choose_optimizer
from freetune.platform import Paths
from freetune.reach import transformers as transformers_reach
from freetune.speed.batching import PAD_TO


# The recipe parameters make_config reads from `params` (a recipe passes its whole parameters cell; other names are
# ignored). The batch shape, max_length and checkpointing come from the plan, never from params, which hold what was
# asked of the plan (micro_batch 0: "let the plan choose").
RUN_PARAMS = ("max_steps", "learning_rate", "optimizer", "max_grad_norm", "warmup_ratio", "logging_steps", "save_steps",
              "save_total_limit", "seed", "num_epochs", "eval_steps", "report_to")


def make_config(paths: Paths, plan: Plan, params: dict | None = None, **settings):
    """The SFTConfig of a run: the plan's batch (micro_batch x grad_accum), max_length, precision, device,
    checkpointing, batching and sampler; the run's knobs (RUN_PARAMS) from `params`, the recipe's parameters
    (freetune.params.check); any keyword given here over both. Keywords: those of RUN_PARAMS, assistant_only, and
    micro_batch / grad_accum / max_length / gradient_checkpointing to run other than the plan says (benchmarks, tests).

    eval_steps: evaluate the held-out rows every N steps (0: never); report_to: "none", "tensorboard" or "trackio"
    (freetune.tracking). save_total_limit: complete checkpoints kept (at least 2: the newest can be cut short by a
    disconnect while the one before it is what a rerun resumes from). optimizer "auto": the plan's.
    freetune.train.train reads the rest of the plan (batching, sampler, LoRA kernel, compile) from the plan itself.
    """
    run = {name: value for name, value in (params or {}).items() if name in RUN_PARAMS}
    config = _sft_config(paths, plan, **{**run, **settings})
    # train() reads the plan this config was made from (not part of the Trainer's own fields, so not saved by it)
    config.freetune_plan = plan
    return config


def _sft_config(paths: Paths, plan: Plan, *, max_steps: int, learning_rate: float, micro_batch: int | None = None,
                grad_accum: int | None = None, max_length: int | None = None, optimizer: str = "auto",
                max_grad_norm: float = 1.0, warmup_ratio: float = 0.03, logging_steps: int = 1, save_steps: int = 50,
                save_total_limit: int = 3, gradient_checkpointing: bool | None = None, seed: int = 0,
                assistant_only: bool = False, num_epochs: float = 1.0, eval_steps: int = 0, report_to: str = "none"):
    import torch
    from trl import SFTConfig

    micro_batch = plan.batch.micro_batch if micro_batch is None else micro_batch
    grad_accum = plan.batch.grad_accum if grad_accum is None else grad_accum
    max_length = plan.batch.max_length if max_length is None else max_length
    if save_total_limit is None or save_total_limit < 2:
        raise FreetuneError(f"save_total_limit = {save_total_limit}: keep at least 2 checkpoints, so that a session "
                            f"lost while the newest one is written still leaves a complete one to resume from.")
    # The parameters cell was checked against the same rules; library callers get the same messages here
    # (max_steps aside: -1 with num_epochs trains by epochs).
    param_rules.require(grad_accum=grad_accum, learning_rate=learning_rate, max_length=max_length,
                        max_grad_norm=max_grad_norm, logging_steps=logging_steps, save_steps=save_steps, seed=seed)
    if gradient_checkpointing is None:
        gradient_checkpointing = plan.memory.checkpointing
    config = SFTConfig(
        output_dir=paths.checkpoints,
        max_steps=max_steps,
        num_train_epochs=num_epochs,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=grad_accum,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, math.ceil(warmup_ratio * max_steps)) if max_steps > 0 else 0,
        optim=_optimizer(plan, optimizer),
        max_grad_norm=max_grad_norm,
        fp16=plan.precision.mixed == "fp16",
        bf16=plan.precision.mixed == "bf16",
        use_cpu=plan.layout.device == "cpu",
        max_length=max_length,
        # Compiled layers guard on the token count's divisibility by 8 and recompile when it changes; padded
        # batches are padded to a multiple of 8 for that (padding-free ones get batching.AlignedPaddingFree's row).
        pad_to_multiple_of=PAD_TO if plan.kernels.compile and plan.batch.batching != "padding_free" else None,
        assistant_only_loss=assistant_only,
        logging_steps=logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        # Similar lengths in a padded batch: little padding where rows cannot be concatenated (freetune.speed.batching).
        # "rank_balanced" is freetune's own (freetune.speed.sampler), put in by the trainer (FreetuneTrainer).
        train_sampling_strategy="group_by_length" if plan.layout.sampler == "length_grouped" else "random",
        **_checkpointing_fields(plan, gradient_checkpointing),
        **_host_sync_fields(plan),
        **fsdp_settings(plan),
        **tracking.sft_fields(paths, report_to=report_to, eval_steps=eval_steps, micro_batch=micro_batch),
    )
    if plan.layout.device == "cuda" and torch.cuda.device_count() > 1 and "LOCAL_RANK" not in os.environ:
        # One process that sees two GPUs makes the Trainer wrap the model in nn.DataParallel, which SFTTrainer
        # refuses. Inline training uses one GPU; the Kaggle notebook's torchrun cell uses them all.
        transformers_reach.one_gpu_only(config)
        print0(f"{torch.cuda.device_count()} GPUs visible: this inline run uses GPU 0 only. "
               f"The torchrun (DDP) cell trains on all of them.")
    return config


def _optimizer(plan: Plan, optimizer: str) -> str:
    """The Trainer's optim: the plan's for "auto" (freetune.plan.sizing.choose_optimizer); one that runs on a CPU
    there."""
    if optimizer == "auto":
        optimizer = plan.memory.optimizer
    if plan.layout.device == "cpu":
        asked = optimizer
        optimizer = choose_optimizer(optimizer, plan.layout.device, None, None, 0, "all-linear").value
        if optimizer != asked:  # bitsandbytes' paged/8-bit optimisers need CUDA
            print0(f"Optimizer {asked} needs a GPU: using {optimizer} on the CPU.")
    return optimizer


def _checkpointing_fields(plan: Plan, gradient_checkpointing: bool) -> dict:
    return dict(
        gradient_checkpointing=gradient_checkpointing,
        # every_n_layers: only every n-th layer is checkpointed where the plan found room for the others
        # (choices.choose_checkpoint_every); the Trainer passes it to gradient_checkpointing_enable.
        gradient_checkpointing_kwargs={"use_reentrant": False, **(
            {"every_n_layers": plan.memory.checkpoint_every} if plan.memory.checkpoint_every > 1 else {})},
        # The checkpointed layers' inputs wait in pinned host memory (TRL's activation offloading, copies on a
        # stream of their own) when the plan says they take a real share of the GPU (choices.choose_offload).
        activation_offloading=plan.memory.offload_activations and gradient_checkpointing,
    )


def _host_sync_fields(plan: Plan) -> dict:
    return dict(
        # DDP: every LoRA weight gets a gradient each step, so the unused-parameter search is pure overhead;
        # a finite timeout ends the job within minutes when one rank dies.
        ddp_find_unused_parameters=False,
        # No buffer broadcast before every forward: a decoder's buffers (rotary frequencies) never change, and
        # the broadcast is one more point per step where every rank waits for rank 0.
        ddp_broadcast_buffers=False,
        ddp_timeout=COLLECTIVE_TIMEOUT_S,
        dataloader_num_workers=0,
        # No host sync per micro-batch (a QLoRA step of a small model is bound by the host: each sync leaves the GPU
        # idle while the CPU catches up, and under DDP makes every rank wait for the slowest at that point):
        # - the batch goes to the GPU from pinned memory without waiting (a plain .to(device) waits for everything
        #   queued on the GPU first);
        # - no check of each micro-batch's loss for NaN/inf (the Trainer's filter reads it on the host, waiting for
        #   the whole backward and, under DDP, the gradient all-reduce); a NaN loss shows in the log as NaN
        #   rather than being replaced by the average of earlier ones.
        dataloader_pin_memory=plan.layout.device == "cuda",
        accelerator_config={"non_blocking": plan.layout.device == "cuda"},
        logging_nan_inf_filter=False,
    )


def fsdp_settings(plan: Plan) -> dict:
    """The Trainer's FSDP settings for plan.layout.kind == "fsdp" (empty otherwise): the model sharded over the ranks.

    - FSDP1 (fsdp_config version 1): FSDP2 unshards bitsandbytes' Params4bit into plain tensors and breaks the
      packed NF4 weights (bitsandbytes issue #1945, accelerate #3983); FSDP1 with the 4-bit weights stored in the
      compute dtype is the path bitsandbytes and peft document. transformers warns that it is deprecated.
    - full_shard + auto_wrap per decoder layer (the model's _no_split_modules, e.g. Qwen2DecoderLayer); the
      Trainer adds peft's policy that wraps each LoRA layer on its own (LoRA is fp32, the layer 16-bit).
    - use_orig_params=False: the LoRA layers are their own units, so no unit mixes frozen and trainable weights.
    - sync_module_states + cpu_ram_efficient_loading: rank 0's weights are broadcast to every rank, so all
      start identical (rank 0 alone read and quantised them: freetune.model._load_fsdp_rank0_only).
    - FULL_STATE_DICT: a checkpoint's adapter is gathered to rank 0 and written by it alone, the same files
      as a DDP run's (freetune.checkpoint's complete-marker contract is unchanged).
    """
    if plan.layout.kind != "fsdp":
        return {}
    if plan.layout.device != "cuda":
        raise FreetuneError("layout 'fsdp' needs GPUs: accelerate's FSDP plugin refuses a CPU run. Use layout "
                            "'auto' (DDP over CPU processes) here, and FSDP on a machine with several GPUs.")
    return dict(fsdp="full_shard auto_wrap", fsdp_config={
        "version": 1, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "use_orig_params": False,
        "sync_module_states": True, "cpu_ram_efficient_loading": True, "state_dict_type": "FULL_STATE_DICT",
        "limit_all_gathers": True})
