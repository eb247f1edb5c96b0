"""Watching a run: the held-out loss every `eval_steps`, a plain warning when it starts to overfit, and experiment
logging (`report_to`: TensorBoard or Trackio, both local files in the run folder).

- Eval loss: the Trainer evaluates the held-out rows (the recipe's `eval_rows`, never trained on) every `eval_steps`;
  only the loss is computed (`prediction_loss_only`: the logits of a whole eval set, rows x tokens x vocabulary, are
  never kept). It shows in the progress lines, the loss plot and the summary JSON.
- Overfitting: eval loss that rises for RISES evaluations in a row while the train loss falls over the same steps
  means the adapter is memorising its rows; the warning says so once, with what to change.
- report_to: "none" (default), "tensorboard" or "trackio". The logs go to <run>/reports/<tool>, so they stay with
  the run (on Drive or in Kaggle's output); only rank 0 writes them. Trackio logs locally (no Space is created).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from freetune.distributed import print0
from freetune.errors import FreetuneError

REPORT_TO = ("none", "tensorboard", "trackio")
# The import that says the tool can log (transformers' TensorBoard callback writes through torch's SummaryWriter).
_NEEDS = {"tensorboard": "tensorboard", "trackio": "trackio"}
RISES = 3  # evaluations in a row with a higher eval loss before the overfitting warning


def _pinned(package: str) -> str:
    """The requirement freetune's `logging` extra pins for package (pyproject.toml is the one place for pins)."""
    from importlib import metadata

    try:
        for req in metadata.requires("freetune") or ():
            if req.lower().startswith(package) and "logging" in req:
                return req.split(";")[0].strip()
    except metadata.PackageNotFoundError:
        pass
    return package


def check_options(*, report_to: str = "none", eval_steps: int = 0, eval_rows: int = 0) -> None:
    """The recipe's logging and evaluation parameters, checked before anything loads."""
    if report_to not in REPORT_TO:
        raise FreetuneError(f"report_to={report_to!r}: use one of {', '.join(repr(r) for r in REPORT_TO)}.")
    module = _NEEDS.get(report_to)
    if module and importlib.util.find_spec(module) is None:
        raise FreetuneError(f"report_to={report_to!r} needs the {module} package: `pip install '{_pinned(module)}'` "
                            f"(freetune's `logging` extra), then run this cell again; or set report_to='none'.")
    if eval_steps < 0:
        raise FreetuneError(f"eval_steps={eval_steps}: give a number of steps (e.g. 25), or 0 for no evaluation "
                            f"while training.")
    if eval_steps and eval_rows <= 0:
        raise FreetuneError(f"eval_steps={eval_steps} evaluates the held-out rows, but eval_rows={eval_rows} holds "
                            f"none out: set eval_rows (e.g. 16), or eval_steps to 0.")


def sft_fields(paths, *, report_to: str, eval_steps: int, micro_batch: int) -> dict:
    """The SFTConfig fields for evaluation and logging (freetune.sft_config.make_config adds them)."""
    check_options(report_to=report_to, eval_steps=eval_steps, eval_rows=1 if eval_steps else 0)
    fields = dict(eval_strategy="steps" if eval_steps else "no", eval_steps=eval_steps or None,
                  per_device_eval_batch_size=micro_batch, prediction_loss_only=True,
                  report_to=[] if report_to == "none" else [report_to], run_name=Path(paths.run_dir).name,
                  project=Path(paths.run_dir).name)
    if report_to == "tensorboard":
        folder = Path(paths.reports) / report_to
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(folder)  # read by its callback when the trainer is built
        print0(f"Logging to tensorboard: {folder}. To view: tensorboard --logdir {folder}  (Colab: %load_ext "
               f"tensorboard, then %tensorboard --logdir {folder})")
    elif report_to == "trackio":
        folder = _trackio_dir(Path(paths.reports) / report_to)
        print0(f"Logging to trackio: {folder}. To view: TRACKIO_DIR={folder} trackio show --project "
               f"{fields['project']}")
    return fields


def _trackio_dir(wanted: Path) -> Path:
    """Where Trackio will write: `wanted`, unless Trackio was imported before (it reads TRACKIO_DIR once, at import;
    TRL's profiling helpers import it whenever it is installed), then where that import pointed it."""
    import sys

    if "trackio" in sys.modules:
        from trackio.utils import TRACKIO_DIR

        return Path(TRACKIO_DIR)
    os.environ["TRACKIO_DIR"] = str(wanted)
    return wanted


def eval_points(history: list[dict]) -> list[tuple[int, float]]:
    return [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h]


def overfitting(history: list[dict], rises: int = RISES) -> str | None:
    """A warning when the last `rises` evaluations each had a higher eval loss than the one before while the train
    loss logged between the first and the last of them fell; None otherwise. history: the Trainer's log_history."""
    evals = eval_points(history)
    if len(evals) <= rises:
        return None
    window = evals[-(rises + 1):]
    if not all(later[1] > earlier[1] for earlier, later in zip(window, window[1:])):
        return None
    (start, low), (end, high) = window[0], window[-1]
    train = [(h["step"], h["loss"]) for h in history if "loss" in h and start <= h["step"] <= end]
    if len(train) < 2 or not train[-1][1] < train[0][1]:
        return None
    return (f"Overfitting: the held-out (eval) loss rose for {rises} evaluations in a row, {low:.4f} at step {start} "
            f"-> {high:.4f} at step {end}, while the training loss fell ({train[0][1]:.4f} -> {train[-1][1]:.4f}). "
            f"The adapter is memorising its training rows. The checkpoint near step {start} generalised best; "
            f"train fewer steps (max_steps), lower learning_rate, or add rows.")


def eval_summary(history: list[dict]) -> dict:
    """The summary JSON's evaluation fields (None without evaluation)."""
    evals = eval_points(history)
    best = min(evals, key=lambda p: p[1]) if evals else (None, None)
    return {"eval_loss": evals[-1][1] if evals else None, "best_eval_loss": best[1], "best_eval_step": best[0],
            "eval_losses": [list(p) for p in evals], "overfitting": overfitting(history)}


def overfit_watch():
    """A TrainerCallback that prints the overfitting warning (rank 0, once per rising streak)."""
    from transformers import TrainerCallback

    class OverfitWatch(TrainerCallback):
        def __init__(self):
            self.warned_at = None

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            warning = overfitting(state.log_history)
            if warning is None:
                self.warned_at = None
            elif self.warned_at is None and state.is_world_process_zero:
                self.warned_at = state.global_step
                print(f"WARNING: {warning}", flush=True)

    return OverfitWatch()
