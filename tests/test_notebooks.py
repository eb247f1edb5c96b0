"""The generated notebooks, executed headless by papermill exactly as a user would run them (tiny model, CPU).

Colab's notebook trains inline; Kaggle's writes train_ddp.py and runs it under real torchrun with 2 processes
on gloo. These are the slowest tests in the suite (~2-3 minutes each on 2 cores) and the most important.
"""

import json
import re

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


@pytest.mark.parametrize("recipe", ["home_assistant", "tiny_4gb"])
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
    etas = re.findall(r"ETA (.*)$", text, re.M)
    assert etas and all(re.fullmatch(DURATION, eta) for eta in etas), etas
    # The target's own wording, and nothing of the other's.
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    if target == "kaggle":
        assert re.search(rf"All 2 ranks finished in {DURATION} ", text)
        assert "**GPU T4 x2**" in markdown and "Internet **on**" in markdown
    else:
        assert "**T4 GPU**" in markdown and "torchrun" not in markdown and "T4 x2" not in markdown
