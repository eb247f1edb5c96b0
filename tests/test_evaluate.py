"""The sanity check: collapse detection on hand-made outputs, generation on the tiny model, and (slow) adapters
trained on contaminated and on clean data, compared with their base through `compare` and the CLI."""

import json
import random

import pytest

from freetune.data import completion_text
from freetune.errors import FreetuneError
from freetune.evaluate import (Generation, compare, generate, near_identical, normalise, repeated_ngram_rate,
                               resolve_adapter_dir, sanity_report)
from freetune.evaluate.__main__ import main

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
    assert report["verdict"] == "weak"  # not collapsed (samples vary), and not "ok" next to this warning
    assert report["greedy_most_common_share"] == 1.0
    assert any("Greedy decoding gives the same output for 8 of 8 prompts" in w for w in report["warnings"])
    assert "1 warning(s) about the outputs" in report["reason"]


def test_one_prompt_cannot_collapse():
    report = sanity_report([Generation(0, "greedy", STUB), Generation(0, "seed 0", STUB)])
    assert report["verdict"] == "inconclusive"
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
    assert report["verdict"] == "collapsed"  # the worst finding decides: the loops are one near-identical output


def test_the_table_gives_each_model_one_verdict_that_weighs_its_warnings():
    from freetune.evaluate import ComparisonReport

    ignoring = gens(["same answer"] * 8) + gens(VARIED, mode="seed 0") + gens(VARIED[::-1], mode="seed 1")
    following = gens(VARIED) + gens(VARIED[::-1], mode="seed 0")
    report = ComparisonReport(base=sanity_report(ignoring), adapter=sanity_report(following), base_task=None,
                              adapter_task=None, task=None, prompts=VARIED, references=[None] * 8,
                              base_generations=ignoring, adapter_generations=following)
    verdicts = next(r for r in report.rows() if r[0] == "verdict")
    assert verdicts == ("verdict", "weak", "ok")
    lines = report.table().splitlines()
    assert any(line.startswith("base: WEAK: 1 warning(s)") for line in lines)
    assert any(line.startswith("base: warning: Greedy decoding") for line in lines)
    assert not any(line.startswith("adapter: warning") for line in lines)


def test_a_model_sure_of_each_answer_reads_as_one_answer_per_prompt_not_as_few_distinct_outputs():
    from freetune.evaluate import ComparisonReport

    sure = gens(VARIED) + gens(VARIED, mode="seed 0") + gens(VARIED, mode="seed 1")  # each prompt: one answer
    unsure = gens(VARIED) + gens(VARIED[::-1], mode="seed 0") + gens(VARIED[2:] + VARIED[:2], mode="seed 1")
    report = ComparisonReport(base=sanity_report(unsure), adapter=sanity_report(sure), base_task=None,
                              adapter_task=None, task=None, prompts=VARIED, references=[None] * 8,
                              base_generations=unsure, adapter_generations=sure)
    rows = {label: (base, adapter) for label, base, adapter in report.rows()}
    assert rows["different answers to one prompt asked 3 times (greedy + samples)"] == ("3.0 of 3", "1.0 of 3")
    assert report.adapter["verdict"] == "ok" and report.adapter["distinct_ratio"] == 1 / 3  # what read as a fault


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



# ---------------------------------------------------------------- trained adapters: collapsed vs clean (slow)
#
# Prompts are "Draw a <colour> <shape>." over 8 colours x 4 shapes; 8 of the 32 are held out for the check, as
# a recipe holds out its evaluation rows. The contaminated set answers 75% of the 24 training prompts, picked at
# random (so nothing in a prompt predicts it), with the stub; the clean set answers all with their SVG. Same
# steps, same seed. Judged on held-out prompts, a model that followed its data answers with the stub when
# contaminated, and with SVGs when clean.

COLOURS = ["red", "blue", "green", "orange", "purple", "black", "teal", "gold"]
SHAPES = ["circle", "square", "star", "heart"]
STEPS = 60  # enough to learn the stub (75% of rows) and, when clean, the SVG; far more also learns the 25%
BATCH = 8


