"""Bad input stops with a message that says what to change, before any model is loaded."""

import json
from pathlib import Path

import datasets
import pytest

from conftest import REPO
from freetune import audit, data, model, params
from freetune.errors import FreetuneError
from freetune.plan import make_plan



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


def test_malformed_json_line_is_named_with_its_number(tmp_path):
    good = '{"prompt": "a", "completion": "b"}\n'
    (tmp_path / "bad.jsonl").write_text(good * 2 + '{"prompt": "a", "completion": \n' + good)
    with pytest.raises(FreetuneError, match=r"bad\.jsonl, line 3, column \d+: Expecting value"):
        data.load_rows(str(tmp_path / "bad.jsonl"))
    (tmp_path / "list.jsonl").write_text(good + "[1, 2]\n")
    with pytest.raises(FreetuneError, match=r"list\.jsonl, line 2 holds a JSON list, not an object"):
        data.load_rows(str(tmp_path / "list.jsonl"))
    (tmp_path / "rows.json").write_text('[{"prompt": "a", "completion": "b"},\n {"prompt": "a" "completion": "b"}]')
    with pytest.raises(FreetuneError, match=r"rows\.json, line 2, column \d+: Expecting ',' delimiter"):
        data.load_rows(str(tmp_path / "rows.json"))


