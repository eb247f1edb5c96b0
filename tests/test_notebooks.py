"""The generated notebooks, executed headless by papermill exactly as a user would run them (tiny model, CPU).

Colab's notebook trains inline; Kaggle's writes train_ddp.py and runs it under real torchrun with 2 processes
on gloo. These are the slowest tests in the suite (~2-3 minutes each on 2 cores) and the most important.
"""

import json
import re

import nbformat
import pytest

from conftest import RECIPES, TARGETS, run_recipe

pytestmark = pytest.mark.slow


def outputs(nb, kind=None):
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if kind is None or output["output_type"] == kind:
                yield cell, output


def text_of(nb) -> str:
    parts = []
    for _, output in outputs(nb):
        if output["output_type"] == "error":
            parts.append(f"{output['ename']}: {output['evalue']}")
        else:
            parts.append(output.get("text", "") if "text" in output else json.dumps(output.get("data", {})))
    return "\n".join(parts)


def assert_trained_and_reloads(record, nb):
    assert record["status"] == "ok", record.get("error")
    assert not list(outputs(nb, "error")), "the executed notebook holds an error output"
    training = record["training"]
    assert training["steps"] == 8
    assert training["first_loss"] == training["first_loss"] and training["last_loss"] < training["first_loss"]
    # The adapter reloads onto the base model and generates: the evaluation cell did exactly that.
    text = text_of(nb)
    assert "base" in text and "adapter" in text and "verdict" in text
    from peft import PeftConfig

    assert PeftConfig.from_pretrained(training["adapter"]).base_model_name_or_path


def test_colab_notebook_trains_inline_and_the_adapter_reloads(executed_notebook):
    result, record, nb, out = executed_notebook("svg_coder", "colab")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained_and_reloads(record, nb)
    text = text_of(nb)
    assert "Data audit" in text and "Trained 8 steps" in text
    assert text.count("image/png") >= 2  # the loss plot and the SVG side-by-side image are shown
    assert (out / "runs" / "colab" / "svg-coder" / "reports" / "side_by_side.png").exists()


def test_kaggle_notebook_runs_train_ddp_under_torchrun_with_two_processes(executed_notebook):
    result, record, nb, out = executed_notebook("svg_coder", "kaggle")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained_and_reloads(record, nb)
    assert record["training"]["world_size"] == 2
    assert (out / "train_ddp.py").exists()
    logs = sorted((out / "runs" / "kaggle" / "svg-coder" / "torchrun_logs").glob("**/attempt_0/*/stdout.log"))
    assert [p.parent.name for p in logs] == ["0", "1"], "both ranks ran"
    by_rank = {p.parent.name: p.read_text() for p in logs}
    checksums = {rank: [l.split()[-1] for l in text.splitlines() if "trainable-weights checksum" in l]
                 for rank, text in by_rank.items()}
    assert checksums["0"] and checksums["0"] == checksums["1"], "LoRA weights must be identical on both ranks"
    assert "rank 1 wrote 0 file(s)" in by_rank["1"], by_rank["1"][-2000:]
    assert "dealt to the 2 ranks by length" in by_rank["0"]  # the ranks re-decide the sampler for their job size
    wrote0 = next(l for l in by_rank["0"].splitlines() if l.startswith("rank 0 wrote"))
    assert "adapter" in wrote0 or "reports" in wrote0  # the tracer does see rank 0's writes
    everything = text_of(nb) + "".join(p.read_text() for p in (out / "runs").glob("**/stderr.log"))
    assert "destroy_process_group() was not called" not in everything
    assert "All 2 ranks finished" in text_of(nb)


@pytest.fixture
def contaminated_svg(tmp_path, svg_sample):
    rows = [json.loads(line) for line in svg_sample.read_text().splitlines()]
    junk = [{"prompt": f"Draw icon number {i}", "completion": "No valid response from model."} for i in range(12)]
    path = tmp_path / "contaminated.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows + junk))
    return path


def test_a_contaminated_data_set_stops_the_notebook_before_training(tmp_path, contaminated_svg):
    result, record, nb = run_recipe("svg_coder", "colab", tmp_path / "stop", ("dataset", str(contaminated_svg)),
                                    ("auto_clean", "False"))
    assert result.returncode == 1 and record["status"] == "failed"  # papermill saw the cell fail
    assert "FreetuneError" in record["error"] and "accept_data_problems" in text_of(nb)
    assert "training" not in record  # stopped before any training
    assert "No valid response from model." in text_of(nb)  # the offending repeat is shown
    # The error is its message alone: no traceback of freetune's frames, no chain of causes.
    (_, error), = outputs(nb, "error")
    shown = "\n".join(error["traceback"])
    assert error["ename"] == "FreetuneError" and "accept_data_problems" in shown
    assert not re.search(r"Traceback|File \"|direct cause|During handling", shown), shown


