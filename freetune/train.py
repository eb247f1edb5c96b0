"""Training: TRL's SFTTrainer configured from the plan, with what the user needs to see while it runs.

At each log step one line: step, loss, learning rate, tokens/s, memory in use / peak, ETA (tqdm bars are
unreadable in papermill output and in torchrun logs, so they are off). At the end the adapter is saved
(main process only), and a summary (time, tokens, peak memory, first/last loss, adapter path) plus the log
history go to reports/ as JSON; `show_summary` draws the loss and learning-rate plot from them, in the
notebook, also after a torchrun job whose ranks printed elsewhere.

Interruptions (freetune.checkpoint): every checkpoint is complete or ignored, a rerun resumes from the newest
complete one (local, or from the Hub when `hub_checkpoint_repo` is set), and a time budget or SIGTERM stops at a
step end with a final checkpoint; the summary then says `stopped_early` and why.
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from pathlib import Path

from freetune import bnb_cpu, checkpoint, fast, kernels, params, tracking
from freetune.console import duration
from freetune.distributed import COLLECTIVE_TIMEOUT_S, WriteTracer, check_replicas_agree, context, print0
from freetune.errors import FreetuneError
from freetune.model import adapter_dtype_guard
from freetune.platform import Paths
from freetune.preflight import Plan, choose_optimizer

SUMMARY_FILE = "run_summary.json"
HISTORY_FILE = "log_history.json"


def memory_gib() -> tuple[float, float, str]:
    """(in use, peak, what was measured): GPU memory allocated by torch, or the process's RSS on a CPU."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return (torch.cuda.memory_allocated() / 2**30, torch.cuda.max_memory_allocated() / 2**30, "GPU")
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:
        rss = peak
    return rss, peak, "RAM"


