"""Share a folder on the Hub: rank 0 only, the token from the platform's secrets, network failures retried and
refused credentials explained."""

from __future__ import annotations

import time
from pathlib import Path

from freetune.errors import FreetuneError
from freetune.export.adapter import _is_main
from freetune.params import HUB_ID as _HUB_ID
from freetune.secrets import hf_token, redact


def _status_code(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None)
    return getattr(response, "status_code", None)


def push_to_hub(folder: str | Path, repo_id: str, *, token: str | None = None, private: bool = True, api=None,
                is_main_process: bool | None = None, commit_message: str = "Upload with freetune",
                path_in_repo: str | None = None, allow_patterns=None, ignore_patterns=("*.log",),
                retries: int = 3, retry_wait_s: float = 5.0) -> str | None:
    """Upload folder to the Hub model repo repo_id (created if missing, private by default); returns its URL.

    Runs on the main process only (None elsewhere). token: None reads HF_TOKEN from the platform's secrets, and
    a missing token is an error before anything is sent. api: an object with HfApi's create_repo and
    upload_folder (default: huggingface_hub.HfApi). Network failures are retried; refused credentials are not.
    allow_patterns / ignore_patterns: which files go (logs such as convert.log stay behind by default).
    """
    if not _is_main(is_main_process):
        return None
    if not _HUB_ID.fullmatch(repo_id or ""):
        raise FreetuneError(f"repo_id {repo_id!r} is not 'user-or-org/name'. Use your Hub user name, e.g. "
                            f"'your-name/svg-coder-qwen2.5-1.5b'.")
    token = token or hf_token(required=True, purpose=f"upload to {repo_id}")
    source = Path(folder).expanduser()
    if not source.is_dir() or not any(source.iterdir()):
        raise FreetuneError(f"Nothing to upload: {str(source)!r} is not a folder with files.")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi()

    def attempt(what: str, call):
        for attempt_no in range(1, retries + 1):
            try:
                return call()
            except Exception as exc:  # HfHubHTTPError, requests/httpx errors, timeouts: sorted out below
                status = _status_code(exc)
                message = redact(str(exc), [token])[:400]
                if status in (401, 403):
                    raise FreetuneError(
                        f"The Hub refused to {what} ({status}): {message}\nThe token needs 'Write' access, and "
                        f"{repo_id.split('/')[0]!r} must be your user name or an organisation you can write to. "
                        f"The files are still in {source}.") from None
                if attempt_no == retries or (status is not None and 400 <= status < 500 and status != 429):
                    raise FreetuneError(f"Could not {what} after {attempt_no} attempt(s): {message}\n"
                                        f"The files are still in {source}; run this cell again.") from None
                wait = retry_wait_s * 2 ** (attempt_no - 1)
                print(f"Could not {what} ({message[:160]}); retrying in {wait:.0f} s "
                      f"({attempt_no}/{retries}).", flush=True)
                time.sleep(wait)

    print(f"Uploading {source} to https://huggingface.co/{repo_id} ({'private' if private else 'public'}) ...",
          flush=True)
    attempt(f"create the repo {repo_id}", lambda: api.create_repo(
        repo_id=repo_id, token=token, private=private, repo_type="model", exist_ok=True))
    attempt(f"upload {source.name} to {repo_id}", lambda: api.upload_folder(
        repo_id=repo_id, folder_path=str(source), token=token, repo_type="model", commit_message=commit_message,
        path_in_repo=path_in_repo, allow_patterns=allow_patterns,
        ignore_patterns=list(ignore_patterns) if ignore_patterns else None))
    url = f"https://huggingface.co/{repo_id}"
    print(f"Uploaded: {url}", flush=True)
    return url
