"""The data audit: every defect is flagged with the right rows, clean drops exactly those, the JSON is stable,
the policy stops or warns, and token counts agree with what TRL's SFTTrainer actually trains on."""

from __future__ import annotations

import html
import json
import subprocess
import sys
import weakref
import xml.etree.ElementTree as ET
from contextlib import contextmanager

import pytest

datasets = pytest.importorskip("datasets")

from freetune.audit import (ACCEPT_PARAMETER, WHY_REPEATS_DOMINATE, AuditReport, audit, audit_and_clean, clean,
                            enforce, main)
from freetune.audit.tokens import _row_tokens
from freetune.data import load_rows, normalize
from freetune.errors import FreetuneError

COLOURS = ["#e53935", "#1e88e5", "#43a047", "#fb8c00", "#8e24aa"]
JUNK = "No valid response from model."
MAX_LENGTH = 256


def has_svg(row):
    return None if "<svg" in row["completion"] else "no <svg> tag"


def parses_as_xml(row):
    try:
        ET.fromstring(row["completion"])
    except ET.ParseError as exc:
        return f"not well-formed XML ({exc})"
    return None


CHECKS = {"has_svg": has_svg, "xml": parses_as_xml}


def svg(i: int, shapes: int = 2) -> str:
    body = "".join(f'<circle cx="{(i * 7 + k * 13) % 100}" cy="{(i * 3 + k) % 100}" r="{5 + k}" '
                   f'fill="{COLOURS[(i + k) % 5]}"/>' for k in range(shapes))
    return f'<svg xmlns="http://www.w3.org/2000/svg" width="{100 + i}" height="100">{body}</svg>'


def clean_rows(n: int = 200) -> list[dict]:
    return [{"prompt": f"Draw design number {i}: {1 + i % 4} circles in {COLOURS[i % 5]}.", "completion": svg(i)}
            for i in range(n)]


# Each defect sits at a known row index, so the assertions name exact rows.
EXPECTED = {
    "repeated": [200, 201, 202, 203],
    "empty": [204, 205],
    "conflict": [206],
    "duplicate": [207],
    "no_trainable_tokens": [208],
    "truncated": [208, 209, 210],
    "short": [211],
    "overlap": [30, 31],
}


def contaminated_rows() -> list[dict]:
    rows = clean_rows()
    rows += [{"prompt": f"Draw a logo for shop {k}.", "completion": JUNK} for k in range(4)]          # 200-203
    rows += [{"prompt": "Draw an empty frame.", "completion": ""},                                     # 204
             {"prompt": "Draw nothing at all.", "completion": "  \n "}]                                # 205
    rows += [{"prompt": rows[10]["prompt"], "completion": svg(999)}]                                   # 206
    rows += [dict(rows[20])]                                                                           # 207
    rows += [{"prompt": "Describe this picture: " + "a very long story " * 150, "completion": svg(1)}]  # 208
    rows += [{"prompt": f"Draw a busy pattern {k}.", "completion": svg(k, shapes=40)} for k in range(2)]  # 209-210
    rows += [{"prompt": "Draw the smallest SVG.", "completion": "<svg/>"}]                             # 211
    return rows