def make_config(paths: Paths, plan: Plan, *, max_steps: int, micro_batch: int, grad_accum: int,
                learning_rate: float, max_length: int, optimizer: str = "auto",
                max_grad_norm: float = 1.0, warmup_ratio: float = 0.03, logging_steps: int = 1,
                save_steps: int = 50, save_total_limit: int = 3, gradient_checkpointing: bool | None = None,
                seed: int = 0, assistant_only: bool = False, num_epochs: float = 1.0, eval_steps: int = 0,
                report_to: str = "none"):
    """An SFTConfig that follows the plan's precision and device; every knob here is a recipe parameter.

    eval_steps: evaluate the held-out rows every N steps (0: never); report_to: "none", "tensorboard" or "trackio"
    (freetune.tracking).

    save_total_limit: complete checkpoints kept (at least 2: the newest can be cut short by a disconnect while
    the one before it is what a rerun resumes from).
    gradient_checkpointing: None follows the plan (off only when the batch fits without it).
    The plan's batching and sampler (freetune.fast) ride along on the config: "length_grouped" sets the Trainer's
    length-grouped sampler here, "rank_balanced" is put in by fast.trainer_class, "padding_free" switches the
    collator once train() has built the trainer.
    """
    import torch
    from trl import SFTConfig

    if save_total_limit is None or save_total_limit < 2:
        raise FreetuneError(f"save_total_limit = {save_total_limit}: keep at least 2 checkpoints, so that a session "
                            f"lost while the newest one is written still leaves a complete one to resume from.")
    # The parameters cell was checked against the same rules; library callers get the same messages here
    # (max_steps aside: -1 with num_epochs trains by epochs).
    params.require(grad_accum=grad_accum, learning_rate=learning_rate, max_length=max_length,
                   max_grad_norm=max_grad_norm, logging_steps=logging_steps, save_steps=save_steps, seed=seed)

    if optimizer == "auto":
        optimizer = plan.optimizer  # the plan's choice (freetune.preflight.choose_optimizer)
    if plan.device == "cpu":
        asked = optimizer
        optimizer, _ = choose_optimizer(optimizer, plan.device, None, None, 0, "all-linear")
        if optimizer != asked:  # bitsandbytes' paged/8-bit optimisers need CUDA
            print0(f"Optimizer {asked} needs a GPU: using {optimizer} on the CPU.")
    if gradient_checkpointing is None:
        gradient_checkpointing = plan.gradient_checkpointing
    config = SFTConfig(
        output_dir=paths.checkpoints,
        max_steps=max_steps,
        num_train_epochs=num_epochs,
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=grad_accum,
        learning_rate=learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, math.ceil(warmup_ratio * max_steps)) if max_steps > 0 else 0,
        optim=optimizer,
        max_grad_norm=max_grad_norm,
        fp16=plan.mixed_precision == "fp16",
        bf16=plan.mixed_precision == "bf16",
        use_cpu=plan.device == "cpu",
        gradient_checkpointing=gradient_checkpointing,
        # every_n_layers: only every n-th layer is checkpointed where the plan found room for the others
        # (preflight.choose_checkpoint_every); the Trainer passes it to gradient_checkpointing_enable.
        gradient_checkpointing_kwargs={"use_reentrant": False, **(
            {"every_n_layers": plan.checkpoint_every} if plan.checkpoint_every > 1 else {})},
        max_length=max_length,
        # Compiled layers guard on the token count's divisibility by 8 and recompile when it changes; padded
        # batches are padded to a multiple of 8 for that (padding-free ones get fast.AlignedPaddingFree's row).
        pad_to_multiple_of=fast.PAD_TO if plan.compile and plan.batching != "padding_free" else None,
        assistant_only_loss=assistant_only,
        logging_steps=logging_steps,
        logging_first_step=True,
        save_strategy="steps",
        save_steps=save_steps,
        save_total_limit=save_total_limit,
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
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
        dataloader_pin_memory=plan.device == "cuda",
        accelerator_config={"non_blocking": plan.device == "cuda"},
        logging_nan_inf_filter=False,
        # Similar lengths in a padded batch: little padding where rows cannot be concatenated (freetune.fast).
        # "rank_balanced" is freetune's own (fast.RankBalancedSampler), put in by the trainer class.
        train_sampling_strategy="group_by_length" if plan.sampler == "length_grouped" else "random",
        # The checkpointed layers' inputs wait in pinned host memory (TRL's activation offloading, copies on a
        # stream of their own) when the plan says they take a real share of the GPU (preflight.choose_offload).
        activation_offloading=plan.offload_activations and gradient_checkpointing,
        **fsdp_settings(plan),
        **tracking.sft_fields(paths, report_to=report_to, eval_steps=eval_steps, micro_batch=micro_batch),
    )
    config.freetune_batching = plan.batching  # read by train(); TRL's own padding_free refuses max_length
    config.freetune_sampler = plan.sampler  # read by fast.trainer_class
    config.freetune_lora_kernel = plan.lora_kernel  # read by train(), once the adapter is attached
    config.freetune_compile = plan.compile
    config.freetune_policy = plan.policy  # which variable-length attention kernels train() may probe
    config.freetune_loss_tile_tokens = plan.loss_tile_tokens
    if plan.device == "cuda" and torch.cuda.device_count() > 1 and "LOCAL_RANK" not in os.environ:
        # One process that sees two GPUs makes the Trainer wrap the model in nn.DataParallel, which SFTTrainer
        # refuses. Inline training uses one GPU; the Kaggle notebook's torchrun cell uses them all.
        _ = config.device
        config._n_gpu = 1
        print0(f"{torch.cuda.device_count()} GPUs visible: this inline run uses GPU 0 only. "
               f"The torchrun (DDP) cell trains on all of them.")
    return config


