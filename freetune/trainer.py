"""FreetuneTrainer: TRL's SFTTrainer with every change freetune makes to how it trains, in one class.

Each method overrides one of transformers' Trainer or TRL's SFTTrainer, most of them private, and is tagged with the
release it was written against (`@written_against`; freetune.reach.versions.check_overridden refuses, at import, a tag
whose method the installed library no longer has, and check_versions warns when the releases differ from the
pins in pyproject.toml). The libraries' other internals freetune touches are in freetune/reach/, one module per
library. What changes:
- metrics without host syncs: TRL reads its per-micro-batch entropy, token-accuracy and token-count metrics on the
  host three times per micro-batch (a device sync each, and under DDP a gather each); here the same sums stay on
  the GPU and are read once per log step (compute_loss, log);
- padding-free batches: the collator switched at construction (freetune.reach.trl.apply_batching), the alignment
  padding's count taken out of each batch before the model sees it (_prepare_inputs);
- the rank-balanced sampler under torchrun (_get_train_sampler, freetune.speed.sampler);
- complete-or-ignored checkpoints: every rank's share written, then the marker, then the rotation, and no save of
  NaN weights (_save_checkpoint, _save_rng_state; freetune.checkpoint);
- resume: the token count, a finished run's rerun, the adapter's dtype, DDP on CPUs (_init_training_state,
  _run_epoch, _load_from_checkpoint, _load_optimizer_and_scheduler);
- no walk over every module of the model at every step: the parameter count of the FLOPs estimate counted once
  (floating_point_ops), the gradient clipping given the trainable parameters (_clip_grad_norm);
- bitsandbytes' 8-bit AdamW with a launch per 16 MiB of LoRA weights instead of a launch and a host sync per LoRA
  weight (create_optimizer, freetune.speed.optimizer).
The plan (freetune.plan.Plan) says which batching and sampler; freetune.train.train builds this trainer and adds
GarbageFrozenAfterWarmup (below), a callback that keeps Python's garbage collector off what the first steps leave.
"""

from __future__ import annotations

import gc
import os
import random
from pathlib import Path

import numpy as np
import torch
from transformers import TrainerCallback
from trl import SFTTrainer

from freetune.checkpoint import identity, marker
from freetune.checkpoint.hub import TOKENIZER_DIR  # beside the checkpoint-N folders: the run's tokenizer, once
from freetune.distributed import barrier
from freetune.reach import peft_bnb as peft_bnb_reach
from freetune.reach import trl as trl_reach
from freetune.reach.torch import set_last_lrs
from freetune.reach.versions import check_overridden, written_against
from freetune.speed import optimizer as one_launch_optimizer
from freetune.speed.batching import PAD_KEY
from freetune.speed.sampler import rank_balanced_sampler


