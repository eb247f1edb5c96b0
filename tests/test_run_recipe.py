"""scripts/run_recipe.py and plain papermill as a newcomer uses them: progress on the terminal while a run goes, a
rerun that says it trained nothing, relative paths from the caller's folder, the README's papermill line, and no
noise of ours in the first run."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, run_recipe

from scripts.run_recipe import parse_parameters

STEP_LINE = re.compile(r"^(\[default0\]:)?step +\d+/8  loss ", re.M)  # torchrun's --tee prefixes rank 0's lines


def printed_json(stdout: str) -> dict:
    """The summary run_recipe prints: the last top-level JSON object on stdout."""
    return json.loads(stdout[stdout.rindex("\n{\n") + 1:stdout.rindex("\n}\n") + 2])


@pytest.mark.slow
@pytest.mark.parametrize("target", ["colab", "kaggle"])
def test_a_headless_run_streams_cell_headings_and_step_lines(executed_notebook, target):
    result, record, _, _ = executed_notebook("svg_coder", target)
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    train = "== Train" if target == "colab" else "== Model and training"  # Kaggle: one script on every GPU
    for heading in ("== Preflight", "== Data audit", train, "== Evaluate"):
        assert heading in out
    assert re.search(rf"^-- cell \d+: run = freetune\.RunConfig\.from_cell\(globals\(\), recipe='svg_coder', "
                     rf"target='{target}'\)$", out, re.M)
    # Kaggle's steps come from rank 0 under torchrun, streamed through the notebook's launch cell.
    assert len(STEP_LINE.findall(out)) == 8
    assert out.index("== Data audit") < STEP_LINE.search(out).start() < out.index("== Evaluate")
    assert printed_json(out)["steps_this_session"] == 8 == record["training"]["steps"]


@pytest.mark.slow
def test_a_rerun_that_trains_nothing_says_so(executed_notebook, tmp_path):
    _, _, _, first = executed_notebook("svg_coder", "colab")
    shutil.copytree(first / "runs", tmp_path / "runs")  # the finished run's folder, checkpoint-8 included
    result, record, _ = run_recipe("svg_coder", "colab", tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    shown = printed_json(result.stdout)
    assert (shown["steps"], shown["steps_this_session"], shown["resumed_from"]) == (8, 0, "checkpoint-8")
    assert not STEP_LINE.search(result.stdout) and "this run's training is already done" in result.stdout


def test_relative_paths_are_taken_from_the_caller_s_folder(tmp_path):
    (tmp_path / "mine.jsonl").write_text("{}\n")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "local-set").mkdir()
    given = [("dataset", "mine.jsonl"), ("model_id", "Qwen/Qwen2.5-Coder-1.5B-Instruct"), ("output_dir", "out"),
             ("max_steps", "5")]
    parsed = parse_parameters(given, base=tmp_path)
    assert parsed == {"dataset": str(tmp_path / "mine.jsonl"), "model_id": "Qwen/Qwen2.5-Coder-1.5B-Instruct",
                      "output_dir": str(tmp_path / "out"), "max_steps": 5}
    # A name that is both a hub id and a folder here is the folder, as freetune.data.load_rows reads it.
    assert parse_parameters([("dataset", "user/local-set")], base=tmp_path)["dataset"] == str(
        tmp_path / "user" / "local-set")
    assert parse_parameters([("dataset", "./missing.jsonl")], base=tmp_path)["dataset"] == str(
        tmp_path / "missing.jsonl")
    assert parse_parameters([("dataset", "/abs/rows.jsonl")], base=tmp_path)["dataset"] == "/abs/rows.jsonl"
    # ~ is the caller's home, as the shell would expand it (run_recipe reads the run's summary back from there).
    assert parse_parameters([("output_dir", "~/runs")], base=tmp_path)["output_dir"] == str(Path.home() / "runs")


def test_a_relative_data_file_is_read_from_the_caller_s_folder_and_checked_before_the_model(tmp_path):
    (tmp_path / "rows.jsonl").write_bytes('{"prompt": "caf\xe9", "completion": "<svg/>"}\n'.encode("latin-1"))
    command = [sys.executable, str(REPO / "scripts" / "run_recipe.py"), "svg_coder", "--embedded",
               "--out", "headless", "-p", "dataset", "rows.jsonl"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert result.returncode == 1
    record = json.loads((tmp_path / "headless" / "svg_coder-colab.json").read_text())
    assert f"{tmp_path / 'rows.jsonl'}' is not UTF-8 text: line 1" in record["error"]
    assert "== Data audit" in result.stdout and "== Model" not in result.stdout


def test_the_readme_papermill_command_runs_as_written_and_refuses_a_misspelled_parameter(tmp_path):
    readme = (REPO / "README.md").read_text()
    line = re.search(r"^mkdir -p runs/papermill && \.venv/bin/papermill .*?(?<!\\)$", readme, re.M | re.S).group(0)
    line = line.replace("\\\n", " ")
    # As written, from the repository root, but into this test's folder instead of the repository's runs/, and with
    # a misspelled parameter added: the notebook stops in its preflight cell, before anything is loaded.
    command = line.replace("runs/papermill", shlex.quote(str(tmp_path / "papermill"))) + " -p lora_r 8"
    result = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=900,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode != 0
    assert "lora_r: not a parameter of this notebook (did you mean lora_rank?)" in result.stderr
    assert "-- cell" not in result.stderr  # plain papermill: no run_recipe in between
    assert (tmp_path / "papermill" / "svg_coder.ipynb").exists()
    assert not list(tmp_path.glob("papermill/freetune-runs/*/data/train")), "stopped before the data was read"


def test_building_the_tiny_model_prints_no_deprecation(tmp_path, tiny_model_dir):
    from freetune.fixtures import fixture_cache_dir

    code = ("import sys; from freetune.fixtures import build_tiny_model; "
            "build_tiny_model(sys.argv[1], architecture='qwen2', tokenizer_dir=sys.argv[2])")
    tokenizer = fixture_cache_dir() / "qwen-tokenizer"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m"), str(tokenizer)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "deprecated" not in done.stderr.lower(), done.stderr[-2000:]


def test_the_real_model_run_is_offered_where_a_sample_suits_it_and_refused_with_what_to_do_elsewhere():
    from scripts.run_recipe import main

    with pytest.raises(SystemExit) as refused:  # before anything loads: no model is built or read
        main(["tiny_4gb", "--real-model"])
    assert "no real-model default for recipe 'tiny_4gb'; known: ['svg_coder']" in str(refused.value)
    assert "-p model_id" in str(refused.value) and "-p learning_rate 1e-3" in str(refused.value)
