"""Bad input stops with a message that says what to change, before any model is loaded."""

import json

import pytest

from freetune import data, model, params
from freetune.errors import FreetuneError
from freetune.preflight import make_plan


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_missing_data_file(tmp_path):
    with pytest.raises(FreetuneError, match="does not exist.*`dataset` parameter"):
        data.load_rows(str(tmp_path / "nope.jsonl"))


def test_unreadable_file_type(tmp_path):
    (tmp_path / "rows.txt").write_text("hello")
    with pytest.raises(FreetuneError, match="freetune reads"):
        data.load_rows(str(tmp_path / "rows.txt"))


def test_malformed_json(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a", "completion": \n')
    with pytest.raises(FreetuneError, match="Could not read data set file"):
        data.load_rows(str(tmp_path / "bad.jsonl"))


def test_unreachable_hub_id():
    # Tests run offline (HF_HUB_OFFLINE=1), exactly like a notebook without internet.
    with pytest.raises(FreetuneError, match="Could not load data set 'no-such-user/no-such-set'.*online"):
        data.load_rows("no-such-user/no-such-set")


def test_missing_columns_are_named(tmp_path):
    rows = data.load_rows(write_jsonl(tmp_path / "d.jsonl", [{"question": "q", "answer": "a"}]))
    with pytest.raises(FreetuneError, match=r"Cannot tell which columns.*\['answer', 'question'\].*`columns`"):
        data.normalize(rows)
    with pytest.raises(FreetuneError, match=r"names \['output'\], which the data set does not have"):
        data.normalize(rows, columns={"prompt": "question", "completion": "output"})


def test_empty_data_set(tmp_path):
    import datasets

    with pytest.raises(FreetuneError, match="no rows"):
        data.normalize(datasets.Dataset.from_list([]))


def test_instruction_input_output_mapping(tmp_path):
    rows = data.load_rows(write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ]))
    out = data.normalize(rows, columns={"prompt": ["instruction", "input"], "completion": "output"})
    assert out.column_names == ["prompt", "completion"]
    assert out[0] == {"prompt": "Add the numbers.\n\n2 and 3", "completion": "5"}
    assert out[1]["prompt"] == "Say hi."  # empty input is skipped, not joined as a blank line


def test_prompt_completion_message_lists_and_messages(tmp_path, home_assistant_sample):
    rows = data.load_rows(write_jsonl(tmp_path / "pc.jsonl", [
        {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}]))
    out = data.normalize(rows, system_prompt="be brief")
    assert out[0]["prompt"][0] == {"role": "system", "content": "be brief"}
    assert data.completion_text(out[0]) == "yo"
    chats = data.normalize(data.load_rows(str(home_assistant_sample)))
    assert chats.column_names == ["messages"] and chats[0]["messages"][-1]["role"] == "assistant"


def test_messages_without_assistant_turn(tmp_path):
    rows = data.load_rows(write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "x"}]}]))
    with pytest.raises(FreetuneError, match="no assistant turn"):
        data.normalize(rows)


def test_model_path_that_does_not_exist(tmp_path):
    with pytest.raises(FreetuneError, match="does not exist.*`model_id`"):
        model.load_tokenizer(str(tmp_path / "missing-model"))
    with pytest.raises(FreetuneError, match="does not exist.*`model_id`"):
        model.load_base_model(str(tmp_path / "missing-model"), make_plan())


def test_chat_template_that_cannot_mark_assistant_turns(tiny_model_dir, home_assistant_sample):
    tokenizer = model.load_tokenizer(str(tiny_model_dir))
    chats = data.normalize(data.load_rows(str(home_assistant_sample)))
    assert "assistant turns only" in model.check_chat_template(tokenizer, chats)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    with pytest.raises(FreetuneError, match="cannot mark assistant turns.*prompt`/`completion"):
        model.check_chat_template(tokenizer, chats)


def test_parameter_of_the_wrong_type():
    namespace = {"__annotations__": {"max_steps": int, "learning_rate": float, "columns": dict, "run_name": str},
                 "max_steps": "fifty", "learning_rate": 1, "columns": {}, "run_name": "x"}
    with pytest.raises(FreetuneError, match=r"max_steps = 'fifty' \(str\), but it must be int"):
        params.check(namespace)
    namespace["max_steps"] = 50
    assert params.check(namespace) == {"max_steps": 50, "learning_rate": 1.0, "columns": {}, "run_name": "x"}
    namespace["max_steps"] = True  # a bool is not a step count
    with pytest.raises(FreetuneError):
        params.check(namespace)


# --------------------------------------------------------------------------------- data as it comes