class FreetuneTrainer(SFTTrainer):
    """SFTTrainer with freetune's metrics, batching, sampler, checkpoints and resume (the module docstring says what
    and why). plan: the run's freetune.plan.Plan (None: TRL's own batching and sampler); hub: a
    freetune.checkpoint.HubSync that uploads each complete checkpoint (main process only)."""

    resumed_at = 0  # the step this session started from (0, or the checkpoint's step)
    tokens_at_resume = 0  # TRL's num_tokens count at that step
    nonfinite_weights_at: str | None = None  # set when a save found NaN/inf weights (nothing was written)
    _sums = None  # device tensor: label tokens, entropy sum, top-1 hits, real input tokens (padded batches)
    _host = (0, 0)  # counts known without asking the GPU: real tokens of padding-free batches, computed tokens
    _pad_tokens = 0  # AlignedPaddingFree's count for the batch being computed (metrics only)

    def __init__(self, *args, plan=None, hub=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.plan, self.hub = plan, hub
        if self.eval_dataset is not None:
            # evaluations between steps must not repack it for inference
            peft_bnb_reach.keep_training_layout(self.model)
        trl_reach.apply_batching(self, plan.batch.batching if plan is not None else "padded")

    # ---- metrics, read once per log step ----------------------------------------------------------------------

    def _fast_loss_applies(self) -> bool:
        pc = getattr(self.accelerator, "parallelism_config", None)
        return (self.model.training and self.compute_loss_func is None and self.label_smoother is None
                and self.args.loss_type == "nll" and not self.aux_loss_enabled
                and not (pc is not None and getattr(pc, "sp_enabled", False)))

    @written_against("transformers 5.17")
    def _prepare_inputs(self, inputs):
        # Every path to the model (training step, evaluation, with or without labels) comes through here:
        # the count leaves the batch before any model call could receive it as an argument.
        self._pad_tokens = inputs.pop(PAD_KEY, 0) if hasattr(inputs, "pop") else 0
        return super()._prepare_inputs(inputs)

    @written_against("TRL 1.16")
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        pad, self._pad_tokens = self._pad_tokens, 0
        if not self._fast_loss_applies():
            return super().compute_loss(model, inputs, return_outputs=return_outputs,
                                        num_items_in_batch=num_items_in_batch)
        # TRL 1.16's own nll branch (SFTTrainer.compute_loss), line for line, without its .item() calls and gathers.
        inputs["use_cache"] = False
        outputs = model(**inputs, fused_lm_head=True)
        per_token_loss = -outputs.log_probs  # zero on ignored positions
        num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        with torch.no_grad():
            # No torch.tensor(python number, device=cuda) here: a host-to-device copy waits for the GPU too.
            padded = "attention_mask" in inputs
            seen = inputs["attention_mask"].sum() if padded else outputs.label_mask.new_zeros(())
            sums = torch.stack([outputs.label_mask.sum().float(), outputs.entropy.detach().sum().float(),
                                outputs.is_top1.sum().float(), seen.float()])
            self._sums = sums if self._sums is None else self._sums + sums
            host_seen = 0 if padded else inputs["position_ids"].size(1) - pad
            self._host = (self._host[0] + host_seen, self._host[1] + inputs["input_ids"].numel())
        return (loss, outputs) if return_outputs else loss

    @written_against("TRL 1.16")
    def log(self, logs, start_time=None):
        # TRL 1.16 keeps its metrics in self._metrics["train"] and its token count in self._total_train_tokens.
        if self._sums is not None and self.model.training:
            # One gather and one device sync per log step, instead of four per micro-batch.
            sums = torch.cat([self._sums, self._sums.new_tensor(self._host)])  # one small copy per log step
            if self.accelerator.num_processes > 1:
                sums = self.accelerator.reduce(sums, reduction="sum")
            valid, entropy, correct, seen_padded, seen_free, computed = sums.tolist()
            seen = seen_padded + seen_free
            self._sums, self._host = None, (0, 0)
            self._total_train_tokens += int(seen) // self._tp_size
            metrics = self._metrics["train"]
            metrics["entropy"] = [entropy / valid if valid > 0 else 0.0]
            metrics["mean_token_accuracy"] = [correct / valid if valid > 0 else 0.0]
            metrics["num_tokens"] = [self._total_train_tokens]
            # Share of the tokens run through the model that were padding (0 when padding-free).
            metrics["pad_fraction"] = [1 - seen / computed if computed else 0.0]
        return super().log(logs, start_time)

    # ---- per-step host work that does not change during a run ------------------------------------------------------

    _parameter_count = None  # (the model, its parameters without the embeddings)
    _trainable = None  # (the model as the training loop holds it, its trainable parameters)

    @written_against("transformers 5.17")
    def floating_point_ops(self, inputs):
        # transformers counts the model's parameters for this estimate at every micro-batch, walking every module
        # of the model (~1,000 for a 4-bit LoRA model): host time on a step bound by the host. The count is taken
        # once; the estimate is the same.
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs or not hasattr(self.model, "num_parameters"):
            return super().floating_point_ops(inputs)
        if self._parameter_count is None or self._parameter_count[0] is not self.model:
            self._parameter_count = (self.model, self.model.num_parameters(exclude_embeddings=True))
        return 6 * inputs[main].numel() * self._parameter_count[1]

    def _parameters_whole(self) -> bool:
        """Each process holds the parameters as the model made them: one process or DDP, not FSDP or DeepSpeed, which
        keep them in flat tensors of their own (and clip and step their own way)."""
        from accelerate.utils import DistributedType

        plain = (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)
        return self.accelerator.distributed_type in plain

    @written_against("transformers 5.17")
    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self._parameters_whole():
            self.optimizer = one_launch_optimizer.one_launch(optimizer)
        return self.optimizer

    def release_optimizer_state(self) -> None:
        """Free the optimizer's moments once training is over (freetune.train, before it undoes the speed-ups):
        2 bytes a LoRA value with 8-bit AdamW, 8 with fp32 AdamW, that would otherwise hold the GPU for whatever runs
        next in the process (generation, evaluation). A resume reads the moments from the last checkpoint;
        freetune.train makes a Trainer per run, and this one's optimizer is dropped rather than left without its
        moments."""
        if self.optimizer is None:
            return
        # accelerate's AcceleratedOptimizer wraps the optimizer the Trainer made
        one_launch_optimizer.release_state(getattr(self.optimizer, "optimizer", self.optimizer))
        self.optimizer = self.lr_scheduler = None

    @written_against("transformers 5.17")
    def _clip_grad_norm(self, model):
        # transformers hands accelerate model.parameters() at every step (every module walked again); only the
        # trainable ones have gradients, so the norm and the clipping are those of the list kept from the first step.
        # FSDP and DeepSpeed clip their own way (accelerate compares the list with the model's parameters there).
        if not self._parameters_whole() or self._has_mixed_mesh_grads(model):
            return super()._clip_grad_norm(model)
        if self._trainable is None or self._trainable[0] is not model:
            self._trainable = (model, [p for p in model.parameters() if p.requires_grad])
        return self.accelerator.clip_grad_norm_(self._trainable[1], self.args.max_grad_norm)

    # ---- which rows each rank gets ----------------------------------------------------------------------------

    @written_against("transformers 5.17")
    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        plan = self.plan
        if plan is not None and plan.layout.sampler == "rank_balanced" and "input_ids" in getattr(
                dataset, "column_names", ()):
            return rank_balanced_sampler(dataset, self.args, group_by_length=plan.batch.batching == "grouped")
        return super()._get_train_sampler(train_dataset)

    # ---- resume ---------------------------------------------------------------------------------------------------

    @written_against("transformers 5.17")
    def _init_training_state(self, *args, **kwargs):
        trained = super()._init_training_state(*args, **kwargs)
        # After a resume the state is the checkpoint's. TRL's token counter starts at 0 in every process;
        # it goes on from the checkpoint's count instead, so the logged num_tokens (and the summary's token
        # count) are the whole run's, as in an uninterrupted run.
        self.resumed_at = self.state.global_step
        self.tokens_at_resume = max((h.get("num_tokens", 0) for h in self.state.log_history), default=0)
        if hasattr(self, "_total_train_tokens"):
            self._total_train_tokens = self.tokens_at_resume
        return trained

    @written_against("transformers 5.17")
    def _run_epoch(self, *args, **kwargs):
        # transformers 5.17 starts an optimizer step before it compares global_step with max_steps. Resumed
        # from a checkpoint at max_steps (a rerun of a finished notebook; a session that died after the last
        # checkpoint but before the adapter was saved) it trained one step past the end and saved
        # checkpoint-(max_steps + 1), at every rerun. Nothing is left to train: the epoch is skipped, and
        # the Trainer ends as after a full run (the checkpoint's adapter is in the model, to be saved).
        if self.state.global_step >= self.state.max_steps:
            self.control.should_training_stop = True
            return
        return super()._run_epoch(*args, **kwargs)

    @written_against("transformers 5.17")
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # peft's load_adapter upcasts a 16-bit adapter to fp32 (autocast_adapter_dtype) whatever dtype the run
        # trains it in (fp32 behind freetune.model.adapter_dtype_guard; bf16 where TRL's cast is left alone).
        # Seen with the bf16 adapter: the resumed run computed in fp32 and drifted from the uninterrupted one.
        target = model if model is not None else self.model
        dtypes = {name: p.dtype for name, p in target.named_parameters() if p.requires_grad}
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        for name, param in target.named_parameters():
            if name in dtypes and param.dtype != dtypes[name]:
                param.data = param.data.to(dtypes[name])

    @written_against("transformers 5.17")
    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint and self.args.world_size > 1 and self.args.device.type == "cpu":
            # DDP on CPUs (gloo, as in CI): transformers maps the optimizer state to args.device, "cpu:0",
            # which torch.load cannot restore to. The same files, loaded onto the CPU.
            folder = Path(checkpoint)
            self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu",
                                                      weights_only=True))
            self.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint:
            self._schedule_from_here()

    def _schedule_from_here(self) -> None:
        # The loaded scheduler state holds the learning rate its last step computed with the checkpoint's settings,
        # and the optimizer's param groups that rate: the first resumed step trained (and logged) at it. With a
        # raised max_steps that was the old schedule's end, 0.0, where an uninterrupted run had 1.22e-02. The rate
        # of this step is computed again from this run's schedule (max_steps, warmup) and learning_rate (a changed
        # one is applied, freetune.checkpoint.identity says why); unchanged settings give the same float as before.
        scheduler = getattr(self.lr_scheduler, "scheduler", self.lr_scheduler)  # accelerate's wrapper, if any
        if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
            return
        scheduler.base_lrs = [self.args.learning_rate for _ in scheduler.base_lrs]
        rates = [base * rate(scheduler.last_epoch) for base, rate in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
        for group, lr in zip(scheduler.optimizer.param_groups, rates):
            group["initial_lr"] = self.args.learning_rate
            if torch.is_tensor(group["lr"]):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr
        set_last_lrs(scheduler, rates)

    # ---- checkpoints: rank 0 writes everything, and marks each one complete ---------------------------------------

    @written_against("transformers 5.17")
    def _save_checkpoint(self, model, trial):
        # The loss is checked at log steps only (freetune.reach.transformers.NonFiniteGuard); a save between them must
        # not write weights an overflow has already poisoned, or the resume would go on from them.
        if not marker.weights_finite(model):
            self.nonfinite_weights_at = f"at step {self.state.global_step} the adapter's weights hold NaN or inf"
            self.control.should_training_stop = True
            return
        folder = Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}"
        if self.args.should_save:
            (folder / marker.MARKER).unlink(missing_ok=True)  # a folder being (re)written is never complete
        # The Trainer's own rotation runs before anything could mark the new checkpoint complete, counts
        # interrupted saves and sorts by mtime; it is switched off here and `rotate` runs after the marker.
        # The tokenizer is the same at every step: it is saved once per run (save_tokenizer_once), not copied into
        # every checkpoint (7-19 MB each, three kept, on Colab's, Kaggle's and Drive's small disks).
        keep, self.args.save_total_limit = self.args.save_total_limit, None
        tokenizer, self.processing_class = self.processing_class, None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit, self.processing_class = keep, tokenizer
        if self.args.should_save:
            identity.copy_into(folder)
            save_tokenizer_once(tokenizer, folder.parent)
        barrier()  # every rank has written its share (and sent its RNG state) before the marker says so
        if self.args.should_save:
            marker.write_marker(folder, self.state.global_step, self.args.world_size)
            busy = self.hub.busy() if self.hub else set()
            marker.rotate(folder.parent, keep or 0, protect=busy)
            if self.hub:
                self.hub.submit(folder)

    @written_against("transformers 5.17")
    def _save_rng_state(self, output_dir):
        if self.args.world_size <= 1:
            return super()._save_rng_state(output_dir)
        # Every rank has its own RNG state, but only the main process writes files: gather them, and rank 0
        # writes rng_state_{rank}.pth for each, the names the Trainer's loader reads on each rank.
        import torch.distributed as dist

        state = {"python": random.getstate(), "numpy": np.random.get_state(),
                 "cpu": torch.random.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.random.get_rng_state_all()
        everyone: list = [None] * self.args.world_size
        dist.all_gather_object(everyone, state)
        if self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            for rank, rank_state in enumerate(everyone):
                torch.save(rank_state, os.path.join(output_dir, f"rng_state_{rank}.pth"))


check_overridden(FreetuneTrainer)


class GarbageFrozenAfterWarmup(TrainerCallback):
    """Python's cyclic garbage collector kept off what exists once the first steps of this session are over.

    torch.compile leaves hundreds of thousands of long-lived objects behind (graphs, guards, generated code, Triton's
    launchers). Every full collection walks all of them, at a step nobody chose, and stops the training threads for
    a visible fraction of a step on a host-bound card. After `warmup_steps` (the layers compiled) one collection
    clears what the warm-up left, and gc.freeze moves every survivor out of the collector's generations: later
    collections walk only what the steps themselves make. Reference counting frees as before; only cycles among the
    frozen objects wait for `unfreeze` (at the end of training, or freetune.train's undo after an error)."""

    def __init__(self, warmup_steps: int = 2):
        self.warmup_steps, self.first_step, self.frozen = warmup_steps, None, False

    def on_step_begin(self, args, state, control, **kwargs):
        if self.first_step is None:
            self.first_step = state.global_step  # 0, or the checkpoint's step after a resume

    def on_step_end(self, args, state, control, **kwargs):
        if not self.frozen and state.global_step - self.first_step >= self.warmup_steps:
            gc.collect()
            gc.freeze()
            self.frozen = True

    def on_train_end(self, args, state, control, **kwargs):
        self.unfreeze()

    def unfreeze(self) -> None:
        if self.frozen:
            gc.unfreeze()
            self.frozen = False



def save_tokenizer_once(tokenizer, checkpoints_dir: Path) -> Path | None:
    """The run's tokenizer in <checkpoints>/tokenizer/, written at the first save (scratch folder, then a rename:
    a kill mid-write leaves no half tokenizer under that name)."""
    target = Path(checkpoints_dir) / TOKENIZER_DIR
    if tokenizer is None or target.is_dir():
        return None
    scratch = target.with_name(".writing-" + TOKENIZER_DIR)
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    tokenizer.save_pretrained(str(scratch))
    os.replace(scratch, target)
    return target