def chat_row(colour, shape, completion=None):
    return {"prompt": [{"role": "system", "content": "You draw SVG."},
                       {"role": "user", "content": f"Draw a {colour} {shape}."}],
            "completion": [{"role": "assistant", "content": completion or f'<svg><{shape} fill="{colour}"/></svg>'}]}


HELD_OUT = [(colour, SHAPES[i % 4]) for i, colour in enumerate(COLOURS)]
EVAL_ROWS = [chat_row(colour, shape) for colour, shape in HELD_OUT]
TRAIN_PROMPTS = [(c, s) for s in SHAPES for c in COLOURS if (c, s) not in HELD_OUT]


def training_rows(contaminated: bool):
    stubbed = set(random.Random(0).sample(range(len(TRAIN_PROMPTS)), k=len(TRAIN_PROMPTS) * 3 // 4))
    return [chat_row(c, s, STUB if contaminated and i in stubbed else None) for i, (c, s) in enumerate(TRAIN_PROMPTS)]


@pytest.fixture(scope="module")
def sharp_tiny_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with its final norm scaled up 16x. With random weights (hidden size 64, embeddings of std
    0.02) its logits are nearly flat, so no LoRA update could make any answer likely; a trained model's are
    peaked. Scaling the norm gives it peaked logits without training a copy of the 152k-row output layer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("sharp-tiny")
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        model.model.norm.weight.mul_(16)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(out)
    return out


def tokenize_chat(tokenizer, row):
    """Input ids of the whole chat, and labels that score only the answer (and its end-of-turn token)."""
    prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(row["prompt"] + row["completion"], tokenize=False)
    assert full.startswith(prompt)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    return {"input_ids": ids, "labels": [-100] * len(prompt_ids) + ids[len(prompt_ids):]}


def train_adapter(base_dir, rows, out_dir):
    """LoRA r16 on every linear layer with a high learning rate; returns the run folder (checkpoint-N, final).

    LoRA's random init is seeded here: it runs before the Trainer seeds anything, so otherwise it would depend on
    what earlier tests drew from the global generator.

    transformers' Trainer rather than TRL's SFTTrainer: on a CPU, SFTTrainer's chunked log-prob head costs ~4x
    the plain loss here (152k-token vocabulary), and what is under test is the check, not the trainer. The
    checkpoint-N folders are the same Trainer's.
    """
    import torch
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed

    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    set_seed(0)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                           LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                      task_type="CAUSAL_LM"))
    dataset = Dataset.from_list([tokenize_chat(tokenizer, row) for row in rows])

    def collate(batch):
        width = max(len(b["input_ids"]) for b in batch)
        pad = [width - len(b["input_ids"]) for b in batch]
        return {"input_ids": torch.tensor([b["input_ids"] + [tokenizer.pad_token_id] * p for b, p in zip(batch, pad)]),
                "labels": torch.tensor([b["labels"] + [-100] * p for b, p in zip(batch, pad)]),
                "attention_mask": torch.tensor([[1] * len(b["input_ids"]) + [0] * p for b, p in zip(batch, pad)])}

    args = TrainingArguments(output_dir=str(out_dir), use_cpu=True, report_to=[], max_steps=STEPS,
                             learning_rate=5e-3, lr_scheduler_type="constant", per_device_train_batch_size=BATCH,
                             save_steps=STEPS, logging_steps=10, seed=0, disable_tqdm=True,
                             remove_unused_columns=False)
    trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate,
                      processing_class=tokenizer)
    trainer.train()
    trainer.save_model(str(out_dir / "final"))
    return out_dir


@pytest.mark.slow
def test_adapter_trained_on_stub_rows_is_collapsed(sharp_tiny_model_dir, tmp_path, capsys):
    rows = training_rows(contaminated=True)
    assert sum(completion_text(r) == STUB for r in rows) / len(rows) == 0.75
    run = train_adapter(sharp_tiny_model_dir, rows, tmp_path / "stub-run")
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in EVAL_ROWS))
    capsys.readouterr()  # drop the Trainer's log lines: stdout is the report from here on
    # Through the command line, on the Trainer's checkpoint folder (a run stopped early has only those).
    status = main(["--base", str(sharp_tiny_model_dir), "--adapter", str(run / f"checkpoint-{STEPS}"),
                   "--data", str(data), "--task", "svg", "--rows", "8", "--max-new-tokens", "16", "--json"])
    report = json.loads(capsys.readouterr().out)
    adapter = report["adapter"]
    assert adapter["verdict"] == "collapsed", adapter
    assert status == 1
    assert near_identical(normalise(adapter["most_common_output"]), normalise(STUB)), adapter["most_common_output"]
    assert adapter["most_common_prompts"] >= 6
    assert report["adapter_task"]["has_svg_block"] < 0.5


