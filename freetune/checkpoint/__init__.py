"""Checkpoints that outlive the session, and the resume that finds the newest one that is really complete.

A Colab session can vanish mid-save, so a checkpoint folder on disk proves nothing. The Trainer writes
checkpoint-N/ file by file (adapter, optimizer, scheduler, RNG, trainer_state.json); only after all of it, and
after every rank has finished its part (a barrier), the main process writes `freetune_complete.json`: the step
and every file's size. A folder without that marker, or whose files no longer match it, is incomplete: the resume
deletes it and never loads it. What a kill at each point of a save leaves behind:

  during the adapter / optimizer / scheduler / RNG / trainer state   no marker -> deleted on resume
  while the marker is written (temp file, then an atomic rename)     no marker -> deleted on resume
  after the marker, before old checkpoints are rotated out           one complete checkpoint too many: fine
  during rotation (an old one is renamed `.deleting-...`, then       the scratch folder is deleted on resume; a
  deleted)                                                           half-deleted folder never keeps a checkpoint name

Old checkpoints are rotated out only after the new one's marker is written, and only complete ones count, so
there are always at least `save_total_limit` (>= 2) complete checkpoints once that many were saved.

The files, one job each (this package re-exports their names):
    marker.py   the completion marker, rotation, the newest complete checkpoint
    resume.py   the checkpoint every rank resumes from, local or from the Hub
    stop.py     stopping early: the time budget and SIGTERM, the ranks agreeing on the step
    hub.py      the optional Hub sync of each complete checkpoint, and its download on resume
    identity.py what a run's checkpoints were trained with, compared before a resume loads the model
    lock.py     one run per run folder: a second run or notebook is refused, a killed one's lock is stale
    space.py    free disk for checkpoints, adapter and export, checked before training; a full disk mid-run
"""

# The Trainer's side of a save is freetune.trainer.FreetuneTrainer.
from freetune.checkpoint.hub import HubSync
from freetune.checkpoint import lock, space
from freetune.checkpoint.identity import check_resumed, check_same_run
from freetune.checkpoint.marker import (MARKER, check_complete, checkpoint_step, complete_checkpoints, latest_complete,
                                        remove_incomplete, rotate, weights_finite, write_marker)
from freetune.checkpoint.resume import agree_on_resume, find_resume_checkpoint
from freetune.checkpoint.stop import BUDGET_MARGIN_MIN, StopAgreement, sigterm_stops, stop_callback, time_budget

__all__ = ["BUDGET_MARGIN_MIN", "MARKER", "HubSync", "StopAgreement", "agree_on_resume", "check_complete",
           "check_resumed", "check_run", "check_same_run", "lock", "space",
           "checkpoint_step", "complete_checkpoints", "find_resume_checkpoint", "latest_complete", "remove_incomplete",
           "rotate", "sigterm_stops", "stop_callback", "time_budget", "weights_finite", "write_marker"]


def check_run(paths, params: dict, plan, train_rows) -> None:
    """The data audit cell's last check, before the model loads: a resume is of the same run (identity.py), and
    the disk holds what the run will write (space.py)."""
    check_same_run(paths, params, train_rows)
    space.check_disk(paths, params, plan)
