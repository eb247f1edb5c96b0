"""The audit on data as users bring it: label sets train without false alarms, and the junk public sets carry
(refusals, seven kinds of error strings, cut-off answers, echoed prompts, other languages, unreadable rows) is
dropped or named. The shapes are scripts/audit_shapes.py's, the ones bench_audit.py --shapes measures. No tokenizer:
a few seconds in all."""

from __future__ import annotations

import json

import pytest

datasets = pytest.importorskip("datasets")

from freetune.audit import audit, audit_and_clean
from freetune.audit.junk import error_kind, is_refusal
from freetune.data import load_rows, normalize
from freetune.errors import FreetuneError
from scripts.audit_shapes import ERRORS, JUNK_KINDS, REFUSALS, SHAPES, measure


@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_shape_clean_trains_and_planted_junk_is_caught(shape):
    m = measure(shape, n=400, share=0.02)
    assert m["clean"] == {**m["clean"], "dropped": 0, "stopped": False, "warnings": []}
    junk = m["junk"]
    assert junk["legit_dropped"] == 0 and not junk["stopped"]
    for kind, rows in junk["planted"].items():
        assert kind in JUNK_KINDS and len(junk["missed"][kind]) <= 0.05 * len(rows), (kind, junk["caught_by"][kind])


def _labels(counts: dict[str, int]):
    rows = [{"prompt": f"Review {label} #{i}: how did it feel?", "completion": label}
            for label, n in counts.items() for i in range(n)]
    return audit(datasets.Dataset.from_list(rows))


def test_a_sentiment_set_trains_with_its_class_balance_line(capsys):
    report = _labels({"positive": 206, "negative": 194})
    assert report.findings == []
    assert report.labels["classes"] == {"positive": 206, "negative": 194}
    assert "Label set: 2 classes cover 100% of the answers" in report.table()
    rows = datasets.Dataset.from_list([{"prompt": f"r{i}", "completion": "yes" if i % 3 else "no"} for i in range(90)])
    kept, _, summary = audit_and_clean(rows, auto_clean=True, accept_problems=False)
    assert len(kept) == 90 and summary is None


def test_class_balance_warns_only_where_a_user_should_look():
    rare = _labels({"sports": 200, "politics": 150, "arts": 4})
    assert [f.id for f in rare.findings] == ["rare_class"] and rare.findings[0].count == 4
    dominant = _labels({"yes": 380, "no": 20})
    assert [f.id for f in dominant.findings] == ["dominant_class"]
    typo = _labels({"positive": 200, "negative": 190, "positve": 1})
    assert [f.id for f in typo.findings] == ["off_label"] and typo.findings[0].rows == [390]


def test_the_stub_story_reads_as_before():
    # 1.8% of SVG-like answers are the pipeline's error string: one blocking "repeated" finding on exactly them.
    circles = "".join(f'<circle cx="{k * 9}" cy="{k * 7}" r="{k + 3}" fill="#e53935"/>' for k in range(4))
    rows = [{"prompt": f"Draw item {i}.", "completion": f'<svg width="{i}" height="90">{circles}</svg>'}
            for i in range(500)]
    stubs = list(range(0, 500, 55))
    for i in stubs:
        rows[i]["completion"] = "No valid response from model."
    report = audit(datasets.Dataset.from_list(rows))
    assert [f.id for f in report.findings] == ["repeated"] and report.findings[0].rows == stubs


@pytest.mark.parametrize("text", ERRORS)
def test_every_kind_of_error_string_is_recognised(text):
    assert error_kind(text) is not None


@pytest.mark.parametrize("text", REFUSALS)
def test_refusals_are_recognised(text):
    assert is_refusal(text)


@pytest.mark.parametrize("text", ["I can explain that.", "Sorry for the wait: here is the SVG.", "positive",
                                  "None of the options is correct, because the premise is false.", "42",
                                  '{"name": "Bob", "error_rate": 0.1}', "The HTTP 404 status means not found."])
def test_answers_that_only_look_like_junk_are_not(text):
    assert error_kind(text) is None and not is_refusal(text)


def test_unreadable_rows_are_named_with_their_field_and_dropped(tmp_path):
    turns = [[{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i}."}]
             for i in range(40)]
    turns[3][1]["content"] = 42
    turns[5][1]["content"] = None
    turns[7] = [{"role": "user", "content": "Hello?"}]
    turns[9][1]["role"] = "bot"
    path = tmp_path / "chats.jsonl"
    path.write_text("\n".join(json.dumps({"messages": t}) for t in turns))
    rows = normalize(load_rows(str(path)))
    report = audit(rows, source=str(path))
    malformed = report.finding("malformed")
    assert malformed.severity == "blocking" and malformed.rows == [3, 5, 7, 9]
    assert "chats.jsonl" in malformed.message and "row 3" in malformed.message
    assert malformed.details["examples"] == [
        "row 3: messages[1].content is int 42, not text", "row 5: messages[1].content is null, not text",
        "row 7: no assistant turn (roles: user)",
        "row 9: messages[1].role is 'bot', not one of ['assistant', 'developer', 'system', 'tool', 'user']"]
    kept, after, _ = audit_and_clean(rows, auto_clean=True, accept_problems=False)
    assert len(kept) == 36 and after.blocking == []
    with pytest.raises(FreetuneError, match="auto_clean=True"):
        audit_and_clean(rows, auto_clean=False, accept_problems=False)
