"""Hub sync (optional): the main process uploads each complete checkpoint to a private Hub repo, in a background
thread with retries, one commit per checkpoint (a Hub commit is all-or-nothing). When the Hub holds a newer
complete checkpoint than the local folder (a new Colab session starts empty), the resume downloads it first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from pathlib import Path

from freetune.checkpoint.marker import MARKER, check_complete, checkpoint_step, latest_complete
from freetune.distributed import print0
from freetune.errors import FreetuneError
from freetune.secrets import hf_token, redact

TOKENIZER_DIR = "tokenizer"  # freetune.trainer.save_tokenizer_once writes the run's tokenizer there, once

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

    _tokenizer_sent = False

    def _upload_tokenizer_once(self, tokenizer_dir: Path) -> None:
        """The run's tokenizer (saved once beside the checkpoints, not in each) to <run_name>/tokenizer, once per
        session: a checkpoint taken from the Hub is usable without the base model's repo."""
        if self._tokenizer_sent or not tokenizer_dir.is_dir():
            return
        try:
            self.api.upload_folder(repo_id=self.repo_id, folder_path=str(tokenizer_dir), repo_type="model",
                                   path_in_repo=f"{self.run_name}/{TOKENIZER_DIR}",
                                   commit_message=f"freetune {self.run_name}/{TOKENIZER_DIR}")
            self._tokenizer_sent = True
        except Exception as exc:  # the next checkpoint's upload tries again
            print(f"Hub sync: the tokenizer's upload failed ({self._clean(exc)}).", flush=True)

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
        self._upload_tokenizer_once(folder.parent / TOKENIZER_DIR)
        try:
            for old in self.complete_steps()[:-self.keep] if self.keep > 0 else []:
                self.api.delete_folder(self._remote(old), self.repo_id, repo_type="model",
                                       commit_message=f"freetune: rotate out {self._remote(old)}")
        except Exception as exc:
            print(f"Hub sync: could not delete old checkpoints from {self.repo_id} ({self._clean(exc)}).", flush=True)
