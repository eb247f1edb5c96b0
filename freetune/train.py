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
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

from transformers import TrainerCallback

from freetune import checkpoint, speed, tracking
from freetune.console import duration
from freetune.distributed import check_replicas_agree, context, print0
from freetune.errors import FreetuneError
from freetune.model import adapter_dtype_guard
from freetune.platform import Paths
from freetune.plan import Plan
from freetune.reach.transformers import NonFiniteGuard
from freetune.resources import folder_bytes
from freetune.speed.feature import off_line

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


class ProgressPrinter(TrainerCallback):
    """A TrainerCallback printing one readable line per log step: step, loss, learning rate, tokens/s, memory, ETA."""

    def __init__(self, total_steps: int):
        self.total_steps = total_steps
        self.start = None
        self.last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.start = time.time()
        self.first_step = state.global_step  # > 0 after a resume: the ETA counts this session's steps
        self.last = (self.start, state.global_step, None)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "eval_loss" in logs:
            print(f"step {state.global_step:>5}/{self.total_steps}  eval loss {logs['eval_loss']:.4f}  "
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
        eta = (now - self.start) / done * max(self.total_steps - state.global_step, 0)
        print(f"step {state.global_step:>5}/{self.total_steps}  loss {logs['loss']:.4f}  "
              f"lr {logs.get('learning_rate', 0):.2e}  {rate}  {where} {used:.2f}/{peak:.2f} GiB  "
              f"ETA {duration(eta)}", flush=True)
        self.last = (now, state.global_step, tokens)


def nonfinite_advice(problem: str, config, checkpoints_dir: str) -> str:
    """What stopped the run, what was kept, and what to change."""
    kept = checkpoint.latest_complete(checkpoints_dir)
    kept_text = (f"The newest good checkpoint, {kept.name}, is kept" if kept else
                 "No checkpoint was saved before it")
    lr = config.learning_rate
    fp16 = (" This run computes in fp16, whose largest number is 65,504: on a GPU with bf16 (Ampere or newer: A100, "
            "L4, A10, RTX 30xx/40xx; a T4 has none) set precision='bf16'." if config.fp16 else "")
    return (f"Training stopped: {problem} (the numbers overflowed). {kept_text}; nothing after it was saved, and no "
            f"adapter was written. Lower learning_rate (now {lr:g}; try {lr / 4:g}).{fp16} Then run again: "
            + (f"it resumes from {kept.name} at the new learning rate (a changed precision is another run: give it a "
               f"new run_name)." if kept else "it starts at step 0."))


def train(model, tokenizer, train_dataset, config, *, paths: Paths, plan: Plan | None = None, eval_dataset=None,
          resume: bool = True, extra_callbacks=(), time_budget_min: float = 0, hub_checkpoint_repo: str = "",
          hub_api=None):
    """Run freetune's trainer (freetune.trainer.FreetuneTrainer) as the plan says, save the adapter (main process),
    write the summary; returns the summary dict. config: make_config's, which carries the plan it was made from.

    plan: only for a config not made by make_config; given beside one that was, it must be the same plan.

    resume: continue from the newest complete checkpoint of this run (paths.checkpoints, or the Hub).
    time_budget_min: stop and save after this many minutes; 0 = the platform's session limit minus a margin
        (Colab/Kaggle), none locally. SIGTERM stops and saves the same way (under DDP one step later: the ranks
        agree on it without waiting for the GPU, checkpoint.StopAgreement).
    hub_checkpoint_repo: a private Hub repo ("you/some-repo") that receives each complete checkpoint; "" = off.
        Needs HF_TOKEN (Colab/Kaggle secrets or the environment): missing, it fails here, before any training.
    hub_api: a huggingface_hub.HfApi-like object to use instead of a real one (tests).
    """
    import torch

    plan = _plan_of(config, plan)
    eval_dataset = _rows_to_train(train_dataset, eval_dataset, config)
    if context().is_main:  # a no-op where the notebook's run cell (or a process above this one) holds it
        checkpoint.lock.acquire(paths.run_dir)
    budget_s, budget_text = checkpoint.time_budget(time_budget_min, paths.platform)
    hub = None
    if hub_checkpoint_repo and context().is_main:  # only the main process talks to the Hub
        hub = checkpoint.HubSync.connect(hub_checkpoint_repo, run_name=Path(paths.run_dir).name,
                                         keep=config.save_total_limit, api=hub_api)
    if not resume and checkpoint.latest_complete(paths.checkpoints) is not None:
        raise FreetuneError(f"{paths.checkpoints} holds checkpoints of an earlier run and resume is off: new ones "
                            f"would mix with them. Change run_name to start fresh, or resume.")
    stopper = checkpoint.stop_callback(budget_s, budget_text)
    guard = NonFiniteGuard()
    print0(f"Preparing {len(train_dataset):,} rows for training (tokenising, masking what is not trained on, "
           f"cutting to max_length) ...")
    from freetune.trainer import FreetuneTrainer

    trainer = FreetuneTrainer(
        model=model, args=config, train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=tokenizer,
        callbacks=[adapter_dtype_guard(),  # LoRA stays fp32: TRL casts it to bf16, fatal on a T4
                   ProgressPrinter(config.max_steps), guard, tracking.overfit_watch(), stopper, *extra_callbacks],
        plan=plan, hub=hub)
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # it prints raw log dicts; ProgressPrinter prints one clean line
    undo_speed_ups = _speed_up(trainer, plan)
    print0(f"Checkpoints: every {config.save_steps} steps, the last {config.save_total_limit} kept, in "
           f"{paths.checkpoints}. Time budget: {budget_text}.")
    resume_from = checkpoint.agree_on_resume(paths.checkpoints, config.max_steps, hub) if resume else None
    if resume_from:  # the one picked may have come from the Hub: the same run's, or refused before it loads
        checkpoint.check_resumed(paths.checkpoints, resume_from)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    # make_config's ddp_broadcast_buffers=False is meant: torch 2.13 deprecates the name for forward_sync_buffers,
    # which the older torch of Colab and Kaggle does not have.
    warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
    start = time.time()
    try:
        try:
            with checkpoint.sigterm_stops(stopper), _disk_full_explained(paths):
                result = trainer.train(resume_from_checkpoint=resume_from)
        finally:
            if hub is not None:
                hub.close()
        wall = time.time() - start
        _check_trained(trainer, guard, config, paths)
        summary = _summary(trainer, result, wall, stopper.reason, resume_from, paths)
        # Saved before the speed-ups are undone: the adapter must be on disk before anything that could fail runs.
        with _disk_full_explained(paths):
            _save(trainer, tokenizer, summary, paths, sharded=bool(getattr(config, "fsdp", None)))
    finally:
        trainer.release_optimizer_state()  # training is over, or failed: its moments would only hold the GPU
        for undo in undo_speed_ups:  # the model may go on to generate and export: eager layers, as loaded
            undo()
    if stopper.reason:
        print0(f"Stopped early at step {summary['steps']} of {summary['max_steps']} ({stopper.reason}). The adapter so "
               f"far is in {paths.adapter}; run this again with the same run_name to continue from the checkpoint.")
    return summary


def _plan_of(config, plan: Plan | None) -> Plan:
    made_from = getattr(config, "freetune_plan", None)
    if made_from is not None and plan is not None and plan is not made_from and plan != made_from:
        raise FreetuneError("train() was given a plan other than the one its config was made from: pass the config "
                            "alone (freetune.sft_config.make_config records its plan), or make the config from this "
                            "plan.")
    if made_from is None and plan is None:
        raise FreetuneError("train() needs the plan: make the config with "
                            "freetune.sft_config.make_config(paths, plan, ...), which records it.")
    return made_from if made_from is not None else plan


@contextmanager
def _disk_full_explained(paths: Paths):
    """A full disk (errno 28, in whichever library's words) becomes a FreetuneError: the folder, the size of a
    checkpoint, and that the last complete checkpoint is intact."""
    try:
        yield
    except Exception as exc:
        if not checkpoint.space.is_disk_full(exc):
            raise
        kept = checkpoint.latest_complete(paths.checkpoints)
        size = folder_bytes(kept) if kept else None
        raise FreetuneError(checkpoint.space.disk_full_message(paths.checkpoints, size)) from exc


def _rows_to_train(train_dataset, eval_dataset, config):
    """The held-out rows to evaluate (None when the config does not evaluate); refuses an empty training set."""
    if len(train_dataset) == 0:
        raise FreetuneError("No training rows left (after cleaning). Check the data set and the audit above.")
    if config.eval_strategy == "no":
        return None  # not evaluated: not tokenised either
    if not eval_dataset:
        raise FreetuneError(f"eval_steps={config.eval_steps} needs held-out rows to evaluate: set eval_rows (e.g. 16), "
                            f"or eval_steps to 0.")
    return eval_dataset


def _speed_up(trainer, plan: Plan) -> list:
    """What the plan chose beyond the Trainer's settings, feature by feature (freetune.speed.FEATURES, in order): each
    installs itself where it applies to this plan and model, or steps aside and says why. Returns what to undo after
    training."""
    undo = []
    for feature in speed.features():
        applies, why = feature.applies(plan, trainer)
        if not applies:
            if line := off_line(feature, why):
                print0(line)
            continue
        undone = feature.install(trainer, plan)
        if undone is not None:
            undo.append(undone)
    return undo


def _check_trained(trainer, guard, config, paths: Paths) -> None:
    """Raise when the numbers overflowed; compare the replicas' adapters (DDP)."""
    problem = guard.reason or trainer.nonfinite_weights_at
    if problem is None and not checkpoint.weights_finite(trainer.model):  # overflowed after the last log step
        problem = f"after step {trainer.state.global_step} the adapter's weights hold NaN or inf"
    if problem:
        raise FreetuneError(nonfinite_advice(problem, config, paths.checkpoints))
    if getattr(config, "fsdp", None):
        # FSDP keeps one copy of the adapter, split over the ranks: there are no replicas to compare (each rank's
        # shard differs by design), and gathering the whole model to compare would undo the sharding.
        print0("FSDP: one adapter, sharded over the ranks; it is gathered to rank 0 for the save below.")
    else:
        check_replicas_agree(trainer.model)


def _summary(trainer, result, wall: float, stopped: str | None, resume_from, paths: Paths) -> dict:
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    tokens = max((h.get("num_tokens", 0) for h in history), default=0)  # the whole run's
    # This session's share: after a resume the Trainer's training_loss divides this session's loss sum by every
    # step of the run, and the run's tokens over this session's time would overstate the rate.
    steps_here = trainer.state.global_step - trainer.resumed_at
    tokens_here = tokens - trainer.tokens_at_resume
    _, peak, where = memory_gib()
    return {
        "steps": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "steps_this_session": steps_here,
        "stopped_early": stopped,  # None, or why it stopped before max_steps (a rerun continues)
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
        **tracking.eval_summary(history),
    }


def _save(trainer, tokenizer, summary: dict, paths: Paths, sharded: bool) -> None:
    """The adapter, the tokenizer, the log history and the summary, written by the main process."""
    if sharded or trainer.is_world_process_zero():
        # Under FSDP gathering the adapter is a collective: every rank takes part, the Trainer writes on rank 0 only.
        trainer.save_model(paths.adapter)
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(paths.adapter)
        reports = Path(paths.reports)
        (reports / HISTORY_FILE).write_text(json.dumps(trainer.state.log_history, indent=1))
        (reports / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, sort_keys=True))


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
