"""Which checkpoint a run resumes from: the newest complete one, local or on the Hub, decided by the main process and
told to the others. Its own module because it reads both the markers (freetune.checkpoint.marker) and the Hub sync
(freetune.checkpoint.hub), which itself reads the markers."""

from __future__ import annotations

from pathlib import Path

from freetune.checkpoint.hub import HubSync
from freetune.checkpoint.marker import checkpoint_step, latest_complete, remove_incomplete
from freetune.distributed import context


# ---- Resume -------------------------------------------------------------------------------------------------

def find_resume_checkpoint(checkpoints_dir: str | Path, hub: HubSync | None = None) -> Path | None:
    """On the main process: clean up interrupted saves, then the newest complete checkpoint, local or on the Hub."""
    for what in remove_incomplete(checkpoints_dir):
        print(f"Removed incomplete checkpoint {what}; it is never loaded.", flush=True)
    local = latest_complete(checkpoints_dir)
    if hub is not None:
        remote = hub.latest_step()
        if remote is not None and (local is None or remote > checkpoint_step(local)):
            here = f"newer than the local checkpoint-{checkpoint_step(local)}" if local else "none here"
            print(f"The Hub repo {hub.repo_id} holds checkpoint-{remote} ({here}): downloading it.", flush=True)
            local = hub.download(remote, checkpoints_dir)
    return local


def agree_on_resume(checkpoints_dir: str | Path, max_steps: int, hub: HubSync | None = None) -> str | None:
    """The checkpoint every rank resumes from: the main process decides (and says so), the others are told."""
    import torch.distributed as dist

    ctx = context()
    choice = None
    if ctx.is_main:
        found = find_resume_checkpoint(checkpoints_dir, hub)
        if found is None:
            print(f"No complete checkpoint in {checkpoints_dir}: starting at step 0.", flush=True)
        else:
            choice = str(found)
            print(f"Resuming from {found.name} at step {checkpoint_step(found)} of {max_steps}: {found}", flush=True)
            if checkpoint_step(found) >= max_steps:
                print("That checkpoint is at or past max_steps: this run's training is already done. No step "
                      "is trained; its adapter is saved as the run's. To train further, raise max_steps (it goes "
                      f"on from {found.name}); to start afresh, change run_name.", flush=True)
    if ctx.distributed and dist.is_initialized():
        box = [choice]
        dist.broadcast_object_list(box, src=0)
        choice = box[0]
    return choice