def fsdp_settings(plan: Plan) -> dict:
    """The Trainer's FSDP settings for plan.layout == "fsdp" (empty otherwise): the model sharded over the ranks.

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
    if plan.layout != "fsdp":
        return {}
    if plan.device != "cuda":
        raise FreetuneError("layout 'fsdp' needs GPUs: accelerate's FSDP plugin refuses a CPU run. Use layout "
                            "'auto' (DDP over CPU processes) here, and FSDP on a machine with several GPUs.")
    return dict(fsdp="full_shard auto_wrap", fsdp_config={
        "version": 1, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "use_orig_params": False,
        "sync_module_states": True, "cpu_ram_efficient_loading": True, "state_dict_type": "FULL_STATE_DICT",
        "limit_all_gathers": True})


class ProgressPrinter:
    """A TrainerCallback printing one readable line per log step (built lazily: transformers imports late)."""

    def __new__(cls, total_steps: int):
        from transformers import TrainerCallback

        class _Printer(TrainerCallback):
            def __init__(self):
                self.start = None
                self.last = None

            def on_train_begin(self, args, state, control, **kwargs):
                self.start = time.time()
                self.first_step = state.global_step  # > 0 after a resume: the ETA counts this session's steps
                self.last = (self.start, state.global_step, None)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if state.is_world_process_zero and logs and "eval_loss" in logs:
                    print(f"step {state.global_step:>5}/{total_steps}  eval loss {logs['eval_loss']:.4f}  "
                          f"(held-out rows)", flush=True)
                if not state.is_world_process_zero or not logs or "loss" not in logs:
                    return
                now = time.time()
                used, peak, where = memory_gib()
                tokens = logs.get("num_tokens")
                t0, step0, tokens0 = self.last
                rate = ""
                if tokens is not None and tokens0 is not None and now > t0:
                    rate = f"{(tokens - tokens0) / (now - t0):8.0f} tok/s"
                done = max(state.global_step - self.first_step, 1)
                eta = (now - self.start) / done * max(total_steps - state.global_step, 0)
                print(f"step {state.global_step:>5}/{total_steps}  loss {logs['loss']:.4f}  "
                      f"lr {logs.get('learning_rate', 0):.2e}  {rate}  {where} {used:.2f}/{peak:.2f} GiB  "
                      f"ETA {duration(eta)}", flush=True)
                self.last = (now, state.global_step, tokens)

        return _Printer()


# fp16 AMP skips a step whose gradients overflow (the weights stay as they were) and halves its loss scale, from
# 65,536: a few such steps at the start are the scale finding its level. A scale fallen this far (16 halvings)
# means fp16 cannot hold these gradients at all.
MIN_FP16_LOSS_SCALE = 1.0


class NonFiniteGuard:
    """A TrainerCallback that stops the run at the first log step whose loss (or gradient norm) is NaN or inf, and
    keeps that step from being saved. The values are the ones the log step already copied to the host: no sync of
    its own (the Trainer's per-micro-batch NaN filter is off for that reason, see make_config). Under fp16 AMP an
    infinite gradient norm is a skipped step, a problem only once the loss scale has collapsed. `.reason` says
    what it saw (None: nothing)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Guard(TrainerCallback):
            reason: str | None = None

            def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
                logs = logs or {}
                loss, norm = logs.get("loss"), logs.get("grad_norm")
                bad = [f"the loss is {loss}"] if loss is not None and not math.isfinite(loss) else []
                if norm is not None and not math.isfinite(norm):
                    scaler = getattr(optimizer, "scaler", None)  # accelerate's AcceleratedOptimizer under fp16
                    scale = scaler.get_scale() if scaler is not None and scaler.is_enabled() else None
                    if scale is None or scale < MIN_FP16_LOSS_SCALE:
                        bad.append(f"the gradient norm is {norm}" +
                                   (f" with fp16's loss scale down to {scale:g}" if scale is not None else ""))
                if bad and self.reason is None:
                    self.reason = f"at step {state.global_step} " + " and ".join(bad)
                    control.should_training_stop = True
                    control.should_save = False  # the log comes before the save of the same step
                return control

        return _Guard()


def nonfinite_advice(problem: str, config, checkpoints_dir: str) -> str:
    """What stopped the run, what was kept, and what to change."""
    kept = checkpoint.latest_complete(checkpoints_dir)
    kept_text = (f"The newest good checkpoint, {kept.name}, is kept" if kept else
                 "No checkpoint was saved before it")
    lr = config.learning_rate
    fp16 = (" This run computes in fp16, whose largest number is 65,504: on a GPU with bf16 (Ampere or newer: A100, "
            "L4, A10, RTX 30xx/40xx; a T4 has none) set precision='bf16'." if config.fp16 else "")
    return (f"Training stopped: {problem} (the numbers overflowed). {kept_text}; nothing after it was saved, and no "
            f"adapter was written. Lower learning_rate (now {lr:g}; try {lr / 4:g}).{fp16} Then run again with a new "
            f"run_name (a resume goes on with the learning rate its checkpoint was saved with).")


def train(model, tokenizer, train_dataset, config, *, paths: Paths, eval_dataset=None, resume: bool = True,
          extra_callbacks=(), time_budget_min: float = 0, hub_checkpoint_repo: str = "", hub_api=None):
    """Run SFTTrainer, save the adapter (main process), write the summary; returns the summary dict.

    resume: continue from the newest complete checkpoint of this run (paths.checkpoints, or the Hub).
    time_budget_min: stop and save after this many minutes; 0 = the platform's session limit minus a margin
        (Colab/Kaggle), none locally. SIGTERM stops and saves the same way (under DDP one step later: the ranks
        agree on it without waiting for the GPU, checkpoint.StopAgreement).
    hub_checkpoint_repo: a private Hub repo ("you/some-repo") that receives each complete checkpoint; "" = off.
        Needs HF_TOKEN (Colab/Kaggle secrets or the environment): missing, it fails here, before any training.
    hub_api: a huggingface_hub.HfApi-like object to use instead of a real one (tests).
    """
    import torch
    from trl import SFTTrainer

    if len(train_dataset) == 0:
        raise FreetuneError("No training rows left (after cleaning). Check the data set and the audit above.")
    if config.eval_strategy == "no":
        eval_dataset = None  # not evaluated: not tokenised either
    elif not eval_dataset:
        raise FreetuneError(f"eval_steps={config.eval_steps} needs held-out rows to evaluate: set eval_rows (e.g. 16), "
                            f"or eval_steps to 0.")
    ctx = context()
    budget_s, budget_text = checkpoint.time_budget(time_budget_min, paths.platform)
    hub = None
    if hub_checkpoint_repo and ctx.is_main:  # only the main process talks to the Hub
        hub = checkpoint.HubSync.connect(hub_checkpoint_repo, run_name=Path(paths.run_dir).name,
                                         keep=config.save_total_limit, api=hub_api)
    if not resume and checkpoint.latest_complete(paths.checkpoints) is not None:
        raise FreetuneError(f"{paths.checkpoints} holds checkpoints of an earlier run and resume is off: new ones "
                            f"would mix with them. Change run_name to start fresh, or resume.")
    stopper = checkpoint.stop_callback(budget_s, budget_text)
    guard = NonFiniteGuard()
    print0(f"Preparing {len(train_dataset):,} rows for training (tokenising, masking what is not trained on, "
           f"cutting to max_length) ...")
    # fast.trainer_class: TRL's per-micro-batch metric syncs happen once per log step instead.
    trainer = checkpoint.trainer_class(fast.trainer_class(SFTTrainer))(
        model=model, args=config, train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
        callbacks=[adapter_dtype_guard(),  # LoRA stays fp32: TRL casts it to bf16, fatal on a T4
                   ProgressPrinter(config.max_steps), guard, tracking.overfit_watch(), stopper, *extra_callbacks],
        hub=hub)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # it prints raw log dicts; ProgressPrinter prints one clean line
    if eval_dataset is not None:
        bnb_cpu.keep_training_layout(trainer.model)  # evaluations between steps must not repack it for inference
    fast.apply_batching(trainer, getattr(config, "freetune_batching", "padded"))
    if getattr(config, "freetune_sampler", "") == "rank_balanced" and trainer.args.world_size > 1:
        print0(f"Sampler: each optimizer step's rows are dealt to the {trainer.args.world_size} ranks by length, "
               f"equal tokens per rank (freetune.fast.RankBalancedSampler).")
    if getattr(config, "freetune_lora_kernel", "peft") == "fused":
        fused, seen = kernels.use_fused_lora(trainer.model)
        print0(f"LoRA kernel: fused on {fused} of {seen} LoRA layers (freetune.kernels).")
    set_loss_tile_tokens(getattr(config, "freetune_loss_tile_tokens", 0))
    if torch.cuda.is_available() and getattr(config, "freetune_batching", "") == "padding_free":
        # Probed now, eagerly, in this process (a torchrun rank too): the attention layers only read the result.
        fast.varlen_works(torch.cuda.current_device(), getattr(config, "freetune_policy", "ampere"))
    if getattr(config, "freetune_compile", False):
        compiled = kernels.compile_layers(trainer.model)
        print0(f"torch.compile: {compiled} decoder layers; the first steps are slower while they compile.")
    print0(f"Checkpoints: every {config.save_steps} steps, the last {config.save_total_limit} kept, in "
           f"{paths.checkpoints}. Time budget: {budget_text}.")
    resume_from = checkpoint.agree_on_resume(paths.checkpoints, config.max_steps, hub) if resume else None
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # make_config's ddp_broadcast_buffers=False is meant: torch 2.13 deprecates the name for forward_sync_buffers,
    # which the older torch of Colab and Kaggle does not have.
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    start = time.time()
    try:
        with checkpoint.sigterm_stops(stopper):
            result = trainer.train(resume_from_checkpoint=resume_from)
    finally:
        if hub is not None:
            hub.close()
        kernels.uncompile_layers(trainer.model)  # the model may go on to generate: eager layers for that
    wall = time.time() - start
    problem = guard.reason or trainer.nonfinite_weights_at
    if problem is None and not checkpoint.weights_finite(trainer.model):  # overflowed after the last log step
        problem = f"after step {trainer.state.global_step} the adapter's weights hold NaN or inf"
    if problem:
        raise FreetuneError(nonfinite_advice(problem, config, paths.checkpoints))
    sharded = bool(getattr(config, "fsdp", None))
    if sharded:
        # FSDP keeps one copy of the adapter, split over the ranks: there are no replicas to compare (each rank's
        # shard differs by design), and gathering the whole model to compare would undo the sharding.
        print0("FSDP: one adapter, sharded over the ranks; it is gathered to rank 0 for the save below.")
    else:
        check_replicas_agree(trainer.model)

    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    tokens = max((h.get("num_tokens", 0) for h in trainer.state.log_history), default=0)  # the whole run's
    # This session's share: after a resume the Trainer's training_loss divides this session's loss sum by every
    # step of the run, and the run's tokens over this session's time would overstate the rate.
    steps_here = trainer.state.global_step - trainer.resumed_at
    tokens_here = tokens - trainer.tokens_at_resume
    _, peak, where = memory_gib()
    summary = {
        "steps": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "steps_this_session": steps_here,
        "stopped_early": stopper.reason,  # None, or why it stopped before max_steps (a rerun continues)
        "resumed_from": Path(resume_from).name if resume_from else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        # the mean loss of this session's steps (None when it trained none)
        "train_loss": result.training_loss * trainer.state.global_step / steps_here if steps_here else None,
        "wall_s": round(wall, 2),
        "tokens": int(tokens),
        "tokens_per_s": round(tokens_here / wall, 1) if wall > 0 and steps_here else None,
        "peak_memory_gib": round(peak, 3),
        "peak_memory_of": where,
        "world_size": trainer.args.world_size,
        "adapter": paths.adapter,
        **tracking.eval_summary(trainer.state.log_history),
    }
    if sharded or trainer.is_world_process_zero():
        # Under FSDP gathering the adapter is a collective: every rank takes part, the Trainer writes on rank 0 only.
        trainer.save_model(paths.adapter)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(paths.adapter)
        reports = Path(paths.reports)
        (reports / HISTORY_FILE).write_text(json.dumps(trainer.state.log_history, indent=1))
        (reports / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True))
    if stopper.reason:
        print0(f"Stopped early at step {summary['steps']} of {summary['max_steps']} ({stopper.reason}). The adapter so "
               f"far is in {paths.adapter}; run this again with the same run_name to continue from the checkpoint.")
    if WriteTracer.active is not None:
        WriteTracer.active.report(context().rank, paths.run_dir)
    return summary


