"""The Hugging Face token: where it is read from, what a missing one says, and that it is never shown."""

import pytest

from freetune.errors import FreetuneError
from freetune.secrets import ENV_VARS, find_hf_token, hf_token, redact

FAKE = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"


@pytest.fixture
def no_token_env(monkeypatch):
    for var in ENV_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in ("COLAB_RELEASE_TAG", "KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE"):
        monkeypatch.delenv(var, raising=False)


def test_token_comes_from_the_environment(no_token_env, monkeypatch):
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", FAKE)
    assert hf_token(required=True, purpose="upload") == FAKE
    monkeypatch.setenv("HF_TOKEN", " hf_first0000000000 \n")  # HF_TOKEN wins; pasted whitespace is dropped
    token, where = find_hf_token()
    assert token == "hf_first0000000000"
    assert where == "the HF_TOKEN environment variable" and "hf_first" not in where


def test_missing_token_is_none_when_optional(no_token_env):
    assert hf_token(required=False, purpose="download a gated model") is None


def test_missing_required_token_says_where_to_add_it(no_token_env):
    with pytest.raises(FreetuneError) as err:
        hf_token(required=True, purpose="upload to me/svg-coder")
    message = str(err.value)
    assert "upload to me/svg-coder" in message
    assert "key icon" in message and "Notebook access" in message        # Colab
    assert "Add-ons -> Secrets" in message and "attached" in message     # Kaggle
    assert "export HF_TOKEN" in message                                   # elsewhere
    assert message.index("export HF_TOKEN") < message.index("key icon")   # this machine's way comes first


def test_redact_scrubs_tokens_and_named_secrets():
    text = f"401 Client Error for url (Authorization: Bearer {FAKE}); retry with {FAKE[:20]}"
    clean = redact(text)
    assert FAKE not in clean and FAKE[:20] not in clean
    assert clean.count("hf_***") == 2 and clean.startswith("401 Client Error")
    assert redact("password is s3cr3t-value", secrets=["s3cr3t-value"]) == "password is hf_***"
    assert redact("nothing secret: hf_ is a prefix") == "nothing secret: hf_ is a prefix"


def _platform_module(monkeypatch, name: str, **attrs):
    import sys
    import types

    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, module)
    return module


def test_platform_secrets_come_before_the_environment(no_token_env, monkeypatch):
    # Stand-ins for Colab's and Kaggle's secret clients, which exist only on those platforms.
    class SecretNotFoundError(Exception):
        pass

    colab_secrets = {}

    def colab_get(name):
        if name not in colab_secrets:
            raise SecretNotFoundError(name)
        return colab_secrets[name]

    google = _platform_module(monkeypatch, "google")
    google.colab = _platform_module(monkeypatch, "google.colab", userdata=type("userdata", (), {
        "get": staticmethod(colab_get)}))

    class UserSecretsClient:
        def get_secret(self, name):
            return "hf_kaggle00000000000000" if name == "HF_TOKEN" else None

    monkeypatch.setenv("HF_TOKEN", "hf_environment0000000000")
    assert find_hf_token() == ("hf_environment0000000000", "the HF_TOKEN environment variable")
    _platform_module(monkeypatch, "kaggle_secrets", UserSecretsClient=UserSecretsClient)
    assert find_hf_token() == ("hf_kaggle00000000000000", "Kaggle secrets")  # Colab's raised: not found
    colab_secrets["HF_TOKEN"] = "hf_colab000000000000000"
    assert find_hf_token() == ("hf_colab000000000000000", "Colab secrets")

    del colab_secrets["HF_TOKEN"]
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr(UserSecretsClient, "get_secret", lambda self, name: (_ for _ in ()).throw(KeyError(name)))
    token, where = find_hf_token()
    assert token is None and "Colab secrets (SecretNotFoundError)" in where and "Kaggle secrets (KeyError)" in where