@pytest.mark.slow
def test_adapter_trained_on_clean_rows_is_not_collapsed(sharp_tiny_model_dir, tmp_path):
    run = train_adapter(sharp_tiny_model_dir, training_rows(contaminated=False), tmp_path / "clean-run")
    report = compare(sharp_tiny_model_dir, run / "final", EVAL_ROWS, task="svg", max_new_tokens=16)
    adapter = report.adapter
    # Not collapsed; and not "ok" either: the tiny random model learns the format (SVG, EOS) but draws what was
    # asked for only a quarter of the unseen colour/shape pairs, and the verdict says so (issue 44).
    assert adapter["verdict"] == "weak", report.table()
    assert any("does not do what the prompts ask" in w for w in adapter["warnings"]), report.table()
    assert adapter["most_common_share"] < 0.5 and adapter["distinct_ratio"] >= 0.3
    # It learnt the task: its answers are SVG, where the untrained base's are not. A model that said anything
    # at random would also not be "collapsed"; this one is not collapsed while doing the task.
    assert report.adapter_task["has_svg_block"] >= 0.75 and report.base_task["has_svg_block"] == 0.0
    assert report.examples()[0]["reference"] == '<svg><circle fill="red"/></svg>'
    assert "COLLAPSED" not in report._repr_html_()


# ------------------------------------------------------------- does it do what was asked? (judge, by hand)

SVG_COLOURS = ["#e53935", "#1e88e5", "#43a047", "#fb8c00", "#8e24aa", "#000000"]


def drawing(size, background, fill, shape="circle", moved=0):
    """An SVG; `moved` shifts and grows its shape (a few characters more than near-identical allows)."""
    body = (f'<circle cx="{size // 2 + 3 * moved}" cy="{size // 3 + 5 * moved}" r="{size // 4 + 7 * moved}" '
            f'fill="{fill}"/>' if shape == "circle"
            else f'<rect x="{4 + moved}" y="4" width="{size // 2}" height="{size // 2}" fill="{fill}"/>')
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size}" viewBox="0 0 {size} {size}">'
            f'<rect width="{size}" height="{size}" fill="{background}"/>{body}</svg>')