def test_latin1_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    rows = [{"prompt": "Draw a house", "completion": "<svg/>"}, {"prompt": "Zeichne ein Café", "completion": "<svg/>"}]
    path.write_bytes("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("latin-1"))
    # datasets reads such a file without complaint and fails later, at the first row it decodes, naming nothing.
    with pytest.raises(FreetuneError, match=r"latin1\.jsonl' is not UTF-8 text: line 2 has the byte 0xe9.*iconv"):
        data.load_rows(str(path))


def test_a_latin1_byte_deep_in_a_large_file_is_found_too(tmp_path):
    """The check reads the whole file, not only until its first text (it reads in 1 MiB chunks)."""
    path = tmp_path / "big.jsonl"
    good = json.dumps({"prompt": "Draw a house", "completion": "<svg/>"}) + "\n"
    lines = 2**21 // len(good)
    path.write_bytes(good.encode() * lines + '{"prompt": "Caf\u00e9", "completion": "<svg/>"}\n'.encode("latin-1"))
    with pytest.raises(FreetuneError, match=rf"big\.jsonl' is not UTF-8 text: line {lines + 1} has the byte 0xe9"):
        data.load_rows(str(path))


def test_empty_and_blank_files(tmp_path):
    for name, content in (("empty.jsonl", ""), ("empty.csv", ""), ("blank.jsonl", "\n  \n")):
        (tmp_path / name).write_text(content)
    with pytest.raises(FreetuneError, match=r"empty\.jsonl' is empty \(0 bytes\)"):
        data.load_rows(str(tmp_path / "empty.jsonl"))
    with pytest.raises(FreetuneError, match=r"empty\.csv' is empty"):
        data.load_rows(str(tmp_path / "empty.csv"))
    with pytest.raises(FreetuneError, match=r"blank\.jsonl' holds only whitespace"):
        data.load_rows(str(tmp_path / "blank.jsonl"))


def test_folders(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.md").write_text("my rows are elsewhere")
    with pytest.raises(FreetuneError, match=r"holds no .csv, .json, .jsonl, .parquet files \(it holds \['readme"):
        data.load_rows(str(tmp_path / "notes"))
    (tmp_path / "rows").mkdir()
    write_jsonl(tmp_path / "rows" / "train.jsonl", [{"prompt": "a", "completion": "b"}] * 3)
    assert len(data.load_rows(str(tmp_path / "rows"))) == 3  # a folder of data files still loads
    (tmp_path / "rows" / "train.jsonl").write_text('{"prompt": "a", "completion": "b"}\n{"prompt": \n')
    with pytest.raises(FreetuneError, match=r"train\.jsonl, line 2"):
        data.load_rows(str(tmp_path / "rows"))


def test_csv_error_is_the_reader_s_own(tmp_path):
    (tmp_path / "bad.csv").write_text('prompt,completion\n"a,b\n')
    with pytest.raises(FreetuneError, match=r"bad\.csv.*ParserError: .*EOF inside string") as caught:
        data.load_rows(str(tmp_path / "bad.csv"))
    assert "An error occurred while generating the dataset" not in str(caught.value)


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


def recipe_namespace(recipe: str, **injected):
    """A notebook's globals after its parameters cell and papermill's injected cell (written by papermill itself),
    with IPython's input history, as `freetune.params.check(globals())` sees them in the preflight cell."""
    import nbformat
    from papermill.translators import translate_parameters

    nb = nbformat.read(REPO / "notebooks" / "colab" / f"{recipe}.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    namespace: dict = {}
    exec(cell.source, namespace)
    history = ["", cell.source]
    if injected:
        history.append(translate_parameters("python3", "python", injected, "Parameters"))
        exec(history[-1], namespace)
    namespace["In"] = history
    return namespace


@pytest.mark.parametrize("recipe", ["svg_coder", "home_assistant", "tiny_4gb"])
def test_every_recipe_s_defaults_pass(recipe):
    namespace = recipe_namespace(recipe)
    assert set(params.check(namespace)) == set(namespace["__annotations__"])


# Found by trying each as a new user would; each used to get past the preflight (most of them to the model).
@pytest.mark.parametrize("name, value, says", [
    ("max_steps", -5, "must be 1 or more"),   # trained a whole epoch and reported success
    ("max_steps", 0, "must be 1 or more"),    # saved an untrained adapter, then a TypeError
    ("save_steps", 0, "must be 1 or more"),
    ("lora_rank", 0, "must be 1 or more"),    # peft's error blamed lora_targets
    ("lora_dropout", 1.5, "must be from 0 to below 1"),
    ("micro_batch", -1, "must be 0 or more"),
    ("learning_rate", 0.0, "must be above 0 and below 1"),
    ("learning_rate", 2e4, "must be above 0 and below 1"),  # 2e-4 typed as 2e4
    ("time_budget_min", -1.0, "must be 0 or more"),
    ("grad_accum", 0, "must be 1 or more"),   # was accepted
    ("precision", "fp32", "must be one of 'auto', 'fp16', 'bf16'"),
    ("columns", {"promt": "question"}, "has key(s) ['promt']"),
    ("hub_repo", "svg-coder", "a Hub repo id 'your-name/repo-name'"),
    ("optimizer", "adamw_fused", "did you mean 'adamw_torch_fused'?"),
])
def test_out_of_range_parameter_is_named_before_anything_loads(name, value, says):
    with pytest.raises(FreetuneError) as caught:
        params.check(recipe_namespace("svg_coder", **{name: value}))
    problems = [line for line in str(caught.value).splitlines() if line.startswith("  ")]
    assert len(problems) == 1 and problems[0].startswith(f"  {name} = {value!r}: ") and says in problems[0]
    assert "lora_targets" not in str(caught.value)


def test_every_problem_is_listed_at_once():
    bad = {"max_steps": -5, "lora_rank": 0, "lora_dropout": 1.5, "grad_accum": 0, "lora_r": 8}
    with pytest.raises(FreetuneError) as caught:
        params.check(recipe_namespace("svg_coder", **bad))
    problems = [line.split()[0] for line in str(caught.value).splitlines() if line.startswith("  ")]
    # In the parameters cell's order, the names the notebook does not have last.
    declared = list(recipe_namespace("svg_coder")["__annotations__"])
    assert problems == sorted(set(bad) - {"lora_r"}, key=declared.index) + ["lora_r:"]


def test_a_misspelled_parameter_is_refused_with_a_suggestion():
    # papermill only logs "Passed unknown parameter" and the run trained at the default rank.
    with pytest.raises(FreetuneError, match=r"lora_r: not a parameter of this notebook \(did you mean lora_rank\?\)"):
        params.check(recipe_namespace("svg_coder", lora_r=8))
    with pytest.raises(FreetuneError, match=r"wibble: not a parameter of this notebook \(the parameters are: "
                                            r"model_id, dataset,"):
        params.check(recipe_namespace("tiny_4gb", wibble=1))


def test_library_callers_get_the_same_checks(tmp_path):
    # attach_lora checks before it touches the model, so no model is needed to see the message.
    with pytest.raises(FreetuneError, match=r"lora_rank = 0: must be 1 or more[^\n]*\n  lora_dropout = 1.5"):
        model.attach_lora(None, rank=0, alpha=16, dropout=1.5)
    from freetune.platform import resolve_paths
    from freetune.sft_config import make_config

    paths = resolve_paths(None, str(tmp_path), "run")
    with pytest.raises(FreetuneError, match=r"grad_accum = 0: .*\n  save_steps = 0"):
        make_config(paths, make_plan(), max_steps=4, micro_batch=1, grad_accum=0, learning_rate=1e-4, max_length=64,
                    save_steps=0)


def test_parameter_of_the_wrong_type():
    namespace = {"__annotations__": {"max_steps": int, "max_grad_norm": float, "columns": dict, "run_name": str},
                 "max_steps": "fifty", "max_grad_norm": 1, "columns": {}, "run_name": "x"}
    with pytest.raises(FreetuneError, match=r"max_steps = 'fifty' \(str\), but it must be int"):
        params.check(namespace)
    namespace["max_steps"] = 50
    assert params.check(namespace) == {"max_steps": 50, "max_grad_norm": 1.0, "columns": {}, "run_name": "x"}
    namespace["max_steps"] = True  # a bool is not a step count
    with pytest.raises(FreetuneError):
        params.check(namespace)


def test_every_answer_one_stub_is_blocked_without_task_checks():
    # tiny_4gb audits with checks=None: no task check catches the stub, and the repeated-answer rule used to need
    # other, longer distinct answers to measure it against.
    rows = datasets.Dataset.from_list(
        [{"prompt": f"Tell me about topic {i}.", "completion": "No valid response from model."} for i in range(40)])
    report = audit.audit(rows, checks=None)
    assert [f.id for f in report.blocking] == ["repeated"] and report.blocking[0].count == 40
    assert "Every row has this one answer" in report.blocking[0].message
    with pytest.raises(FreetuneError, match="nothing is left to train on"):
        audit.audit_and_clean(rows, auto_clean=True, accept_problems=False, checks=None)


def test_few_distinct_answers_are_a_label_set_not_junk():
    def labels(counts):
        rows = [{"prompt": f"Review {i}: it was {label}.", "completion": label}
                for label, n in counts.items() for i in range(n)]
        return audit.audit(datasets.Dataset.from_list(rows))

    skewed = labels({"positive": 30, "negative": 15, "neutral": 5})
    assert skewed.blocking == [] and skewed.warnings == []
    assert skewed.labels["classes"] == {"positive": 30, "negative": 15, "neutral": 5}
    assert "Label set: 3 classes" in skewed.table()
    # One answer left alone is still a stub: nothing else to learn.
    single = labels({"positive": 30, "negative": 1})
    assert [f.id for f in single.blocking] == ["repeated"] and single.blocking[0].count == 30


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

    import freetune

    subprocess.run([sys.executable, "scripts/make_sample_data.py", "--out", str(tmp_path)], check=True,
                   capture_output=True, cwd=REPO)
    bundled = Path(freetune.__file__).parent / "sample_data"
    names = sorted(p.name for p in bundled.glob("*.jsonl"))
    assert names == ["alpaca_sample.jsonl", "home_assistant_sample.jsonl", "multiturn_sample.jsonl",
                     "sharegpt_sample.jsonl", "svg_sample.jsonl", "svg_short_sample.jsonl"]
    for name in names:
        assert (tmp_path / name).read_bytes() == (bundled / name).read_bytes(), name


@pytest.mark.parametrize("sample, shape", [("svg", "prompt_completion"), ("svg_short", "prompt_completion"),
                                           ("alpaca", "prompt_completion"),
                                           ("home_assistant", "messages"), ("multiturn", "messages"),
                                           ("sharegpt", "messages")])
def test_the_audit_reads_every_bundled_shape(sample, shape, tiny_model_dir):
    from freetune.fixtures import sample_data_path

    rows = data.normalize(data.load_rows(str(sample_data_path(sample))))
    tokenizer = model.load_tokenizer(str(tiny_model_dir))
    report = audit.audit(rows, tokenizer=tokenizer, max_length=256).to_dict()
    expected_rows = 160 if sample == "svg_short" else 240
    assert report["shape"] == shape and report["rows"] == expected_rows
    tokens = report["tokens"]
    assert tokens["trainable_tokens"]["min"] > 0 and tokens["no_trainable_rows"] == 0
    assert tokens["eos_in_labels_rows"] == expected_rows  # every row learns to end its answer
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
    readme = (REPO / "README.md").read_text()
    section = readme.split("**Data as it comes.**", 1)[1].split("**Base models.**", 1)[0]
    for shape in ("`messages`", "`conversations`", "`prompt`, `completion`", "`instruction`", "`output`"):
        assert shape in section, shape
    for sample in (REPO / "freetune" / "sample_data").glob("*.jsonl"):
        assert f"`{sample.name}`" in section, sample.name
