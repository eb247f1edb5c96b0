"""Watching a run: the held-out loss every eval_steps (through freetune's fast trainer, the same as through TRL's
own), in the progress lines, the summary and the plot; the overfitting warning; report_to's TensorBoard event files
and Trackio store, read back."""

import json
import math

import pytest
from test_fast_path import run_paths

from freetune import tracking
from freetune.errors import FreetuneError

STEPS, EVAL_STEPS = 4, 2


def rows(n, offset=0):
    from datasets import Dataset

    words = ["red", "green", "blue", "circle", "square", "line", "small", "large", "left", "right"]
    return Dataset.from_list([{"prompt": f"Draw {words[i % 10]} number {i}:",
                               "completion": " <svg>" + " ".join(words[(i * 3 + j) % 10] for j in range(2 + i % 9))
                                             + "</svg>"} for i in range(offset, offset + n)])


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    """The same 4 steps with evaluation every 2 twice: TRL's SFTTrainer as it comes, and freetune.train.train on the
    fast path (padding-free batches, its trainer class), logging to TensorBoard."""
    import io
    from contextlib import redirect_stdout

    from trl import SFTTrainer

    import freetune
    from freetune.reach import peft_bnb as peft_bnb_reach
    from freetune.model import adapter_dtype_guard
    from freetune.plan import Plan

    root = tmp_path_factory.mktemp("tracking")
    common = dict(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                  micro_batch=4, grad_accum=1, gradient_checkpointing=False)
    tokenizer = freetune.model.load_tokenizer(str(tiny_model_dir))

    def model_and_config(plan, name, report_to):
        paths = run_paths(root, name)
        model = freetune.model.load_base_model(str(tiny_model_dir), plan, gradient_checkpointing=False)
        model, _, _ = freetune.model.attach_lora(model, rank=8, alpha=16, dropout=0.0, seed=0)
        config = freetune.sft_config.make_config(
            paths, plan, max_steps=STEPS, micro_batch=4, grad_accum=1, learning_rate=5e-3, max_length=64,
            optimizer="adamw_torch", logging_steps=1, save_steps=100, save_total_limit=2, seed=0,
            eval_steps=EVAL_STEPS, report_to=report_to)
        return paths, model, config

    _, model, config = model_and_config(Plan.build(**common, batching="padded"), "plain", "none")
    peft_bnb_reach.keep_training_layout(model)  # as train() does: else an AVX-512 CPU cannot train after an evaluation
    plain = SFTTrainer(model=model, args=config, train_dataset=rows(16), eval_dataset=rows(8, offset=100),
                       processing_class=tokenizer, callbacks=[adapter_dtype_guard()])
    plain.train()
    fast = Plan.build(**common, batching="padding_free")
    paths, model, config = model_and_config(fast, "fast", "tensorboard")
    printed = io.StringIO()
    with redirect_stdout(printed):
        summary = freetune.train.train(model, tokenizer, rows(16), config, plan=fast, paths=paths,
                                       eval_dataset=rows(8, 100), resume=False)
    history = json.loads((root / "fast" / "reports" / "log_history.json").read_text())
    return {"plain": plain.state.log_history, "fast": history, "summary": summary, "printed": printed.getvalue(),
            "root": root}


def test_the_fast_trainer_evaluates_like_trls_own(runs):
    fast, plain = tracking.eval_points(runs["fast"]), tracking.eval_points(runs["plain"])
    assert [s for s, _ in fast] == [s for s, _ in plain] == [2, 4]
    for (_, a), (_, b) in zip(fast, plain):  # same weights, same held-out tokens, batched differently
        assert math.isclose(a, b, rel_tol=2e-3), (fast, plain)
    # The train metrics the fast trainer keeps on the device are still read once per log step, and not mixed with
    # the evaluation's: every train step logged its loss and token count, the evaluations theirs.
    train_logs = [h for h in runs["fast"] if "loss" in h]
    assert [h["step"] for h in train_logs] == [1, 2, 3, 4] and all("num_tokens" in h for h in train_logs)
    assert all("eval_loss" not in h for h in train_logs)


def test_eval_loss_is_in_the_progress_lines_the_summary_and_the_plot(runs):
    assert runs["printed"].count("eval loss") == 2 and "step     2/4  eval loss" in runs["printed"]
    summary = runs["summary"]
    points = tracking.eval_points(runs["fast"])
    assert summary["eval_losses"] == [list(p) for p in points] and summary["eval_loss"] == points[-1][1]
    assert summary["best_eval_loss"] == min(p[1] for p in points) and summary["overfitting"] is None
    saved = json.loads((runs["root"] / "fast" / "reports" / "run_summary.json").read_text())
    assert saved["eval_losses"] == summary["eval_losses"]

    from freetune.train import loss_figure

    fig = loss_figure(runs["fast"])
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"training", "held-out (eval)"}
    assert list(lines["held-out (eval)"].get_xdata()) == [2, 4]