def test_a_contaminated_data_set_trains_when_the_user_accepts_it(tmp_path, contaminated_svg):
    result, record, nb = run_recipe("svg_coder", "colab", tmp_path / "accept", ("dataset", str(contaminated_svg)),
                                    ("auto_clean", "False"), ("accept_data_problems", "True"), ("max_steps", "2"))
    assert record["status"] == "ok", record.get("error")
    assert record["training"]["steps"] == 2
    assert "WARNING" in text_of(nb)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r != "svg_coder"])
def test_other_recipes_run_inline(recipe, executed_notebook):
    result, record, nb, _ = executed_notebook(recipe, "colab")
    assert result.returncode == 0, result.stderr[-3000:]
    assert_trained_and_reloads(record, nb)


# What a user should never see in a notebook: the libraries' progress bars (tqdm's "42%|####  | 10/24 [00:01<..."),
# tqdm's ipywidgets warning, torchrun's rank prefix and thread banner, a deprecation warning with its source line.
PROGRESS_BAR = re.compile(r"\d+%\|.*\|.*\d+/\d+|it/s\]|examples/s\]")
NOISE = ("IProgress not found", "[default0]", "OMP_NUM_THREADS", "FutureWarning", "DistributedDataParallel(")
DURATION = r"(\d+ s|\d+ min \d\d s|\d+ h \d\d min)"


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_executed_notebook_reads_as_a_user_should_see_it(recipe, target, executed_notebook):
    _, record, nb, _ = executed_notebook(recipe, target)
    assert record["status"] == "ok", record.get("error")
    text = text_of(nb)
    assert not [line for line in text.splitlines() if PROGRESS_BAR.search(line)]
    assert not [noise for noise in NOISE if noise in text]
    parameters = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert max(len(line) for line in parameters.splitlines()) <= 100
    # One duration format: the summary, the ETA of the step lines and (Kaggle) the launcher agree.
    assert re.search(rf"Trained 8 steps in {DURATION} on", text)
    etas = re.findall(r"GiB  ETA (.*)$", text, re.M)  # the step lines' (generated text may hold "ETA" too)
    assert etas and all(re.fullmatch(DURATION, eta) for eta in etas), etas
    # The target's own wording, and nothing of the other's.
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    if target == "kaggle":
        assert re.search(rf"All 2 ranks finished in {DURATION} ", text)
        assert "**GPU T4 x2**" in markdown and "Internet **on**" in markdown
    else:
        assert "**T4 GPU**" in markdown and "torchrun" not in markdown and "T4 x2" not in markdown


# -------------------------------------------------- what users expect: eval, try it, one verdict (issue 26)

def cell_text(cell) -> str:
    return "".join(o.get("text", "") if "text" in o else json.dumps(o.get("data", {})) for o in cell.get("outputs", []))