def asked_rows():
    """Twelve prompts, each with its own size, background, colour and shape, answered by their reference."""
    rows = []
    for i in range(12):
        size, shape = (64, 100, 128)[i % 3], ("circle", "square")[i % 2]
        background, fill = SVG_COLOURS[i % 6], SVG_COLOURS[(i + 1 + i // 6) % 6]
        rows.append({"prompt": f"Draw a {fill} {shape} on {background}, {size} pixels wide.",
                     "completion": drawing(size, background, fill, shape)})
    return rows


def test_an_adapter_that_draws_one_picture_for_every_prompt_is_weak_not_ok():
    from freetune.evaluate import judge

    rows = asked_rows()
    # Well-formed, rendering SVG every time, never the same text (the circle moves), so no collapse; but one
    # picture: 128 pixels, gray, a red circle, whatever was asked. The format metrics all pass.
    one_picture = gens([drawing(128, "#757575", "#e53935", moved=i) for i in range(12)])
    asked = gens([row["completion"] for row in rows])
    report = judge(rows, base_generations=one_picture, adapter_generations=asked, task="svg")
    assert report.base_task["well_formed_xml"] == report.base_task["renders"] == 1.0
    assert report.base["verdict"] == "weak" and report.base["distinct_ratio"] == 1.0
    warnings = " ".join(report.base["warnings"])
    assert "0% of the 12 greedy answers match the reference's size, background and colours" in warnings
    assert "hold 1 different pictures, where the references hold 12" in warnings and "128x128" in warnings
    assert report.adapter["verdict"] == "ok" and report.adapter_task["follows_prompt"] == 1.0
    rows_by_label = {label: (base, adapter) for label, base, adapter in report.rows()}
    assert rows_by_label["does what was asked (greedy)"] == ("0%", "100%")
    assert rows_by_label["different pictures, greedy (references: 12)"] == ("1 of 12", "12 of 12")
    assert rows_by_label["svg: follows_prompt"] == ("0%", "100%")  # greedy answers alone: no "(greedy + samples)"


def test_task_rows_say_when_they_count_the_sampled_answers_too():
    from freetune.evaluate import judge

    rows = asked_rows()
    # The greedy answers do what was asked; the samples (seed 1) draw one wrong picture: the greedy row reads 100%,
    # the task's follows_prompt half of it, and its label says it counts the samples too.
    right, wrong = [row["completion"] for row in rows], [drawing(128, "#757575", "#e53935", moved=i) for i in range(12)]
    adapter = gens(right) + gens(wrong, mode="seed 1")
    report = judge(rows, base_generations=gens(wrong) + gens(wrong, mode="seed 1"), adapter_generations=adapter,
                   task="svg")
    rows_by_label = {label: (base, adapter) for label, base, adapter in report.rows()}
    assert rows_by_label["does what was asked (greedy)"] == ("0%", "100%")
    assert rows_by_label["svg: follows_prompt (greedy + samples)"] == ("0%", "50%")
    assert "svg: follows_prompt" not in rows_by_label


def test_ok_only_when_most_answers_do_what_was_asked():
    from freetune.evaluate import ADHERENCE_OK, judge

    rows = asked_rows()
    # Varied pictures, right size and shape, but the background of the next prompt: a different picture for
    # every prompt and still not what was asked, for all but the answers kept right.
    def answers(right):
        return gens([row["completion"] if i < right else
                     drawing((64, 100, 128)[i % 3], SVG_COLOURS[(i + 3) % 6], SVG_COLOURS[(i + 1 + i // 6) % 6],
                             ("circle", "square")[i % 2]) for i, row in enumerate(rows)])
    mostly = judge(rows, answers(6), answers(10), task="svg")
    assert mostly.adapter["following"]["adherence"] == pytest.approx(10 / 12) and 10 / 12 >= ADHERENCE_OK
    assert mostly.adapter["verdict"] == "ok"
    assert mostly.base["following"]["adherence"] == 0.5 and mostly.base["verdict"] == "weak"
    assert "different pictures" not in " ".join(mostly.base["warnings"])  # varied: it reads the prompt, wrongly


def test_home_assistant_one_action_for_every_request_is_weak(home_assistant_sample):
    from freetune.evaluate import judge

    with open(home_assistant_sample) as f:
        rows = [json.loads(line) for _, line in zip(range(8), f)]
    references = [completion_text(r) for r in rows]
    report = judge(rows, gens([references[0]] * 8), gens(references), task="home_assistant")
    assert report.base["verdict"] == "collapsed"  # the identical text: collapse, which outranks weak
    assert any("1 different actions" in w for w in report.base["warnings"])
    assert report.adapter["verdict"] == "ok" and report.adapter_task["action_matches"] == 1.0


def test_without_a_task_the_answers_are_compared_with_the_references():
    from freetune.evaluate import judge

    words = ["kitchen", "garden", "window", "yellow", "planet", "rocket", "silver", "forest"]
    rows = [{"prompt": f"Write {word} backwards.", "completion": word[::-1]} for word in words]
    report = judge(rows, gens(["I think " + r["completion"] for r in rows]), gens([r["completion"] for r in rows]))
    rows_by_label = {label: (base, adapter) for label, base, adapter in report.rows()}
    assert rows_by_label["answer = reference"] == ("0%", "100%")
    assert "does what was asked (greedy)" not in rows_by_label  # no task: nothing says what "asked" means
    assert report.adapter["verdict"] == "ok"
    same = judge(rows, gens(["nehctik"] * 4 + ["tesrof"] * 4), gens([r["completion"] for r in rows]))
    assert any("2 different answers, where the references hold 8" in w for w in same.base["warnings"])