def test_sharegpt_rows_are_read_as_messages_without_a_mapping(tmp_path, capsys):
    rows = data.load_rows(write_jsonl(tmp_path / "sharegpt.jsonl", [
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"},
                           {"from": "human", "value": "Add 2 and 3."}, {"from": "gpt", "value": "5"}], "id": 1},
        {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                           {"from": "gpt", "value": "Hi."}], "id": 2},
    ]))
    out = data.normalize(rows, system_prompt="You help.")
    assert "ShareGPT" in capsys.readouterr().out
    assert out.column_names == ["messages"]
    assert out[0]["messages"] == [{"role": "system", "content": "You help."}, {"role": "user", "content": "Hi"},
                                  {"role": "assistant", "content": "Hello!"},
                                  {"role": "user", "content": "Add 2 and 3."}, {"role": "assistant", "content": "5"}]
    assert out[1]["messages"][0] == {"role": "system", "content": "Be brief."}  # its own system turn is kept
    assert data.completion_text(out[0]) == "Hello!\n5"  # every assistant turn is trained, not only the last


def test_sharegpt_turns_from_an_unknown_speaker_are_named(tmp_path):
    rows = data.load_rows(write_jsonl(tmp_path / "tools.jsonl", [
        {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "function_call", "value": "{}"},
                           {"from": "gpt", "value": "4"}]}]))
    with pytest.raises(FreetuneError, match="comes from 'function_call'.*Rename those turns"):
        data.normalize(rows)


def test_alpaca_rows_are_recognised_by_their_column_names(tmp_path, capsys):
    rows = data.load_rows(write_jsonl(tmp_path / "alpaca.jsonl", [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "Say hi.", "input": "", "output": "hi"},
    ]))
    out = data.normalize(rows)
    assert "Alpaca rows read as prompt = instruction + input, completion = output" in capsys.readouterr().out
    assert out.column_names == ["prompt", "completion"]
    assert out[0] == {"prompt": "Add the numbers.\n\n2 and 3", "completion": "5"}
    assert out[1]["prompt"] == "Say hi."
    no_input = data.load_rows(write_jsonl(tmp_path / "no_input.jsonl", [{"instruction": "Say hi.", "output": "hi"}]))
    assert data.normalize(no_input)[0] == {"prompt": "Say hi.", "completion": "hi"}
    # A mapping the user gives wins over the recognised one.
    mapped = data.normalize(rows, columns={"prompt": "input", "completion": "output"})
    assert mapped[0]["prompt"] == "2 and 3"


def test_the_bundled_samples_are_regenerated_byte_for_byte(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import freetune

    subprocess.run([sys.executable, "scripts/make_sample_data.py", "--out", str(tmp_path)], check=True,
                   capture_output=True, cwd=Path(freetune.__file__).parents[1])
    bundled = Path(freetune.__file__).parent / "sample_data"
    names = sorted(p.name for p in bundled.glob("*.jsonl"))
    assert names == ["alpaca_sample.jsonl", "home_assistant_sample.jsonl", "multiturn_sample.jsonl",
                     "sharegpt_sample.jsonl", "svg_sample.jsonl"]
    for name in names:
        assert (tmp_path / name).read_bytes() == (bundled / name).read_bytes(), name


@pytest.mark.parametrize("sample, shape", [("svg", "prompt_completion"), ("alpaca", "prompt_completion"),
                                           ("home_assistant", "messages"), ("multiturn", "messages"),
                                           ("sharegpt", "messages")])
def test_the_audit_reads_every_bundled_shape(sample, shape, tiny_model_dir):
    from freetune import audit
    from freetune.fixtures import sample_data_path

    rows = data.normalize(data.load_rows(str(sample_data_path(sample))))
    tokenizer = model.load_tokenizer(str(tiny_model_dir))
    report = audit.audit(rows, tokenizer=tokenizer, max_length=256).to_dict()
    assert report["shape"] == shape and report["rows"] == 240
    tokens = report["tokens"]
    assert tokens["trainable_tokens"]["min"] > 0 and tokens["no_trainable_rows"] == 0
    assert tokens["eos_in_labels_rows"] == 240  # every row learns to end its answer
    if shape == "messages":
        assert tokens["loss_on"] == "assistant turns"
        # Every assistant turn is counted as trained, not only the last one of each conversation.
        answers = [[m["content"] for m in row["messages"] if m["role"] == "assistant"] for row in rows]
        every = sum(len(tokenizer(a)["input_ids"]) for turns in answers for a in turns)
        last_only = sum(len(tokenizer(turns[-1])["input_ids"]) + 2 for turns in answers)
        assert tokens["trainable_tokens"]["total"] >= every
        if sample != "home_assistant":  # one exchange per row there
            assert every > last_only


def test_the_readme_says_which_shapes_are_read():
    from pathlib import Path

    import freetune

    root = Path(freetune.__file__).parents[1]
    readme = (root / "README.md").read_text()
    section = readme.split("**Data as it comes.**", 1)[1].split("**Base models.**", 1)[0]
    for shape in ("`messages`", "`conversations`", "`prompt`, `completion`", "`instruction`", "`output`"):
        assert shape in section, shape
    for sample in (root / "freetune" / "sample_data").glob("*.jsonl"):
        assert f"`{sample.name}`" in section, sample.name