def eval_rows(rows: list[dict]) -> list[dict]:
    return [dict(rows[30]), dict(rows[31]), {"prompt": "A prompt only the eval set has.", "completion": svg(5000)}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def contaminated():
    rows = contaminated_rows()
    return datasets.Dataset.from_list(rows), datasets.Dataset.from_list(eval_rows(rows))


@pytest.fixture(scope="module")
def report(contaminated, tokenizer) -> AuditReport:
    train, evaluation = contaminated
    return audit(train, tokenizer=tokenizer, max_length=MAX_LENGTH, checks=CHECKS, eval_dataset=evaluation)


def test_each_defect_is_flagged_on_exactly_its_rows(report):
    flagged = report.flagged_rows()
    for finding_id, rows in EXPECTED.items():
        assert flagged[finding_id] == rows, finding_id
    # The junk and the empty rows also fail both recipe checks, and nothing else does.
    assert flagged["check:has_svg"] == [200, 201, 202, 203, 204, 205]
    assert flagged["check:xml"] == [200, 201, 202, 203, 204, 205]
    assert set(flagged) == set(EXPECTED) | {"check:has_svg", "check:xml"}
    assert report.rows == 212


def test_severities_follow_the_policy(report):
    assert sorted(f.id for f in report.blocking) == sorted(
        ["repeated", "empty", "conflict", "duplicate", "no_trainable_tokens", "overlap", "check:has_svg",
         "check:xml"])
    assert sorted(f.id for f in report.warnings) == ["short", "truncated"]


def test_repeat_details_name_the_string_and_example_prompts(report):
    top = report.finding("repeated").details["top"][0]
    assert top["completion"] == JUNK
    assert top["rows"] == 4
    assert top["share"] == round(4 / 212, 6)
    assert top["example_prompts"] == ["Draw a logo for shop 0.", "Draw a logo for shop 1.", "Draw a logo for shop 2."]


def test_check_reasons_are_counted(report):
    reasons = report.finding("check:has_svg").details["reasons"]
    assert reasons == [{"reason": "no <svg> tag", "rows": 6}]


def test_token_statistics_with_the_real_tokenizer(report):
    tokens = report.tokens
    assert tokens["max_length"] == MAX_LENGTH
    assert tokens["truncated_rows"] == 3
    assert tokens["no_trainable_rows"] == 1
    # TRL appends the EOS (<|im_end|>) to plain-text completions: every row trains on it except the three whose
    # ends are cut by max_length.
    assert tokens["eos_token"] == "<|im_end|>"
    assert tokens["eos_in_labels_rows"] == report.rows - 3
    assert tokens["labels_end_example"].endswith("><|im_end|>")
    assert tokens["pad_is_eos"] is False
    s = tokens["sequence_tokens"]
    assert s["min"] <= s["median"] <= s["p95"] <= s["max"]
    assert s["max"] > MAX_LENGTH
    assert tokens["trainable_tokens"]["min"] == 0


def test_clean_removes_exactly_the_blocking_rows(contaminated, report):
    train, _ = contaminated
    cleaned, summary = clean(train, report)
    dropped = {i for key in ("repeated", "empty", "conflict", "duplicate", "no_trainable_tokens", "overlap")
               for i in EXPECTED[key]}
    kept = [i for i in range(len(train)) if i not in dropped]
    assert len(cleaned) == len(train) - 11
    assert cleaned["prompt"] == [train[i]["prompt"] for i in kept]
    assert summary.rows_before == 212 and summary.rows_after == 201
    by_id = {r["id"]: r for r in summary.reasons}
    assert by_id["repeated"] == {"id": "repeated", "title": "repeated short completion", "severity": "blocking",
                                 "dropped": True, "before": 4, "after": 0}
    # Warnings stay: the two long rows are still there; the third truncated row was the one without tokens.
    assert (by_id["truncated"]["before"], by_id["truncated"]["after"], by_id["truncated"]["dropped"]) == (3, 2, False)
    assert "212 -> 201 rows" in str(summary)


def test_clean_can_drop_chosen_kinds_only(contaminated, report):
    train, _ = contaminated
    cleaned, summary = clean(train, report, drop=("empty", "short"))
    assert len(cleaned) == 212 - 3
    assert {r["id"] for r in summary.reasons if r["dropped"]} == {"empty", "short"}


def test_cleaned_data_passes_a_second_audit(contaminated, report, tokenizer):
    train, evaluation = contaminated
    cleaned, _ = clean(train, report)
    again = audit(cleaned, tokenizer=tokenizer, max_length=MAX_LENGTH, checks=CHECKS, eval_dataset=evaluation)
    assert again.blocking == []
    enforce(again, accept_problems=False)


def test_json_report_is_stable(contaminated, tokenizer, report, tiny_model_dir):
    train, evaluation = contaminated
    rebuilt = datasets.Dataset.from_list(contaminated_rows())
    second = audit(rebuilt, tokenizer=tokenizer, max_length=MAX_LENGTH, checks=CHECKS, eval_dataset=evaluation)
    assert second.to_json() == report.to_json()
    data = json.loads(report.to_json())
    assert sorted(data) == ["blocking", "completion_chars", "counts", "findings", "labels", "rows", "settings",
                            "shape", "tokens"]
    assert data["counts"] == {"check:has_svg": 6, "check:xml": 6, "conflict": 1, "duplicate": 1, "empty": 2,
                              "eos_not_in_labels": 0, "no_trainable_tokens": 1, "overlap": 2, "repeated": 4,
                              "repeated_other": 0, "short": 1, "truncated": 3, "malformed": 0, "refusal": 0,
                              "error_string": 0, "cut_off": 0, "echo": 0, "language": 0}
    assert data["labels"] is None
    # Without a tokenizer or an eval set those checks are "not measured" (null), not "none found" (0).
    bare = audit(train).to_dict()["counts"]
    assert bare["truncated"] is None and bare["overlap"] is None and bare["empty"] == 2
    assert data["settings"]["tokenizer"] == {"chat_template": True, "class": "Qwen2Tokenizer",
                                             "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                                             "vocab_size": len(tokenizer)}
    for finding in data["findings"]:
        assert sorted(finding) == ["count", "details", "id", "kind", "message", "rows", "severity", "share",
                                   "title"]
    # Blocking findings first, then the most rows, then by id: the order is part of the stable output.
    order = [(f["severity"] != "blocking", -f["count"], f["id"]) for f in data["findings"]]
    assert order == sorted(order)
    # Nothing machine-specific: the tokenizer is named by its class, not by the folder it was loaded from.
    assert str(tiny_model_dir) not in report.to_json()


def test_enforce_stops_and_names_the_parameter(report, capsys):
    with pytest.raises(FreetuneError) as caught:
        enforce(report, accept_problems=False)
    message = str(caught.value)
    assert f"{ACCEPT_PARAMETER}=True" in message
    assert "repeated short completion: 4 rows" in message
    enforce(report, accept_problems=True)
    assert "WARNING" in capsys.readouterr().out


def test_audit_and_clean_in_one_call(contaminated, tokenizer, capsys, monkeypatch):
    import freetune.audit.run as run_module

    train, evaluation = contaminated
    kwargs = dict(tokenizer=tokenizer, max_length=MAX_LENGTH, checks=CHECKS, eval_dataset=evaluation)
    tokenised = []
    monkeypatch.setattr(run_module, "_row_tokens", lambda *args: tokenised.append(args) or _row_tokens(*args))
    cleaned, after, summary = audit_and_clean(train, auto_clean=True, accept_problems=False, **kwargs)
    assert len(cleaned) == 201 and after.blocking == [] and summary.rows_after == 201
    # The audit of the cleaned rows took their token counts from the first audit instead of tokenising them again,
    # and reports exactly what tokenising them again does.
    assert len(tokenised) == 1
    assert after.to_json() == audit(cleaned, **kwargs).to_json() and len(tokenised) == 2
    out = capsys.readouterr().out
    assert "repeated short completion" in out and WHY_REPEATS_DOMINATE in out
    # The rows auto-clean drops are shown as dropped: "blocking" is kept for what stops the run.
    assert "BLOCKING" not in out and "DROPPED  repeated short completion" in out
    assert "The 11 rows marked dropped are removed before training (auto_clean=True)" in out
    with pytest.raises(FreetuneError, match=ACCEPT_PARAMETER):
        audit_and_clean(train, auto_clean=False, accept_problems=False, **kwargs)
    assert "BLOCKING  repeated short completion" in capsys.readouterr().out  # not cleaned: it does block
    kept, _, none = audit_and_clean(train, auto_clean=False, accept_problems=True, **kwargs)
    assert len(kept) == 212 and none is None


def test_table_and_html_show_every_finding(report):
    text, page = report.table(), report._repr_html_()
    for finding in report.findings:
        assert finding.title in text
        assert html.escape(finding.title) in page
    assert "p95" in text and "<table>" in page
    assert ">blocking</td>" in page and ">dropped</td>" not in page
    assert ">dropped</td>" in report._repr_html_(dropping=True) and ">blocking</td>" not in report._repr_html_(True)


def test_rare_or_long_repeats_are_warnings_not_blocking(tokenizer, home_assistant_sample):
    # Home Assistant answers repeat legitimately (the same action asked in other words) and are as long as the
    # typical answer: reported, not dropped.
    data = normalize(load_rows(str(home_assistant_sample)))
    report = audit(data, tokenizer=tokenizer, max_length=512)
    assert report.blocking == []
    assert report.finding("repeated_other").count > 0
    assert report.tokens["eos_in_labels_rows"] == report.rows
    # 4 copies of the error string in 205 rows (1.95%) under a 5% threshold: rare enough to be a warning.
    rows = clean_rows(201) + [{"prompt": f"Draw logo {k}.", "completion": JUNK} for k in range(4)]
    rare = audit(datasets.Dataset.from_list(rows), repeat_share_block=0.05)
    assert rare.finding("repeated") is None and rare.finding("repeated_other").rows == [201, 202, 203, 204]


@contextmanager
def changed(tokenizer, **attributes):
    """The shared tokenizer with some attributes changed for one block (a deep copy takes seconds)."""
    saved = {name: getattr(tokenizer, name) for name in attributes}
    try:
        for name, value in attributes.items():
            setattr(tokenizer, name, value)
        yield tokenizer
    finally:
        for name, value in saved.items():
            setattr(tokenizer, name, value)


def test_junk_on_most_rows_is_still_junk():
    # The yardstick is the median *distinct* answer, so junk filling most rows cannot make itself look typical.
    rows = [{"prompt": f"Draw item {i}.", "completion": JUNK if i % 5 else svg(i)} for i in range(100)]
    report = audit(datasets.Dataset.from_list(rows))
    assert report.finding("repeated").rows == [i for i in range(100) if i % 5]


def test_eos_and_pad_problems_are_detected(tokenizer):
    from freetune.data import as_chat

    strings = datasets.Dataset.from_list(clean_rows(20))
    chats = as_chat(strings)
    good = audit(chats, tokenizer=tokenizer)
    assert good.tokens["eos_in_labels_rows"] == 20 and good.findings == []
    assert good.tokens["labels_end_example"].endswith("<|im_end|>\n")
    # Qwen base checkpoints name <|endoftext|> as EOS while the chat template ends turns with <|im_end|>: the
    # model learns to end a turn, never to emit the EOS.
    with changed(tokenizer, eos_token="<|endoftext|>") as base_like:
        report = audit(chats, tokenizer=base_like)
        # Plain strings: TRL appends the EOS to each completion, so it is trained on whatever the EOS is.
        plain = audit(strings, tokenizer=base_like)
    assert report.finding("eos_not_in_labels").count == 20
    assert report.tokens["eos_in_labels_rows"] == 0
    assert report.finding("pad_is_eos").severity == "warning"   # pad was <|endoftext|> already
    assert report.blocking == []
    assert plain.tokens["eos_in_labels_rows"] == 20 and plain.finding("eos_not_in_labels") is None
    assert plain.tokens["labels_end_example"].endswith("><|endoftext|>")
    with changed(tokenizer, chat_template=None) as no_template, pytest.raises(FreetuneError, match="chat template"):
        audit(chats, tokenizer=no_template)


def test_token_counts_match_trl(tokenizer, tiny_model_dir, tmp_path):
    """What the audit calls trainable tokens is what SFTTrainer puts in the labels, for each data shape."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    from freetune.data import as_chat

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    rows = contaminated_rows()[195:212]
    strings = normalize(datasets.Dataset.from_list(rows))
    turns = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": r["prompt"]},
                                                      {"role": "assistant", "content": r["completion"]}]}
                                        for r in rows])
    # plain text + EOS; chats with a completion mask; messages with TRL's assistant mask (generation markers)
    for data in (strings, as_chat(strings), turns):
        messages = "messages" in data.column_names
        config = SFTConfig(output_dir=str(tmp_path), max_length=MAX_LENGTH, use_cpu=True, report_to=[],
                           assistant_only_loss=messages)
        # Each trainer hashes the 151k-token tokenizer for datasets' fingerprint: seconds, so one per shape only.
        labels = SFTTrainer(model=model, args=config, train_dataset=data, processing_class=tokenizer
                            ).train_dataset["labels"]
        trained = sum(sum(1 for t in row if t != -100) for row in labels)
        report = audit(data, tokenizer=tokenizer, max_length=MAX_LENGTH)
        assert report.tokens["trainable_tokens"]["total"] == trained, data.column_names
        assert report.tokens["loss_on"] == ("assistant turns" if messages else "completion")
        # TRL drops the rows left with nothing to learn; the audit flags the same number.
        assert len(data) - len(labels) == report.tokens["no_trainable_rows"] == 1
    # Loss on every token (assistant_only_loss=False): the whole truncated sequence is trained.
    everything = audit(turns, tokenizer=tokenizer, max_length=MAX_LENGTH, assistant_only=False)
    assert everything.tokens["loss_on"] == "all tokens"
    lengths = [len(ids) for ids in tokenizer.apply_chat_template(list(turns["messages"]), tokenize=True,
                                                                 return_dict=True)["input_ids"]]
    assert everything.tokens["trainable_tokens"]["total"] == sum(min(n, MAX_LENGTH) for n in lengths)


def test_unreadable_rows_accepted_without_cleaning_cannot_stop_training(tokenizer, tiny_model_dir, tmp_path, capsys):
    """auto_clean=False, accept_problems=True keeps what the user accepted, but not the rows no trainer can read:
    kept, they stopped TRL's data preparation (after the model loaded). Now they are dropped, saying so and where."""
    import torch
    from transformers import AutoModelForCausalLM
    from trl import SFTConfig, SFTTrainer

    turns = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
              {"role": "assistant", "content": f"The answer to question {i} is {2 * i}."}] for i in range(12)]
    turns[3][1]["content"] = 42
    turns[7][1]["role"] = "bot"
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": t}) for t in turns))
    rows = normalize(load_rows(str(path)))
    kept, report, summary = audit_and_clean(rows, auto_clean=False, accept_problems=True, tokenizer=tokenizer,
                                            max_length=MAX_LENGTH, source=str(path))
    out = capsys.readouterr().out
    assert "Dropped 2 rows that no trainer can read, although auto_clean=False" in out
    assert "row 3: messages[1].content is int 42, not text" in out
    assert len(kept) == summary.rows_after == 10 and report.finding("malformed") is None

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    config = SFTConfig(output_dir=str(tmp_path / "run"), max_length=MAX_LENGTH, use_cpu=True, report_to=[],
                       assistant_only_loss=True)
    trained = SFTTrainer(model=model, args=config, train_dataset=kept, processing_class=tokenizer).train_dataset
    assert len(trained) == 10
    with pytest.raises(TypeError, match="concatenate str"):  # the same rows kept as they were: TRL stops
        SFTTrainer(model=model, args=config, train_dataset=rows, processing_class=tokenizer)