def test_tensorboard_event_files_hold_the_train_and_eval_losses(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folder = runs["root"] / "fast" / "reports" / "tensorboard"
    assert list(folder.glob("events.out.tfevents.*")), "no event file written"
    events = EventAccumulator(str(folder))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    written = [(e.step, e.value) for e in events.Scalars("eval/loss")]
    assert [s for s, _ in written] == [2, 4]
    for (_, got), (_, want) in zip(written, tracking.eval_points(runs["fast"])):
        assert math.isclose(got, want, rel_tol=1e-6)


TRACKIO_RUN = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import freetune
from freetune.plan import Plan
from test_fast_path import run_paths
from test_tracking import rows

paths = run_paths(Path(sys.argv[3]), "trackio-run")
plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa", micro_batch=4,
            grad_accum=1, gradient_checkpointing=False)
model = freetune.model.load_base_model(sys.argv[1], plan, gradient_checkpointing=False)
model, _, _ = freetune.model.attach_lora(model, rank=8, alpha=16, dropout=0.0, seed=0)
config = freetune.sft_config.make_config(paths, plan, max_steps=2, micro_batch=4, grad_accum=1, learning_rate=5e-3,
                                    max_length=64, optimizer="adamw_torch", logging_steps=1, save_steps=100,
                                    eval_steps=1, report_to="trackio")
freetune.train.train(model, freetune.model.load_tokenizer(sys.argv[1]), rows(8), config, plan=plan, paths=paths,
                     eval_dataset=rows(4, 100), resume=False)
from trackio.sqlite_storage import SQLiteStorage

print("LOGS", json.dumps([{k: v for k, v in log.items() if "/" in k} for log in
                          SQLiteStorage.get_logs("trackio-run", "trackio-run")]))
"""


def test_trackio_logs_locally_into_the_run_folder(tiny_model_dir, tmp_path):
    """In a fresh process, as a notebook's training runs: Trackio's local store lands in the run folder, with the
    train and eval losses (nothing is sent anywhere: no Space is named)."""
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    done = subprocess.run([sys.executable, "-c", TRACKIO_RUN, str(tiny_model_dir), str(tests), str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    folder = tmp_path / "trackio-run" / "reports" / "trackio"
    assert f"Logging to trackio: {folder}" in done.stdout and list(folder.glob("*.db")), "no Trackio store written"
    logs = json.loads(done.stdout.split("LOGS ", 1)[1].splitlines()[0])
    history = json.loads((tmp_path / "trackio-run" / "reports" / "log_history.json").read_text())
    assert [(log["train/global_step"], log["eval/loss"]) for log in logs if "eval/loss" in log] == [
        tuple(p) for p in tracking.eval_points(history)] and len(tracking.eval_points(history)) == 2
    assert [log["train/global_step"] for log in logs if "train/loss" in log] == [1, 2]


def history(evals, train):
    return ([{"step": s, "loss": v} for s, v in train] + [{"step": s, "eval_loss": v} for s, v in evals])


def test_overfitting_is_eval_loss_rising_for_three_evaluations_while_train_loss_falls():
    falling = [(s, 2.0 - 0.1 * s) for s in range(1, 11)]
    rising = [(2, 1.0), (4, 1.1), (6, 1.2), (8, 1.3)]
    warning = tracking.overfitting(history(rising, falling))
    assert warning and "rose for 3 evaluations in a row, 1.0000 at step 2 -> 1.3000 at step 8" in warning
    assert "max_steps" in warning and "learning_rate" in warning
    assert tracking.overfitting(history(rising[1:], falling)) is None  # two rises are noise, not a trend
    assert tracking.overfitting(history([(2, 1.0), (4, 1.1), (6, 1.05), (8, 1.3)], falling)) is None
    climbing = [(s, 1.0 + 0.1 * s) for s in range(1, 11)]
    assert tracking.overfitting(history(rising, climbing)) is None  # both rise: diverging, not memorising


def test_the_overfitting_warning_is_printed_once_per_rising_streak(capsys):
    from transformers import TrainerControl, TrainerState

    watch = tracking.overfit_watch()
    state = TrainerState()
    falling = [(s, 2.0 - 0.1 * s) for s in range(1, 13)]
    evals = [(2, 1.0), (4, 1.1), (6, 1.2), (8, 1.3), (10, 1.4), (12, 1.0)]
    warned = []
    for k in range(1, len(evals) + 1):
        state.log_history = history(evals[:k], falling)
        state.global_step = evals[k - 1][0]
        watch.on_evaluate(None, state, TrainerControl())
        warned.append(capsys.readouterr().out.count("WARNING: Overfitting"))
    assert warned == [0, 0, 0, 1, 0, 0]


def test_logging_and_evaluation_settings_are_checked_before_anything_loads():
    tracking.check_options(report_to="tensorboard", eval_steps=25, eval_rows=16)
    with pytest.raises(FreetuneError, match="report_to='wandb': use one of 'none', 'tensorboard', 'trackio'"):
        tracking.check_options(report_to="wandb")
    with pytest.raises(FreetuneError, match="eval_steps=25 evaluates the held-out rows, but eval_rows=0"):
        tracking.check_options(eval_steps=25, eval_rows=0)
    with pytest.raises(FreetuneError, match="eval_steps=-1"):
        tracking.check_options(eval_steps=-1, eval_rows=16)
    assert tracking._pinned("tensorboard") == "tensorboard==2.21.0"  # the install line names pyproject's pin
