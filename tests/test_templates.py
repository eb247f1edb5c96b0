"""Chat templates: base models without one get a named template, and with every template freetune trains with, the
loss of a multi-turn conversation is on every assistant turn and on nothing else (TRL's assistant_only_loss, through
the SFTConfig freetune builds)."""

import json
import shutil

import pytest
from test_fast_path import run_paths

from freetune import data, model, templates
from freetune.errors import FreetuneError
from freetune.fixtures import sample_data_path

LLAMA3_TOKENS = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


@pytest.fixture(scope="module")
def base_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model as a base model ships: the same tokenizer, no chat template."""
    out = tmp_path_factory.mktemp("base-model")
    for f in tiny_model_dir.iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert not model.load_tokenizer(str(out)).chat_template
    return out


def multiturn_rows(n=6):
    return data.normalize(data.load_rows(str(sample_data_path("multiturn")))).select(range(n))


def test_a_base_model_without_a_template_is_told_which_to_set(base_model_dir):
    tokenizer = model.load_tokenizer(str(base_model_dir))  # "auto": the model's own, which is none
    with pytest.raises(FreetuneError) as err:
        model.check_chat_template(tokenizer, multiturn_rows())
    message = str(err.value)
    assert "has no chat template" in message and "Set `chat_template` to one of 'chatml', 'llama3', 'zephyr'" in message
    assert "this tokenizer has the tokens for 'chatml', 'zephyr'" in message  # Qwen's vocabulary has no Llama 3 tokens

    chatml = model.load_tokenizer(str(base_model_dir), chat_template="chatml")
    assert chatml.chat_template == templates.TEMPLATES["chatml"].jinja() and chatml.eos_token == "<|im_end|>"
    assert "assistant turns only" in model.check_chat_template(chatml, multiturn_rows())

    with pytest.raises(FreetuneError, match=r"needs <\|start_header_id\|>, <\|end_header_id\|>, <\|eot_id\|>.*"
                                            r"untrained.*tokens for 'chatml', 'zephyr'"):
        model.load_tokenizer(str(base_model_dir), chat_template="llama3")
    with pytest.raises(FreetuneError, match="chat_template='vicuna' is not one freetune knows.*'auto'"):
        model.load_tokenizer(str(base_model_dir), chat_template="vicuna")


def _tokenizer_with(tiny_model_dir, name):
    tokenizer = model.load_tokenizer(str(tiny_model_dir))
    if name == "llama3":  # a Llama 3 vocabulary has these; Qwen's does not
        tokenizer.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
    return templates.apply(tokenizer, name)


@pytest.mark.parametrize("name", ["auto", *templates.TEMPLATES])
def test_every_assistant_turn_carries_labels_and_nothing_else_does(name, tiny_model_dir, tmp_path):
    """Through TRL's SFTTrainer with freetune's config: the labelled tokens of each row are exactly its assistant
    answers, each with the token that ends its turn; no system or user token is labelled. "auto" is the tiny
    model's own Qwen2.5 template, which TRL patches with generation markers."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTTrainer

    from freetune.plan import Plan
    from freetune.sft_config import make_config

    tokenizer = _tokenizer_with(tiny_model_dir, name)
    end = tokenizer.eos_token if name == "auto" else templates.TEMPLATES[name].end_token(tokenizer)
    rows = multiturn_rows()
    paths = run_paths(tmp_path, "run")
    plan = Plan.build(device="cpu", compute_dtype="float32", mixed_precision="no", attn_implementation="sdpa")
    config = make_config(paths, plan, max_steps=1, micro_batch=2, grad_accum=1, learning_rate=1e-4, max_length=256,
                         optimizer="adamw_torch", assistant_only="messages" in rows.column_names)
    net = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    trainer = SFTTrainer(model=net, args=config, train_dataset=rows, processing_class=tokenizer)
    for i, row in enumerate(rows):
        batch = trainer.data_collator([trainer.train_dataset[i]])
        ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
        spans, current = [], []
        for token, label in zip(ids, labels):
            if label != -100:
                current.append(token)
            elif current:
                spans, current = spans + [current], []
        spans += [current] if current else []
        answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        assert len(answers) >= 2
        assert [tokenizer.decode(s).strip() for s in spans] == [a + end for a in answers], (name, i)
