"""A run cannot hurt itself or another (issue 46): a resume of the same run only, one run per folder, disk space,
and the errors that can come before the model loads. Library level, a few seconds in all; the one notebook test
(the issue's repro through scripts/run_recipe.py) is at the end.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from freetune.checkpoint import identity, lock, space
from freetune.checkpoint.marker import write_marker
from freetune.errors import FreetuneError
from freetune.platform import Paths, resolve_paths

PARAMS = {"model_id": "/models/tiny", "dataset": "svg.jsonl", "lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.05,
          "lora_targets": "all-linear", "max_length": 256, "seed": 0, "precision": "auto", "learning_rate": 0.02,
          "micro_batch": 2, "grad_accum": 1, "max_steps": 4, "save_steps": 2, "logging_steps": 1}
ROWS = [{"prompt": f"draw {i}", "completion": f"<svg>{i}</svg>"} for i in range(5)]


def fake_checkpoint(paths: Paths, step: int) -> Path:
    """A checkpoint folder as the trainer leaves it (contents are placeholders: only the identity is read here)."""
    folder = Path(paths.checkpoints) / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    for name in ("trainer_state.json", "optimizer.pt", "scheduler.pt", "rng_state.pth", "adapter_model.safetensors"):
        (folder / name).write_text("x")
    identity.copy_into(folder)
    write_marker(folder, step, world_size=1)
    return folder


@pytest.fixture
def trained(tmp_path):
    """A run folder whose checkpoint-2 was trained with PARAMS on ROWS."""
    paths = Paths.under(tmp_path / "rmx").make()
    identity.check_same_run(paths, PARAMS, ROWS)
    fake_checkpoint(paths, 2)
    return paths


# ---- identity ----------------------------------------------------------------------------------------------------

def test_a_resume_with_other_lora_settings_stops_with_both_values_and_both_ways_out(trained):
    with pytest.raises(FreetuneError) as caught:
        identity.check_same_run(trained, {**PARAMS, "lora_rank": 16, "lora_alpha": 32, "max_steps": 6}, ROWS)
    message = str(caught.value)
    assert "lora_rank: 8 in checkpoint-2, 16 now" in message and "lora_alpha: 16 in checkpoint-2, 32 now" in message
    assert "set them back (lora_rank = 8, lora_alpha = 16)" in message and "run_name" in message and "'rmx-2'" in message
    assert "max_steps" not in message.split("What may change")[0]  # a raised max_steps is not a difference
    # Refused: the checkpoint's identity is still the one recorded for the run.
    assert identity.read_identity(trained.checkpoints)["lora_rank"] == 8


@pytest.mark.parametrize("change", [{"model_id": "/models/other"}, {"max_length": 128}, {"seed": 1},
                                    {"lora_targets": ".*q_proj"}, {"dataset": "other.jsonl"}, {"grad_accum": 4}])
def test_every_setting_that_changes_the_result_is_refused(trained, change):
    with pytest.raises(FreetuneError, match=f"{next(iter(change))}|rows_per_gpu_step"):
        identity.check_same_run(trained, {**PARAMS, **change}, ROWS)


def test_other_rows_are_refused_and_what_may_change_resumes(trained, capsys):
    with pytest.raises(FreetuneError, match="training_rows: the training rows after the audit"):
        identity.check_same_run(trained, PARAMS, ROWS[:4])
    # micro_batch 1 x grad_accum 2 is the same 2 rows per GPU step as 2 x 1: a memory choice, not another run.
    resumable = {**PARAMS, "max_steps": 10, "save_steps": 5, "logging_steps": 2, "eval_steps": 3,
                 "time_budget_min": 30, "micro_batch": 1, "grad_accum": 2, "learning_rate": 0.01}
    identity.check_same_run(trained, resumable, ROWS)
    assert "learning_rate changed from 0.02 (checkpoint-2) to 0.01: applied" in capsys.readouterr().out


def test_a_checkpoint_fetched_from_the_hub_is_checked_at_the_resume_too(trained, tmp_path):
    other = Paths.under(tmp_path / "elsewhere").make()
    identity.check_same_run(other, {**PARAMS, "lora_rank": 4}, ROWS)
    downloaded = fake_checkpoint(other, 6)  # what HubSync.download would have put in place
    with pytest.raises(FreetuneError, match="lora_rank: 4 in checkpoint-6, 8 now"):
        identity.check_resumed(trained.checkpoints, downloaded)


def test_the_resumed_step_trains_at_this_run_s_schedule():
    """FreetuneTrainer._schedule_from_here on transformers' own cosine schedule and a real optimizer: raised
    max_steps (the old schedule ended at 0.0) and a new learning rate both apply at the first resumed step;
    unchanged settings give the very float the scheduler had."""
    from types import SimpleNamespace

    import torch
    from transformers import get_cosine_schedule_with_warmup

    from freetune.trainer import FreetuneTrainer

    def at_step_4(max_steps, lr):
        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=lr)
        scheduler = get_cosine_schedule_with_warmup(optimizer, 1, max_steps)
        return optimizer, scheduler

    optimizer, old = at_step_4(4, 0.02)
    for _ in range(4):
        optimizer.step()
        old.step()
    saved = old.state_dict(), optimizer.state_dict()
    assert old.get_last_lr()[0] == 0.0

    def resumed(max_steps, lr):
        optimizer, scheduler = at_step_4(max_steps, lr)
        optimizer.load_state_dict(saved[1])
        scheduler.load_state_dict(saved[0])
        FreetuneTrainer._schedule_from_here(SimpleNamespace(lr_scheduler=scheduler,
                                                            args=SimpleNamespace(learning_rate=lr)))
        return optimizer.param_groups[0]["lr"], scheduler.get_last_lr()[0]

    _, uninterrupted = at_step_4(6, 0.02)
    for _ in range(4):
        uninterrupted.step()
    assert resumed(6, 0.02) == (uninterrupted.get_last_lr()[0],) * 2 and uninterrupted.get_last_lr()[0] > 0
    assert resumed(6, 0.01)[0] == pytest.approx(uninterrupted.get_last_lr()[0] / 2)
    assert resumed(4, 0.02) == (0.0, 0.0)  # the same settings: the same rate as before the save


# ---- one run per folder ---------------------------------------------------------------------------------------------

HOLD = ("import sys, time; from freetune.checkpoint import lock; lock.acquire(sys.argv[1]); print('held', flush=True);"
        " time.sleep(600)")


@pytest.fixture
def clean_env(monkeypatch):
    monkeypatch.setenv(lock.HOLDERS_ENV, "")  # restored after the test: acquire() adds this process's token
    yield
    for held in list(lock._held.values()):
        held.release()


def test_a_second_run_is_refused_and_a_killed_one_leaves_no_stuck_lock(tmp_path, clean_env):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), lock.HOLDERS_ENV: ""}
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(FreetuneError) as caught:
            lock.acquire(run_dir)
        assert f"process {holder.pid} on host" in str(caught.value) and "run_name" in str(caught.value)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    taken = lock.acquire(run_dir)  # the killed holder's record is stale: its flock went with it
    assert taken is not None and lock.acquire(run_dir) is taken  # the same process again: kept, not refused
    assert json.loads((run_dir / lock.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_a_process_started_by_the_holder_works_under_its_lock(tmp_path, clean_env):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock.acquire(run_dir)
    child = ("import sys; from freetune.checkpoint import lock; print(lock.acquire(sys.argv[1]))")
    out = subprocess.run([sys.executable, "-c", child, str(run_dir)], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.stdout.strip() == "None"  # a torchrun rank of the notebook: neither refused nor a second holder


def test_a_lock_from_another_host_counts_until_its_heartbeat_is_old(tmp_path, clean_env):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    record = {"host": "colab-vm-1", "pid": 123, "started": "1", "acquired": time.time() - 3600}
    (run_dir / lock.LOCK_FILE).write_text(json.dumps({**record, "heartbeat": time.time() - 30}))
    with pytest.raises(FreetuneError, match="process 123 on host 'colab-vm-1'"):
        lock.acquire(run_dir)
    (run_dir / lock.LOCK_FILE).write_text(json.dumps({**record, "heartbeat": time.time() - lock.STALE_AFTER_S - 1}))
    assert lock.acquire(run_dir) is not None  # the VM that held it vanished: a new session resumes


def test_without_shared_locks_a_dead_or_reused_pid_is_stale():
    me = lock.this_process()
    assert lock._holder_alive(me, fcntl_works=False)
    assert not lock._holder_alive({**me, "started": "0"}, fcntl_works=False)  # the pid now runs another process
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert not lock._holder_alive({**me, "pid": dead.pid}, fcntl_works=False)


def test_an_output_dir_that_cannot_be_written_says_so_before_anything_loads(tmp_path, clean_env):
    afile = tmp_path / "a-file"
    afile.write_text("")
    for output_dir in (str(afile), "/proc/freetune-runs"):
        with pytest.raises(FreetuneError, match=f"Cannot write the run folder .*Set output_dir to a folder"):
            resolve_paths(None, output_dir, "run")


# ---- disk -----------------------------------------------------------------------------------------------------------

def test_the_disk_check_names_what_the_run_writes_and_what_to_change(tmp_path):
    from freetune.plan import Plan

    paths = Paths.under(tmp_path / "run").make()
    plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa",
                optimizer="adamw_torch")
    huge = tmp_path / "huge-model"  # a config.json is all the check reads: ~1.3 trillion parameters
    huge.mkdir()
    (huge / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32768, "num_hidden_layers": 100,
                                                  "intermediate_size": 131072, "num_attention_heads": 64,
                                                  "vocab_size": 150000}))
    with pytest.raises(FreetuneError, match=r"Not enough disk .*checkpoints .*export .*set export_gguf to False"):
        space.check_disk(paths, {**PARAMS, "model_id": str(huge), "export_gguf": True}, plan)
    space.check_disk(paths, {**PARAMS, "model_id": "Qwen/Qwen2.5-0.5B-Instruct"}, plan)  # a small run fits


def test_a_full_disk_in_any_library_s_words_says_the_folder_and_that_the_checkpoint_is_intact(trained):
    tokenizers_words = Exception("No space left on device (os error 28)")
    assert space.is_disk_full(OSError(errno.ENOSPC, "No space left on device"))
    assert space.is_disk_full(tokenizers_words)
    try:
        try:
            raise OSError(errno.ENOSPC, "write failed")
        except OSError as cause:
            raise RuntimeError("PytorchStreamWriter failed writing file") from cause
    except RuntimeError as wrapped:
        assert space.is_disk_full(wrapped)
    assert not space.is_disk_full(ValueError("shapes do not match"))
    message = space.disk_full_message(trained.checkpoints, 30e6)
    assert trained.checkpoints in message and "checkpoint-2, is intact" in message and "30 MB" in message


# ---- early errors ---------------------------------------------------------------------------------------------------

def test_one_row_of_data_asks_for_more_rows_not_a_lower_eval_rows():
    from datasets import Dataset

    from freetune.data import split_eval

    with pytest.raises(FreetuneError) as caught:
        split_eval(Dataset.from_list(ROWS[:1]), 1)
    assert "Add rows" in str(caught.value) and "Lower" not in str(caught.value)
    with pytest.raises(FreetuneError, match="Set `eval_rows` to at most 4"):
        split_eval(Dataset.from_list(ROWS), 5)


def test_lora_targets_matching_nothing_advises_a_value_the_parameters_cell_accepts(tiny_model_dir):
    import re

    from transformers import AutoModelForCausalLM

    from freetune import params
    from freetune.model import attach_lora

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(FreetuneError) as caught:
        attach_lora(model, rank=4, alpha=8, dropout=0.0, target_modules="nothing_proj")
    advice = re.search(r"e\.g\. ('[^']+')", str(caught.value)).group(1)
    value = advice.strip("'")
    assert not params.problems_with({"lora_targets": value})
    _, trainable, _ = attach_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), rank=4, alpha=8, dropout=0.0,
                                  target_modules=value)
    assert trainable > 0  # the advice attaches


def test_hub_repos_offline_or_unreachable_stop_before_anything_loads(monkeypatch):
    from huggingface_hub import constants

    from freetune import platform
    from freetune.secrets import require_hub_write

    monkeypatch.setenv("HF_TOKEN", "hf_FakeTokenForTheTest0123456789")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FreetuneError, match="HF_HUB_OFFLINE is set, so hub_repo = 'me/svg' cannot be pushed"):
        require_hub_write("me/svg", "hub_repo")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there: no internet
    platform._hub_problem.cache_clear()
    with pytest.raises(FreetuneError, match="Cannot reach the Hugging Face Hub .*set `hub_checkpoint_repo` to ''"):
        require_hub_write("me/ckpts", "hub_checkpoint_repo")
    platform._hub_problem.cache_clear()


# ---- through the notebook (the repro) -------------------------------------------------------------------------

@pytest.mark.slow
def test_a_notebook_rerun_with_another_lora_shape_stops_before_the_model_loads(executed_notebook, tmp_path):
    """Cost: one notebook run that stops at the data audit (~30-60 s on 2 cores); the trained run is the shared
    fixture's. Issue 46's repro: a rerun with lora_rank 16 (8 before) loaded the model, then failed with a
    state_dict size mismatch."""
    import shutil

    from conftest import run_recipe

    _, _, _, first = executed_notebook("svg_coder", "colab")
    shutil.copytree(first / "runs", tmp_path / "runs")  # the finished run's folder, its checkpoints included
    checkpoints = next((tmp_path / "runs").rglob("checkpoints"))
    # The tokenizer is saved once beside the checkpoints, not in each; each checkpoint records the run's identity.
    assert (checkpoints / "tokenizer" / "tokenizer.json").is_file()
    for folder in checkpoints.glob("checkpoint-*"):
        assert not (folder / "tokenizer.json").exists() and (folder / identity.IDENTITY).is_file()
    rank = identity.read_identity(checkpoints)["lora_rank"]
    result, record, _ = run_recipe("svg_coder", "colab", tmp_path, ("lora_rank", str(rank * 2)),
                                   ("max_steps", "10"))
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert f"lora_rank: {rank} in checkpoint-8, {rank * 2} now" in output, output[-3000:]
    assert f"set them back (lora_rank = {rank})" in output and "run_name to a new name" in output
    assert "size mismatch" not in output and "trainable parameters" not in output  # the model never loaded