def set_loss_tile_tokens(tokens: int) -> None:
    """Tokens per tile of TRL's chunked loss head (trl.kernels.chunked_logprob.TOKEN_CHUNK_SIZE, read at every call;
    written against TRL 1.16). Each tile holds tokens x 32,768 logits in the compute dtype: 256 MiB at TRL's 4,096
    tokens, a real share of a 4 GB card; smaller tiles only mean more, smaller matmuls. 0 keeps TRL's."""
    if tokens:
        import trl.kernels.chunked_logprob as chunked

        chunked.TOKEN_CHUNK_SIZE = int(tokens)


def latest_checkpoint(checkpoints_dir: str) -> str | None:
    """The newest complete checkpoint (one whose completion marker vouches for every file), or None."""
    found = checkpoint.latest_complete(checkpoints_dir)
    return str(found) if found else None


def show_summary(paths: Paths) -> dict:
    """Print the run summary and draw loss / learning rate against step (works after a torchrun job too)."""
    reports = Path(paths.reports)
    summary_path = reports / SUMMARY_FILE
    if not summary_path.exists():
        raise FreetuneError(f"No training summary at {summary_path}: the training step did not finish. "
                            f"Scroll up to its error, fix it, and run the training cell again (it resumes).")
    summary = json.loads(summary_path.read_text())
    history = json.loads((reports / HISTORY_FILE).read_text())
    session = ""
    if summary.get("resumed_from"):
        session = f" ({summary.get('steps_this_session')} of them in this session, from {summary['resumed_from']})"
    rate = f"{summary['tokens_per_s']} tok/s" if summary.get("tokens_per_s") else "no step trained in this session"
    print(f"Trained {summary['steps']} steps{session} in {duration(summary['wall_s'])} on {summary['world_size']} "
          f"process(es): {summary['tokens']:,} tokens ({rate}), peak "
          f"{summary['peak_memory_of']} {summary['peak_memory_gib']:.2f} GiB, loss {summary['first_loss']:.4f} -> "
          f"{summary['last_loss']:.4f}. Adapter: {summary['adapter']}")
    evals = tracking.eval_points(history)
    if evals:
        print(f"Held-out (eval) loss: {evals[0][1]:.4f} at step {evals[0][0]} -> {evals[-1][1]:.4f} at step "
              f"{evals[-1][0]} (best {summary['best_eval_loss']:.4f} at step {summary['best_eval_step']}).")
    if summary.get("overfitting"):
        print(f"WARNING: {summary['overfitting']}")
    fig = loss_figure(history)
    if fig is not None:
        import matplotlib.pyplot as plt

        fig.savefig(reports / "loss.png", dpi=90)
        if _in_notebook():
            plt.show()
        plt.close(fig)
    return summary


def loss_figure(history: list[dict]):
    """Training and held-out loss, and the learning rate, against step (None when nothing was logged)."""
    points = [(h["step"], h["loss"], h.get("learning_rate")) for h in history if "loss" in h]
    if not points:
        return None
    import matplotlib

    if "ipykernel" not in os.environ.get("MPLBACKEND", "") and not _in_notebook():
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_lr) = plt.subplots(1, 2, figsize=(10, 3.2))
    steps = [p[0] for p in points]
    ax_loss.plot(steps, [p[1] for p in points], marker=".", label="training")
    evals = tracking.eval_points(history)
    if evals:
        ax_loss.plot([e[0] for e in evals], [e[1] for e in evals], marker="o", label="held-out (eval)")
        ax_loss.legend()
    ax_loss.set(title="loss", xlabel="step")
    ax_lr.plot(steps, [p[2] or 0 for p in points], color="tab:orange")
    ax_lr.set(title="learning rate", xlabel="step")
    fig.tight_layout()
    return fig


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython

        return get_ipython() is not None and "IPKernelApp" in get_ipython().config
    except ImportError:
        return False
