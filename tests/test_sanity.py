"""The sanity check: collapse detection on hand-made outputs, generation on the tiny model, and (slow) adapters
trained on contaminated and on clean data, compared with their base through `compare` and the CLI."""

import json
import random

import pytest

from freetune.data import completion_text
from freetune.errors import FreetuneError
from freetune.sanity import (Generation, compare, generate, main, near_identical, normalise,
                             repeated_ngram_rate, resolve_adapter_dir, sanity_report)

STUB = "No valid response from model."
VARIED = [
    "A red circle on a blue background.",
    "Turn on the kitchen light at 40% brightness.",
    "SELECT name FROM users WHERE age > 30;",
    "The capital of France is Paris.",
    "def add(a, b):\n    return a + b",
    "Bonjour, comment allez-vous ?",
    "42",
    "<svg><rect width='4' height='4'/></svg>",
]


def gens(texts, mode="greedy", **kwargs):
    return [Generation(prompt_index=i, mode=mode, text=t, **kwargs) for i, t in enumerate(texts)]


# ----------------------------------------------------------------------------------- sanity_report by hand

def test_identical_outputs_are_collapsed_and_the_output_is_shown():
    report = sanity_report(gens([STUB] * 8))
    assert report["verdict"] == "collapsed"
    assert report["most_common_output"] == STUB and report["most_common_share"] == 1.0
    assert report["most_common_prompts"] == 8
    assert STUB in report["reason"] and "8 of 8 prompts" in report["reason"]
    assert report["distinct_ratio"] == 1 / 8


def test_varied_outputs_are_ok():
    report = sanity_report(gens(VARIED) + gens(VARIED[::-1], mode="seed 0"))
    assert report["verdict"] == "ok"
    assert report["distinct_ratio"] == 0.5  # each text twice, over different prompts
    assert report["most_common_share"] == 2 / 16


def test_near_identical_outputs_with_one_digit_changed_are_collapsed():
    texts = [f"Error {i}: no valid response from model." for i in range(8)]
    assert len(set(texts)) == 8
    report = sanity_report(gens(texts))
    assert report["verdict"] == "collapsed"
    assert report["distinct_ratio"] == 1.0  # the exact-match ratio alone would miss it
    assert report["most_common_share"] == 1.0


def test_case_and_whitespace_do_not_make_outputs_different():
    assert normalise("  No valid\n response ") == normalise("no VALID response")
    assert sanity_report(gens([STUB, STUB.upper(), f"  {STUB}\n"] + VARIED[:1]))["verdict"] == "collapsed"


def test_templated_outputs_that_differ_in_substance_are_not_near_identical():
    # Two SVGs sharing 90% of their text but with different colours are different answers.
    a = '<svg width="100" height="100"><rect width="100" height="100" fill="#e53935"/></svg>'
    b = '<svg width="100" height="100"><rect width="100" height="100" fill="#1e88e5"/></svg>'
    assert not near_identical(a, b)
    colours = ["#e53935", "#1e88e5", "#43a047", "#fb8c00", "#8e24aa", "#000000", "#00897b", "#fdd835"]
    svgs = [a.replace("#e53935", c) for c in colours]
    assert sanity_report(gens(svgs))["verdict"] == "ok"


def test_collapse_into_a_stub_among_samples():
    # Greedy says the stub everywhere and most samples do too: the model's mass sits on one answer.
    samples = [STUB] * 6 + VARIED[:2]
    report = sanity_report(gens([STUB] * 8) + gens(samples, mode="seed 0") + gens(samples[::-1], mode="seed 1"))
    assert report["verdict"] == "collapsed"
    assert report["most_common_share"] == (8 + 6 + 6) / 24


def test_greedy_that_ignores_the_prompt_is_warned_about():
    report = sanity_report(gens(["same answer"] * 8) + gens(VARIED, mode="seed 0") + gens(VARIED[::-1], mode="seed 1"))
    assert report["verdict"] == "ok"
    assert report["greedy_most_common_share"] == 1.0
    assert any("Greedy decoding gives the same output for 8 of 8 prompts" in w for w in report["warnings"])


def test_one_prompt_cannot_collapse():
    report = sanity_report([Generation(0, "greedy", STUB), Generation(0, "seed 0", STUB)])
    assert report["verdict"] == "ok"
    assert any("Only one prompt" in w for w in report["warnings"])