def test_tiktoken_twin_gives_the_tokenizers_ids(tokenizer, home_assistant_sample, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    import freetune.audit.twin as audit_module
    from freetune.audit.twin import _PROBE, tiktoken_twin

    twin, why = tiktoken_twin(tokenizer)
    assert twin is not None, why
    chats = tokenizer.apply_chat_template(list(normalize(load_rows(str(home_assistant_sample)))["messages"][:50]),
                                          tokenize=False)
    texts = [_PROBE, "  leading spaces\n\n\ntrailing  ", "x" * 5000, "١٢٣ ٤٥٦ digits 0123456789"] + chats
    expected = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert [twin.encode(t, allowed_special="all") for t in texts] == expected

    # The same audit through the tokenizer alone gives a byte-identical report.
    data = datasets.Dataset.from_list(contaminated_rows())
    kwargs = dict(tokenizer=tokenizer, max_length=MAX_LENGTH, checks=CHECKS)
    with_twin = audit(data, **kwargs)
    assert with_twin.engine.startswith("tiktoken twin")
    monkeypatch.setattr(audit_module, "_TWINS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(audit_module, "tiktoken_twin", lambda tok: (None, "switched off for this test"))
    without = audit(data, **kwargs)
    assert without.engine == "the tokenizer (no tiktoken twin: switched off for this test)"
    # A twin that splits text differently (GPT-2's pattern, not Qwen's) is caught on the first rows and dropped;
    # the report is still the tokenizer's.
    wrong = tiktoken.Encoding("wrong", pat_str=audit_module._GPT2_PATTERN, mergeable_ranks=twin._mergeable_ranks,
                              special_tokens=twin._special_tokens)
    monkeypatch.setattr(audit_module, "_TWINS", weakref.WeakKeyDictionary())
    monkeypatch.setattr(audit_module, "tiktoken_twin", lambda tok: (wrong, "deliberately wrong"))
    caught = audit(data, **kwargs)
    assert caught.engine.startswith("the tokenizer (its tiktoken twin differed")
    assert with_twin.to_json() == without.to_json() == caught.to_json()


def test_tiktoken_twin_declines_what_it_cannot_mirror(tokenizer):
    pytest.importorskip("tiktoken")
    from tokenizers import normalizers

    from freetune.audit import tiktoken_twin

    backend = tokenizer.backend_tokenizer
    saved = backend.normalizer
    try:
        backend.normalizer = normalizers.Lowercase()
        twin, why = tiktoken_twin(tokenizer)
    finally:
        backend.normalizer = saved
    assert twin is None and "Lowercase" in why


def test_cli_prints_valid_json_for_the_bundled_sample(svg_sample):
    result = subprocess.run([sys.executable, "-m", "freetune.audit", str(svg_sample), "--json", "--checks", "svg"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["rows"] == 240 and data["shape"] == "prompt_completion"
    assert data["settings"]["checks"] == ["svg", "svg_xml"]
    assert not any(f["kind"] == "check" for f in data["findings"])


def test_cli_errors_say_what_to_change(svg_sample, capsys):
    assert main([str(svg_sample), "--checks", "no_such_task"]) == 1
    assert "--checks svg" in capsys.readouterr().err
    assert main([str(svg_sample), "--columns", "{not json"]) == 1
    assert main([str(svg_sample), "--strict"]) == 2   # the sample carries 2 copies and 4 conflicting prompts
    assert "exact duplicate row" in capsys.readouterr().out


def test_a_max_length_that_cuts_off_every_answer_says_raise_max_length(contaminated, tokenizer):
    # A max_length shorter than every prompt leaves no row with a trained token: the fix is max_length, not
    # `columns` (which the message used to point at).
    train, _ = contaminated
    with pytest.raises(FreetuneError, match=r"max_length = 2 cuts off the answers of 212 rows: raise max_length "
                                            r"\(the shortest row has \d+ tokens\)"):
        audit_and_clean(train, auto_clean=True, accept_problems=False, tokenizer=tokenizer, max_length=2,
                        checks=CHECKS)
