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

Stopping early: a time budget (default: the platform's session limit minus a margin) and SIGTERM both stop at
the end of a step and save a complete checkpoint; under DDP the ranks agree on the step through one tiny
all_reduce per step, or one rank would wait forever for the others at the save.

Hub sync (optional): the main process uploads each complete checkpoint to a private Hub repo, in a background
thread with retries, one commit per checkpoint (a Hub commit is all-or-nothing). When the Hub holds a newer
complete checkpoint than the local folder (a new Colab session starts empty), the resume downloads it first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path

from freetune.distributed import context, print0
from freetune.errors import FreetuneError

MARKER = "freetune_complete.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
# Scratch folders: a checkpoint being deleted, or one being downloaded from the Hub. Never loaded, removed on resume.
_SCRATCH_PREFIXES = (".deleting-", ".download-")
# The platform limit minus this: time for the final save, the evaluation and the export after training.
BUDGET_MARGIN_MIN = 60


# ---- Completeness -------------------------------------------------------------------------------------------

def checkpoint_step(path: str | Path) -> int | None:
    match = _CHECKPOINT.match(Path(path).name)
    return int(match.group(1)) if match else None


def check_complete(folder: str | Path) -> tuple[bool, str]:
    """(complete?, why): the marker exists, names this step, and every file it lists has the recorded size."""
    folder = Path(folder)
    marker = folder / MARKER
    if not marker.is_file():
        return False, "no completion marker (its save was interrupted)"
    try:
        info = json.loads(marker.read_text())
        files = dict(info["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return False, "unreadable completion marker"
    if info.get("step") != checkpoint_step(folder):
        return False, f"its marker is for step {info.get('step')}"
    for name, size in files.items():
        path = folder / name
        if not path.is_file():
            return False, f"{name} is missing"
        if path.stat().st_size != size:
            return False, f"{name} has {path.stat().st_size} bytes, the marker says {size}"
    return True, f"complete: step {info['step']}, {len(files)} files"


def _required_files(world_size: int) -> list[str]:
    rng = ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{rank}.pth" for rank in range(world_size)]
    return ["trainer_state.json", "optimizer.pt", "scheduler.pt", *rng]


def write_marker(folder: str | Path, step: int, world_size: int) -> Path:
    """Declare checkpoint-N complete: flush every file to disk, then write the marker atomically (temp + rename)."""
    folder = Path(folder)
    # FSDP (FULL_STATE_DICT) saves the gathered optimizer state as optimizer.bin, written by rank 0 alone,
    # beside pytorch_model_fsdp.bin (the adapter for the resume); DDP and one process save optimizer.pt.
    fsdp_optimizer = (folder / "optimizer.bin").is_file()
    missing = [name for name in _required_files(world_size) if not (folder / name).is_file()
               and not (name == "optimizer.pt" and fsdp_optimizer)]
    if not any(folder.glob("*.safetensors")):
        missing.append("the adapter weights (*.safetensors)")
    if missing:
        # A bug, not a user error: declaring this checkpoint complete would make a later resume load garbage.
        raise RuntimeError(f"{folder} lacks {missing} after the Trainer saved it; not marking it complete.")
    files = {}
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER):
        _fsync(path)
        files[path.relative_to(folder).as_posix()] = path.stat().st_size
    info = {"step": step, "world_size": world_size, "files": files, "written_at": time.time()}
    temporary = folder / f".{MARKER}.tmp"
    with open(temporary, "w") as f:
        json.dump(info, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, folder / MARKER)
    _fsync(folder)
    return folder / MARKER


def _fsync(path: Path) -> None:
    # The page cache survives a killed process but not a lost machine; a marker must never reach the disk before
    # the files it vouches for.
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some FUSE mounts (Drive) refuse fsync on directories; the rename order still holds there
    finally:
        os.close(fd)


def complete_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete checkpoint-N folders, oldest step first."""
    folder = Path(checkpoints_dir)
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and checkpoint_step(p) is not None and check_complete(p)[0]]
    return sorted(found, key=checkpoint_step)


def latest_complete(checkpoints_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def remove_incomplete(checkpoints_dir: str | Path) -> list[str]:
    """Delete interrupted saves and scratch folders (they are never loaded); returns what was removed and why.

    Deleted rather than moved aside: an incomplete checkpoint cannot be repaired, and on Drive each one can weigh
    as much as the optimizer state (hundreds of MB), many times over after repeated disconnects.
    """
    folder = Path(checkpoints_dir)
    if not folder.is_dir():
        return []
    removed = []
    for path in sorted(folder.iterdir()):
        if not path.is_dir():
            continue
        if path.name.startswith(_SCRATCH_PREFIXES):
            reason = "a leftover of an interrupted rotation or download"
        elif checkpoint_step(path) is not None:
            complete, reason = check_complete(path)
            if complete:
                continue
        else:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(f"{path.name} ({reason})")
    return removed


def rotate(checkpoints_dir: str | Path, keep: int, protect: set[str] = frozenset()) -> list[str]:
    """Delete the oldest complete checkpoints beyond `keep` (run only after the newest one's marker is written).

    protect: folder names still being uploaded to the Hub. Each victim is first renamed aside, so a kill halfway
    through the deletion leaves a scratch folder, never a half-deleted folder named like a checkpoint.
    """
    complete = complete_checkpoints(checkpoints_dir)
    victims = [p for p in complete[:-keep] if p.name not in protect] if keep > 0 else []
    for path in victims:
        _discard(path)
    return [p.name for p in victims]


def _discard(path: Path) -> None:
    aside = path.with_name(".deleting-" + path.name)
    if aside.exists():
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


# ---- Resume -------------------------------------------------------------------------------------------------

def find_resume_checkpoint(checkpoints_dir: str | Path, hub: "HubSync | None" = None) -> Path | None:
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


def agree_on_resume(checkpoints_dir: str | Path, max_steps: int, hub: "HubSync | None" = None) -> str | None:
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


# ---- The Trainer: rank 0 writes everything, and marks each checkpoint complete -------------------------------

def trainer_class(base):
    """`base` (TRL's SFTTrainer) with complete-or-ignored checkpoints; built on demand (transformers loads late)."""
    import random

    import numpy as np
    import torch

    from freetune.distributed import barrier

    class CheckpointingTrainer(base):
        resumed_at = 0  # the step this session started from (0, or the checkpoint's step)
        tokens_at_resume = 0  # TRL's num_tokens count at that step
        nonfinite_weights_at: str | None = None  # set when a save found NaN/inf weights (nothing was written)

        def __init__(self, *args, hub: "HubSync | None" = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.hub = hub

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

        def _save_checkpoint(self, model, trial):
            # The loss is checked at log steps only (train.NonFiniteGuard); a save between them must not write
            # weights an overflow has already poisoned, or the resume would go on from them.
            if not weights_finite(model):
                self.nonfinite_weights_at = f"at step {self.state.global_step} the adapter's weights hold NaN or inf"
                self.control.should_training_stop = True
                return
            folder = Path(self._get_output_dir(trial)) / f"checkpoint-{self.state.global_step}"
            if self.args.should_save:
                (folder / MARKER).unlink(missing_ok=True)  # a folder being (re)written is never complete
            # The Trainer's own rotation runs before anything could mark the new checkpoint complete, counts
            # interrupted saves and sorts by mtime; it is switched off here and `rotate` runs after the marker.
            keep, self.args.save_total_limit = self.args.save_total_limit, None
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self.args.save_total_limit = keep
            barrier()  # every rank has written its share (and sent its RNG state) before the marker says so
            if self.args.should_save:
                write_marker(folder, self.state.global_step, self.args.world_size)
                busy = self.hub.busy() if self.hub else set()
                rotate(folder.parent, keep or 0, protect=busy)
                if self.hub:
                    self.hub.submit(folder)

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

        def _load_optimizer_and_scheduler(self, checkpoint):
            if checkpoint and self.args.world_size > 1 and self.args.device.type == "cpu":
                # DDP on CPUs (gloo, as in CI): transformers maps the optimizer state to args.device, "cpu:0",
                # which torch.load cannot restore to. The same files, loaded onto the CPU.
                folder = Path(checkpoint)
                self.optimizer.load_state_dict(torch.load(folder / "optimizer.pt", map_location="cpu",
                                                          weights_only=True))
                self.lr_scheduler.load_state_dict(torch.load(folder / "scheduler.pt", weights_only=True))
                return
            super()._load_optimizer_and_scheduler(checkpoint)

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

    return CheckpointingTrainer


def weights_finite(model) -> bool:
    """Whether every trainable weight is finite, on every rank (one host sync: for saves, not for every step)."""
    import torch
    import torch.distributed as dist

    weights = [p for p in model.parameters() if p.requires_grad]
    if not weights:
        return True
    finite = torch.stack([torch.isfinite(p).all() for p in weights]).all().to(torch.int32)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)  # FSDP: each rank holds a shard; all stop or none
    return bool(finite.item())


# ---- Stopping early: a time budget and SIGTERM ----------------------------------------------------------------

def time_budget(minutes: float, platform: str) -> tuple[float | None, str]:
    """(seconds or None, why): minutes > 0 is the user's budget; 0 is the platform's limit minus a margin."""
    from freetune.platform import PLATFORMS

    if minutes < 0:
        raise FreetuneError(f"time_budget_min = {minutes} is negative. Set it to the minutes training may run, or 0 "
                            f"for the platform's default (its session limit minus {BUDGET_MARGIN_MIN} min).")
    if minutes > 0:
        return minutes * 60, f"{minutes:g} min (time_budget_min)"
    limit_h = PLATFORMS[platform].time_limit_h if platform in PLATFORMS else None
    if not limit_h:
        return None, "none (no session limit here; set time_budget_min to have one)"
    budget_min = max(limit_h * 60 - BUDGET_MARGIN_MIN, 1)
    return budget_min * 60, (f"{budget_min:g} min ({platform}'s {limit_h:g} h session limit minus {BUDGET_MARGIN_MIN} "
                             f"min for the final save, evaluation and export)")


def stop_callback(budget_s: float | None, budget_text: str):
    """A TrainerCallback that stops at a step end, saving a complete checkpoint, when the budget runs out or a
    SIGTERM arrived. `.reason` says why it stopped (None: it did not)."""
    from transformers import TrainerCallback

    class StopAndSave(TrainerCallback):
        SIGTERM, BUDGET = 2, 1  # the all_reduce keeps the larger: a SIGTERM anywhere wins

        def __init__(self):
            self.reason: str | None = None
            self.sigterm = False
            self.started = self.first_step = None
            self.agreement = StopAgreement()

        def on_train_begin(self, args, state, control, **kwargs):
            self.started, self.first_step = time.monotonic(), state.global_step

        def on_step_end(self, args, state, control, **kwargs):
            flag = 0
            if self.sigterm:
                flag = self.SIGTERM
            elif budget_s is not None:
                elapsed = time.monotonic() - self.started
                per_step = elapsed / max(state.global_step - self.first_step, 1)
                # The stop comes `lag` steps after the flag is raised (the ranks learn it a step later), so the
                # check looks that much further ahead: the last step still ends inside the budget.
                if elapsed + (1 + self.agreement.lag) * per_step >= budget_s:
                    flag = self.BUDGET
            flag = self.agreement.exchange(flag, args.device)
            if flag and state.global_step < state.max_steps:
                self.reason = "SIGTERM received" if flag == self.SIGTERM else f"time budget of {budget_text} reached"
                control.should_save = True
                control.should_training_stop = True
                print0(f"Stopping at step {state.global_step} of {state.max_steps}: {self.reason}. Saving a "
                       f"checkpoint; run this again with the same run_name to continue.")
            return control

    return StopAndSave()


class StopAgreement:
    """Every rank's stop flag, agreed on without making the host wait for the GPU.

    Under DDP all ranks must stop at the same step, so each step end takes the largest flag over the ranks. Read
    at once (an all_reduce, then .item()), that is a host sync at every step: the CPU waits for everything queued
    on the GPU, including the other rank's gradients, and the two ranks then run in lock step, each waiting for
    the slower one's host at every step. Here the step's all_reduce and its copy to pinned host memory are only
    queued, and read at the next step end, by which time they have long finished: every rank stops one step
    after a flag is raised, all at the same step. One process: the flag itself, at once (`lag` 0)."""

    def __init__(self):
        self.pending = None  # (the wait for the last exchange, the tensor its agreed flag lands in)
        self.host = self.done = None  # CUDA: one pinned host slot and one event, reused at every step

    @property
    def lag(self) -> int:
        import torch.distributed as dist

        return 1 if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 else 0

    def exchange(self, flag: int, device) -> int:
        """Queue this step's flag; return the flag agreed at the previous step (0 at the first)."""
        import torch
        import torch.distributed as dist

        if not self.lag:
            return flag
        agreed = self.collect()  # also frees the host slot for this step's copy
        # torch.full, not torch.tensor([flag], device=...): a copy from host memory would wait for the GPU too.
        tensor = torch.full((1,), flag, dtype=torch.int32, device=device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
        if tensor.is_cuda:
            if self.host is None:
                self.host, self.done = torch.empty(1, dtype=torch.int32, pin_memory=True), torch.cuda.Event()
            work.wait()  # NCCL: the current stream waits for the all_reduce; the host goes on
            self.host.copy_(tensor, non_blocking=True)
            self.done.record()
            # Waited for at the next step end, long reached by then: the GPU has run a whole step since.
            self.pending = (self.done.synchronize, self.host)
        else:  # gloo: the host runs the collective itself (Work.wait; its synchronize() does not wait for it)
            self.pending = (work.wait, tensor)
        return agreed

    def collect(self) -> int:
        """The flag agreed at the last exchange (0 if none is pending)."""
        if self.pending is None:
            return 0
        wait, tensor = self.pending
        self.pending = None
        wait()
        return int(tensor.item())


@contextmanager
def sigterm_stops(callback):
    """While training, SIGTERM asks `callback` to stop and save at the end of the step (a second one acts as
    before). Signal handlers can only be set from the main thread; elsewhere SIGTERM keeps its usual meaning."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)

    def request_stop(signum, frame):
        callback.sigterm = True
        signal.signal(signal.SIGTERM, previous)

    signal.signal(signal.SIGTERM, request_stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# ---- Hub sync ---------------------------------------------------------------------------------------------------

class HubSync:
    """Upload complete checkpoints to a private Hub repo (main process only, in the background) and fetch the
    newest one back. `api` is a huggingface_hub.HfApi (tests pass a local stand-in with the same methods).

    Each checkpoint goes to <repo>/<run_name>/checkpoint-N in one commit, marker included; a Hub commit is
    all-or-nothing, and the download checks the marker and sizes again anyway.
    """

    retry_delays_s = (10.0, 30.0, 90.0)  # after the 1st, 2nd, 3rd failed attempt; then it gives up on that one

    def __init__(self, repo_id: str, run_name: str, keep: int, api, token: str):
        self.repo_id, self.run_name, self.keep, self.api = repo_id, run_name, keep, api
        self._token = token  # kept only to scrub it out of error messages
        self._cond = threading.Condition()
        self._pending: Path | None = None
        self._uploading: str | None = None
        self._closing = False
        self._thread: threading.Thread | None = None
        self.uploaded: list[str] = []
        self.failed: list[str] = []

    @classmethod
    def connect(cls, repo_id: str, run_name: str, keep: int, api=None) -> "HubSync":
        """Find the token and make sure the private repo exists, before any training (errors say what to do)."""
        from freetune.secrets import hf_token

        token = hf_token(required=True, purpose=f"sync checkpoints to the private Hub repo {repo_id!r} "
                                                f"(hub_checkpoint_repo)")
        if api is None:
            from huggingface_hub import HfApi

            api = HfApi(token=token)
        sync = cls(repo_id, run_name, keep, api, token)
        try:
            api.create_repo(repo_id, private=True, exist_ok=True, repo_type="model")
        except Exception as exc:
            raise FreetuneError(f"Could not create or reach the private Hub repo {repo_id!r}: {sync._clean(exc)}. "
                                f"Check hub_checkpoint_repo ('your-name/some-repo') and that HF_TOKEN has write "
                                f"access; or set hub_checkpoint_repo to '' to keep checkpoints local only.") from None
        print0(f"Hub sync on: each complete checkpoint is uploaded to the private repo {repo_id} "
               f"under {run_name}/.")
        return sync

    def _clean(self, exc: BaseException) -> str:
        from freetune.secrets import redact

        return redact(f"{type(exc).__name__}: {exc}", [self._token])[:500]

    def _remote(self, step: int) -> str:
        return f"{self.run_name}/checkpoint-{step}"

    def complete_steps(self) -> list[int]:
        pattern = re.compile(rf"^{re.escape(self.run_name)}/checkpoint-(\d+)/{re.escape(MARKER)}$")
        files = self.api.list_repo_files(self.repo_id, repo_type="model")
        return sorted(int(m.group(1)) for m in map(pattern.match, files) if m)

    def latest_step(self) -> int | None:
        try:
            steps = self.complete_steps()
        except Exception as exc:
            print(f"Could not list the checkpoints in the Hub repo {self.repo_id} ({self._clean(exc)}); "
                  f"resuming from local checkpoints only.", flush=True)
            return None
        return steps[-1] if steps else None

    def download(self, step: int, checkpoints_dir: str | Path) -> Path | None:
        """Fetch checkpoint-N into a scratch folder, check it, then rename it into place (None if it fails)."""
        target = Path(checkpoints_dir) / f"checkpoint-{step}"
        scratch = Path(checkpoints_dir) / f".download-checkpoint-{step}"
        shutil.rmtree(scratch, ignore_errors=True)
        remote = self._remote(step)
        try:
            marker = self.api.hf_hub_download(self.repo_id, f"{remote}/{MARKER}", repo_type="model",
                                              local_dir=scratch)
            for name in json.loads(Path(marker).read_text())["files"]:
                self.api.hf_hub_download(self.repo_id, f"{remote}/{name}", repo_type="model", local_dir=scratch)
        except Exception as exc:
            print(f"Downloading {remote} from {self.repo_id} failed ({self._clean(exc)}); "
                  f"resuming from local checkpoints only.", flush=True)
            shutil.rmtree(scratch, ignore_errors=True)
            return latest_complete(checkpoints_dir)
        fetched = scratch / remote
        complete, why = check_complete(fetched)
        if not complete:
            shutil.rmtree(scratch, ignore_errors=True)
            print(f"{remote} on the Hub is not complete ({why}); not using it.", flush=True)
            return latest_complete(checkpoints_dir)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(fetched, target)
        shutil.rmtree(scratch, ignore_errors=True)
        return target

    # -- background uploads --

    def submit(self, folder: str | Path) -> None:
        """Queue a complete checkpoint; a newer one queued before the upload starts replaces it."""
        with self._cond:
            self._pending = Path(folder)
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="freetune-hub-sync", daemon=True)
                self._thread.start()
            self._cond.notify()

    def busy(self) -> set[str]:
        """Checkpoint folder names queued or being uploaded: rotation must not delete them yet."""
        with self._cond:
            return {name for name in (self._uploading, self._pending and self._pending.name) if name}

    def close(self) -> None:
        """Wait for the queued upload (the final checkpoint must reach the Hub before the session ends)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
            thread = self._thread
            waiting = self._pending or self._uploading
        if thread is not None:
            if waiting:
                print0(f"Waiting for the upload of {Path(str(waiting)).name} to {self.repo_id} ...")
            thread.join()

    def _work(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closing:
                    self._cond.wait()
                if self._pending is None:
                    return
                folder, self._pending = self._pending, None
                self._uploading = folder.name
            try:
                self._upload(folder)
            finally:
                with self._cond:
                    self._uploading = None

    def _upload(self, folder: Path) -> None:
        step = checkpoint_step(folder)
        for attempt, delay in enumerate([*self.retry_delays_s, None], start=1):
            try:
                complete, why = check_complete(folder)
                if not complete:  # cannot happen for a queued folder unless someone deleted files by hand
                    print(f"Hub sync: not uploading {folder.name}: {why}.", flush=True)
                    return
                self.api.upload_folder(repo_id=self.repo_id, folder_path=str(folder), path_in_repo=self._remote(step),
                                       repo_type="model", commit_message=f"freetune {self._remote(step)}")
                break
            except Exception as exc:
                if delay is None:
                    self.failed.append(folder.name)
                    print(f"Hub sync: giving up on {folder.name} after {attempt} attempts ({self._clean(exc)}). "
                          f"Training goes on; the next checkpoint is tried again.", flush=True)
                    return
                print(f"Hub sync: uploading {folder.name} failed ({self._clean(exc)}); retrying in {delay:g} s.",
                      flush=True)
                time.sleep(delay)
        self.uploaded.append(folder.name)
        print(f"Hub sync: {folder.name} uploaded to {self.repo_id}/{self._remote(step)}.", flush=True)
        try:
            for old in self.complete_steps()[:-self.keep] if self.keep > 0 else []:
                self.api.delete_folder(self._remote(old), self.repo_id, repo_type="model",
                                       commit_message=f"freetune: rotate out {self._remote(old)}")
        except Exception as exc:
            print(f"Hub sync: could not delete old checkpoints from {self.repo_id} ({self._clean(exc)}).", flush=True)
