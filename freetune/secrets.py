"""The Hugging Face token, from wherever the platform keeps secrets, and never shown.

Order: Colab's secrets (the key icon), Kaggle's secrets (Add-ons > Secrets), then the environment (HF_TOKEN,
HUGGING_FACE_HUB_TOKEN). Each platform's client is asked only where it can be imported, so the same call works
on a laptop, in CI and under torchrun. The token is returned, never printed or logged; `redact` scrubs any token
out of a message before it is shown (libraries sometimes echo request headers in their errors).
"""

from __future__ import annotations

import os
import re
from typing import Iterable

from freetune.errors import FreetuneError
from freetune.platform import detect, require_hub

SECRET_NAME = "HF_TOKEN"
ENV_VARS = ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")
# User access tokens are "hf_" plus 30-odd letters and digits; 8+ is enough to catch one cut short in a log line.
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{8,}")
REDACTED = "hf_***"

WHERE_TO_ADD = {
    "colab": "Colab: click the key icon in the left bar -> Secrets -> add HF_TOKEN and switch 'Notebook access' on.",
    "kaggle": "Kaggle: Add-ons -> Secrets -> add HF_TOKEN and tick it so it is attached to this notebook.",
    "local": "Elsewhere: `export HF_TOKEN=hf_...` in the shell that starts Python (or Jupyter).",
}


def _from_colab() -> tuple[str | None, str]:
    try:
        from google.colab import userdata  # only importable on Colab
    except ImportError:
        return None, ""
    try:
        return userdata.get(SECRET_NAME) or None, "Colab secrets"
    except Exception as exc:  # SecretNotFoundError, NotebookAccessError: both mean "not usable here"
        return None, f"Colab secrets ({type(exc).__name__})"


def _from_kaggle() -> tuple[str | None, str]:
    try:
        from kaggle_secrets import UserSecretsClient  # only importable on Kaggle
    except ImportError:
        return None, ""
    try:
        return UserSecretsClient().get_secret(SECRET_NAME) or None, "Kaggle secrets"
    except Exception as exc:  # a secret that is missing or not attached to this notebook
        return None, f"Kaggle secrets ({type(exc).__name__})"


def find_hf_token() -> tuple[str | None, str]:
    """(token or None, where it came from / where we looked). The source names never include the token."""
    looked = []
    for source in (_from_colab, _from_kaggle):
        token, where = source()
        if token:
            return token.strip(), where
        if where:
            looked.append(where)
    for var in ENV_VARS:
        if os.environ.get(var, "").strip():
            return os.environ[var].strip(), f"the {var} environment variable"
    looked.append("the environment (" + ", ".join(ENV_VARS) + ")")
    return None, ", ".join(looked)


def hf_token(required: bool, purpose: str) -> str | None:
    """The Hugging Face token, or None when not required and not set.

    required: raise a FreetuneError (saying where to add the token on this platform) when it is missing.
    purpose: what the token is for, shown in that error ("upload the adapter to you/my-model").
    """
    token, where = find_hf_token()
    if token or not required:
        return token
    here = detect()
    others = [text for name, text in WHERE_TO_ADD.items() if name != here]
    raise FreetuneError(
        f"A Hugging Face token is needed to {purpose}, and none was found (looked in {where}).\n"
        f"  {WHERE_TO_ADD[here]}\n  " + "\n  ".join(others) + "\n"
        "Create a token with 'Write' access at huggingface.co -> Settings -> Access Tokens. Never paste the token "
        "into a notebook cell: cells are saved and shared with the notebook.")


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """text with every Hugging Face token (and each of `secrets`, whatever its shape) replaced by 'hf_***'."""
    text = str(text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, REDACTED)
    return _TOKEN_PATTERN.sub(REDACTED, text)


def require_hub_write(repo: str, parameter: str, api=None) -> None:
    """Before anything is loaded: the token is there, the Hub answers, and the token may write (`parameter` names the
    setting that asked for it). Without this, `hub_repo` failed after the whole run and `hub_checkpoint_repo`
    after the model had loaded. A fine-grained token's per-repo rights are not read here: its first upload says."""
    from huggingface_hub import constants

    token = hf_token(required=True, purpose=f"push to {repo} ({parameter})")
    if constants.is_offline_mode():
        raise FreetuneError(f"HF_HUB_OFFLINE is set, so {parameter} = {repo!r} cannot be pushed to: unset HF_HUB_OFFLINE "
                            f"(with the internet on), or set `{parameter}` to ''.")
    require_hub(f"{parameter} {repo!r}", parameter, advice=f"or set `{parameter}` to '' to keep it local")
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
    try:
        role = api.whoami(token=token).get("auth", {}).get("accessToken", {}).get("role")
    except Exception as exc:
        raise FreetuneError(f"The Hub refused the HF_TOKEN found for {parameter} ({redact(str(exc), [token])[:200]}): "
                            f"replace it with a valid token that has write access (huggingface.co/settings/tokens), "
                            f"or set `{parameter}` to ''.") from None
    if role == "read":
        raise FreetuneError(f"The HF_TOKEN found is a read-only token, and {parameter} = {repo!r} needs to write: make a "
                            f"token with write access (huggingface.co/settings/tokens) and store it as HF_TOKEN, or set "
                            f"`{parameter}` to ''.")