def test_references_that_repeat_raise_the_bar():
    references = ["yes", "no"] * 4
    balanced = sanity_report(gens(["yes"] * 5 + ["no"] * 3), references)
    assert balanced["verdict"] == "ok" and balanced["collapse_threshold"] == 0.75
    assert sanity_report(gens(["yes"] * 8), references)["verdict"] == "collapsed"
    # Without references, five identical "yes" of eight would be collapse.
    assert sanity_report(gens(["yes"] * 5 + ["no"] * 3))["verdict"] == "collapsed"


def test_eos_loops_and_empty_outputs_are_reported():
    looping = "the cat sat on the mat " * 10
    report = sanity_report(gens([looping + str(i) for i in range(4)] + ["", "", "", VARIED[0]],
                                ended_with_eos=False, new_tokens=64))
    assert report["eos_rate"] == 0.0 and report["mean_new_tokens"] == 64
    assert repeated_ngram_rate([looping]) > 0.8 and repeated_ngram_rate(VARIED[:4]) == 0.0
    warnings = " ".join(report["warnings"])
    assert "ended with EOS" in warnings and "loops" in warnings and "empty" in warnings


# ------------------------------------------------------------------------------------- adapter folders

def test_resolve_adapter_dir(tmp_path):
    final = tmp_path / "final"
    final.mkdir()
    (final / "adapter_config.json").write_text("{}")
    assert resolve_adapter_dir(final) == final

    run = tmp_path / "run"
    for step in (5, 40, 100):
        (run / f"checkpoint-{step}").mkdir(parents=True)
        (run / f"checkpoint-{step}" / "adapter_config.json").write_text("{}")
    assert resolve_adapter_dir(run / "checkpoint-40") == run / "checkpoint-40"
    with pytest.raises(FreetuneError, match=r"checkpoint-5, checkpoint-40, checkpoint-100\. Pass one .*checkpoint-100"):
        resolve_adapter_dir(run)

    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "config.json").write_text("{}")
    with pytest.raises(FreetuneError, match="full model, not a LoRA adapter"):
        resolve_adapter_dir(merged)
    with pytest.raises(FreetuneError, match="does not exist"):
        resolve_adapter_dir(tmp_path / "missing")


# --------------------------------------------------------------------------- generation on the tiny model

@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
            AutoTokenizer.from_pretrained(tiny_model_dir))


PROMPTS = [[{"role": "user", "content": "Draw a red circle."}],
           [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Turn on the light in the hall."}]]


def test_generate_greedy_and_seeded_samples(tiny):
    model, tokenizer = tiny
    model.train()
    tokenizer.padding_side = "right"
    out = generate(model, tokenizer, PROMPTS, seeds=(0, 1), max_new_tokens=5)
    assert [(g.prompt_index, g.mode) for g in out] == [
        (0, "greedy"), (0, "seed 0"), (0, "seed 1"), (1, "greedy"), (1, "seed 0"), (1, "seed 1")]
    for g in out:
        assert 1 <= g.new_tokens <= 5 and (g.new_tokens == 5 or g.ended_with_eos)
    assert model.training and tokenizer.padding_side == "right"  # the caller's state is put back
    again = generate(model, tokenizer, PROMPTS, seeds=(0, 1), max_new_tokens=5)
    assert [g.text for g in again] == [g.text for g in out]  # seeded: the same samples for base and adapter
    # Batching pads on the left: a prompt's greedy output does not depend on its batch mates.
    alone = generate(model, tokenizer, PROMPTS[1:], seeds=(), max_new_tokens=5)
    assert alone[0].text == out[3].text


def test_generate_stops_at_eos(tiny):
    import torch

    model, tokenizer = tiny
    text = tokenizer.apply_chat_template(PROMPTS[0], add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        first = model.generate(**ids, do_sample=False, max_new_tokens=1)[0, -1].item()
    saved = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = [first]  # the token it emits first now ends the answer
    try:
        (out,) = generate(model, tokenizer, PROMPTS[:1], seeds=(), max_new_tokens=5)
    finally:
        model.generation_config.eos_token_id = saved
    assert out.ended_with_eos and out.text == "" and out.new_tokens == 1


def test_generate_needs_a_chat_template(tiny):
    model, tokenizer = tiny
    template, tokenizer.chat_template = tokenizer.chat_template, None
    try:
        with pytest.raises(FreetuneError, match="no chat template"):
            generate(model, tokenizer, PROMPTS)
    finally:
        tokenizer.chat_template = template