@pytest.mark.parametrize("target", ["colab", "kaggle"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_notebook_evaluates_while_training_lets_you_try_it_and_gives_one_verdict(recipe, target,
                                                                                        executed_notebook):
    result, record, nb, out = executed_notebook(recipe, target)
    assert record["status"] == "ok", record.get("error")
    text = text_of(nb)
    # Eval while training (the embedded default evaluates every 2 of 8 steps): the progress lines (on Kaggle, rank
    # 0's log streamed into the notebook, under DDP), the summary, the summary cell's line.
    training = record["training"]
    assert [step for step, _ in training["eval_losses"]] == [2, 4, 6, 8]
    assert text.count("eval loss") >= 4 and "step     8/8  eval loss" in text
    assert "Held-out (eval) loss:" in text
    # Try it: headless, the held-out prompts are answered instead of waiting for input; on Kaggle in the notebook's
    # own kernel after torchrun has finished.
    cells = [c for c in nb.cells if c.cell_type == "code"]
    try_it = next(i for i, c in enumerate(cells) if "freetune.chat.try_it" in c.source)
    shown = cell_text(cells[try_it])
    assert "A headless run: nobody can type here" in shown and shown.count("\nyou: ") >= 2, shown[-2000:]
    # One output per answer (the prompt and the whole answer), not one per streamed word.
    answered = [o.get("text", "") for o in cells[try_it].outputs if "\nyou: " in o.get("text", "")]
    assert len(answered) == shown.count("\nyou: ") and all("\nadapter: " in t for t in answered), answered
    if target == "kaggle":
        launch = next(i for i, c in enumerate(cells) if "run_torchrun" in c.source)
        assert launch < try_it and "All 2 ranks finished" in cell_text(cells[launch])
    # One verdict per model, weighing its warnings: never "ok" next to a warning about that model's outputs.
    table = next(cell_text(c) for c in cells if "freetune.evaluate.compare" in c.source)
    verdicts = dict(re.findall(r"^(base|adapter): ([A-Z]+): ", table.replace("\\n", "\n"), flags=re.M))
    assert set(verdicts) == {"base", "adapter"}, table[-3000:]
    for side, verdict in verdicts.items():
        warned = re.search(rf"^{side}: warning: ", table.replace("\\n", "\n"), flags=re.M)
        assert (verdict == "OK") == (warned is None), (side, verdict, table[-3000:])


def test_a_base_model_with_sharegpt_rows_trains_on_a_named_template_and_logs_to_tensorboard(tmp_path):
    """ShareGPT conversations read without a mapping, audited, and trained with every assistant turn in the loss,
    on a base model without a chat template (chat_template='chatml'), logging to TensorBoard."""
    import shutil

    from freetune.fixtures import cached_tiny_model, sample_data_path

    base = tmp_path / "base-model"
    base.mkdir()
    for f in cached_tiny_model("llama").iterdir():
        if f.is_file() and f.name != "chat_template.jinja":
            shutil.copy(f, base / f.name)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    result, record, nb = run_recipe("tiny_4gb", "colab", tmp_path / "out", ("model_id", str(base)),
                                    ("dataset", str(sample_data_path("sharegpt"))), ("chat_template", "chatml"),
                                    ("report_to", "tensorboard"), ("max_steps", "4"))
    assert record["status"] == "ok", record.get("error")
    text = text_of(nb)
    assert "ShareGPT rows (`conversations` of from/value turns) read as `messages`" in text
    assert "Data audit:" in text and "(messages)" in text and "assistant turns only" in text
    assert record["training"]["steps"] == 4 and record["training"]["eval_losses"]
    folder = tmp_path / "out" / "runs" / "colab" / "tiny-4gb" / "reports" / "tensorboard"
    assert f"Logging to tensorboard: {folder}" in text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4]
    adapter_template = (tmp_path / "out" / "runs" / "colab" / "tiny-4gb" / "adapter" / "chat_template.jinja")
    from freetune.templates import TEMPLATES

    assert adapter_template.read_text() == TEMPLATES["chatml"].jinja()  # what the sanity check and export read


# -------------------------------------------------- a recipe is one file (issue 48)

def test_a_fourth_recipe_is_one_file_that_builds_checks_and_runs(tmp_path):
    """A new recipe: one file (its header declares the README row and what --embedded runs it on; its parameters
    cell the task), built, checked and run headless: ~3 min on 2 shared cores (~100 s of CPU; 4 steps, tiny Qwen2)."""
    import subprocess
    import sys

    from conftest import REPO

    source = (REPO / "recipes" / "tiny_4gb.py").read_text()
    recipe = (source.replace("# # Tiny 4 GB: fine-tune TinyLlama-1.1B-Chat on a 4 GB card", "# # Echo: a fourth recipe")
              .replace('run_name: str = "tiny-4gb"', 'run_name: str = "echo"')
              .replace("embedded: {architecture: llama, sample: alpaca}",
                       "embedded: {architecture: qwen2, sample: svg}")
              .replace('task: str = ""', 'task: str = "svg"'))
    assert recipe.count("echo") == 1 and "sample: svg" in recipe and 'task: str = "svg"' in recipe
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "echo.py").write_text(recipe)
    build = [sys.executable, str(REPO / "build_notebooks.py"), "--recipes", str(tmp_path / "recipes"),
             "--notebooks", str(tmp_path / "notebooks")]
    subprocess.run(build, check=True, capture_output=True, text=True)
    checked = subprocess.run([*build, "--check"], capture_output=True, text=True)
    assert checked.returncode == 0 and "2 files up to date" in checked.stdout, checked.stdout + checked.stderr
    notebook = tmp_path / "notebooks" / "colab" / "echo.ipynb"
    assert nbformat.read(notebook, as_version=4).metadata["freetune"]["embedded"] == {"architecture": "qwen2",
                                                                                      "sample": "svg"}
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "run_recipe.py"), str(notebook), "--embedded",
                           "--out", str(out), "-p", "max_steps", "4"], capture_output=True, text=True, timeout=900)
    record = json.loads((out / "echo-colab.json").read_text())
    assert done.returncode == 0 and record["status"] == "ok", (record.get("error"), done.stderr[-2000:])
    assert record["training"]["steps"] == 4
    executed = nbformat.read(out / "echo-colab.ipynb", as_version=4)
    assert "RunConfig.from_cell(globals(), recipe='echo', target='colab')" in executed.cells[
        next(i for i, c in enumerate(executed.cells) if "run" in c.metadata.get("tags", []))].source
    assert "svg" in text_of(executed)  # the svg task's checks ran in the audit and the evaluation
