"""The builder: recipes x targets -> notebooks, deterministic, with the platform table applied to tagged cells."""

import ast
import json
import re
import shutil
import subprocess
import sys

import jupytext
import nbformat
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO))
import build_notebooks  # noqa: E402
from freetune.platform import PLATFORMS  # noqa: E402

RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.py"))


def test_committed_notebooks_are_up_to_date():
    result = subprocess.run([sys.executable, "build_notebooks.py", "--check"], cwd=REPO, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_package_and_pyproject_carry_one_version():
    """freetune.__version__ is what the notebooks print; pyproject's version names the tag they install."""
    import freetune

    assert freetune.__version__ == build_notebooks.project_meta()["version"]


def test_check_fails_and_names_the_stale_notebook_after_a_recipe_edit(tmp_path):
    for item in ("build_notebooks.py", "pyproject.toml", "README.md", "recipes", "notebooks", "freetune"):
        source = REPO / item
        (shutil.copytree if source.is_dir() else shutil.copy)(source, tmp_path / item)
    recipe = tmp_path / "recipes" / "svg_coder.py"
    recipe.write_text(recipe.read_text().replace("max_steps: int = 300", "max_steps: int = 301"))
    result = subprocess.run([sys.executable, "build_notebooks.py", "--check"], cwd=tmp_path, capture_output=True,
                            text=True)
    assert result.returncode == 1
    assert "stale: notebooks/colab/svg_coder.ipynb" in result.stdout
    assert "stale: notebooks/kaggle/svg_coder.ipynb" in result.stdout
    # Rebuilding fixes it.
    subprocess.run([sys.executable, "build_notebooks.py"], cwd=tmp_path, check=True, capture_output=True)
    again = subprocess.run([sys.executable, "build_notebooks.py", "--check"], cwd=tmp_path, capture_output=True,
                           text=True)
    assert again.returncode == 0, again.stdout


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("target", build_notebooks.TARGETS)
def test_notebook_shape(recipe, target):
    nb = build_notebooks.render(REPO / "recipes" / f"{recipe}.py", target)
    text = nbformat.writes(nb)
    assert text == nbformat.writes(build_notebooks.render(REPO / "recipes" / f"{recipe}.py", target))
    # The first cell speaks to the user: title, both one-click badges, what to set on this platform; the note for
    # contributors is the last cell and the notebook's metadata.
    first = nb.cells[0].source
    assert first.startswith("# ") and "generated from" not in first.lower()
    assert all(build_notebooks.badge(recipe, t) in first for t in build_notebooks.TARGETS)
    assert PLATFORMS[target].before_run in first
    assert nb.metadata["freetune"]["generated_from"] == f"recipes/{recipe}.py"
    assert f"generated from recipes/{recipe}.py" in nb.cells[-1].source
    assert nb.cells[-2].source.startswith("## Next steps") and "export_gguf" in nb.cells[-2].source
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].metadata["tags"] == ["parameters"], "the parameters cell must be the first code cell"
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in code)
    install = next(c for c in code if "install" in c.metadata.get("tags", []))
    assert "find_spec(\"freetune\") is None" in install.source
    assert "transformers==5.17.0" in install.source and "trl==1.16.0" in install.source
    assert '"torch' not in install.source, "the install cell must never reinstall the platform's torch"
    assert "--no-deps" in install.source and "git+https://github.com/" in install.source
    version = build_notebooks.project_meta()["version"]
    assert f'@v{version}"' in install.source and "@main" not in install.source, \
        "the install cell must install the release the notebook was generated from, not whatever main holds"
    run_cell = next(c for c in code if "run" in c.metadata.get("tags", []))
    assert f"RunConfig.from_cell(globals(), recipe={recipe!r}, target={target!r})" in run_cell.source
    if target == "colab":
        assert nb.metadata["accelerator"] == "GPU" and nb.metadata["colab"]["gpuType"] == "T4"
    else:
        assert nb.metadata["kaggle"]["accelerator"] == "nvidiaTeslaT4"
        assert nb.metadata["kaggle"]["isInternetEnabled"] is True


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("target", build_notebooks.TARGETS)
def test_every_heading_has_a_cell_of_its_own_below_it(recipe, target):
    nb = build_notebooks.render(REPO / "recipes" / f"{recipe}.py", target)
    for cell, below in zip(nb.cells, nb.cells[1:]):
        if cell.cell_type == "markdown" and cell.source.startswith("## "):
            assert not (below.cell_type == "markdown" and below.source.startswith("## ")), cell.source[:40]


def markdown_of(recipe, target) -> str:
    nb = build_notebooks.render(REPO / "recipes" / f"{recipe}.py", target)
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_target_s_notebook_says_what_holds_there(recipe):
    colab, kaggle = markdown_of(recipe, "colab"), markdown_of(recipe, "kaggle")
    assert "Runtime -> Change runtime type -> **T4 GPU**" in colab and "GPU T4 x2" not in colab
    assert "torchrun" not in colab and "device_map" not in colab  # nothing about DDP on one GPU
    assert "**GPU T4 x2**" in kaggle and "Internet **on**" in kaggle and "torchrun" in kaggle
    assert "Kaggle's two T4s" not in colab.splitlines()[0]
    # The examples name this recipe, not another one.
    params = next(c.source for c in jupytext.read(REPO / "recipes" / f"{recipe}.py").cells
                  if "parameters" in c.metadata.get("tags", []))
    run_name = ast.literal_eval(re.search(r"^run_name: str = (.+?)  #", params, re.M).group(1))
    assert re.findall(r'"you/([\w-]+)"', params) == [run_name]
    assert f'hub_repo = "you/{run_name}"' in colab and f'hub_repo = "you/{run_name}"' in kaggle


def test_a_recipe_can_have_cells_for_one_target_only():
    source = REPO / "recipes" / "home_assistant.py"
    colab, kaggle = (build_notebooks.render(source, t) for t in build_notebooks.TARGETS)
    assert "Why DDP" not in "".join(c.source for c in colab.cells)
    assert "Why DDP" in "".join(c.source for c in kaggle.cells)
    assert all(t not in build_notebooks.TARGETS for nb in (colab, kaggle) for c in nb.cells
               for t in c.metadata.get("tags", []))  # the target tags are the builder's, not the notebook's


def test_the_readme_table_has_both_badges_of_every_recipe():
    readme = (REPO / "README.md").read_text()
    for recipe in RECIPES:
        row = next(line for line in readme.splitlines() if line.startswith(f"| [{recipe}]"))
        assert all(build_notebooks.badge(recipe, t) in row for t in build_notebooks.TARGETS), row


@pytest.mark.parametrize("recipe", RECIPES)
def test_kaggle_training_code_exists_once_in_the_recipe(recipe):
    import jupytext

    source = jupytext.read(REPO / "recipes" / f"{recipe}.py")
    train_cells = [c.source.strip() for c in source.cells if "train" in c.metadata.get("tags", [])]
    assert train_cells, "a recipe tags its training cells `train`"
    kaggle = build_notebooks.render(REPO / "recipes" / f"{recipe}.py", "kaggle")
    colab = build_notebooks.render(REPO / "recipes" / f"{recipe}.py", "colab")
    script = next(c.source for c in kaggle.cells if c.source.startswith("%%writefile train_ddp.py"))
    for cell in train_cells:
        assert cell in script  # the script is made of the recipe's own cells
        assert not any(c.source.strip() == cell for c in kaggle.cells)  # ...and they do not also run inline
        assert any(c.source.strip() == cell for c in colab.cells)  # Colab runs them inline
    # One channel: the notebook saves its run (parameters, folders, plan), each rank reads it; no names copied.
    launch = next(c.source for c in kaggle.cells if "run_torchrun" in c.source)
    assert "job_file = run.save(" in launch and "nproc=run.ddp_processes" in launch
    assert "run = freetune.RunConfig.load(sys.argv[1])" in script and "globals()" not in script


def test_parameters_cell_must_hold_literals(tmp_path):
    with pytest.raises(SystemExit, match="literal"):
        build_notebooks.parameter_names("steps: int = 10\ntotal: int = steps * 2  # derived\n")
    with pytest.raises(SystemExit, match="name: type = literal"):
        build_notebooks.parameter_names("import os\n")


@pytest.mark.parametrize("recipe", RECIPES)
def test_papermill_reads_every_parameter_with_type_default_and_help(recipe, caplog):
    import papermill

    path = REPO / "notebooks" / "kaggle" / f"{recipe}.ipynb"  # what `papermill --help-notebook` reads
    nb = build_notebooks.render(REPO / "recipes" / f"{recipe}.py", "kaggle")
    source = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    inferred = papermill.inspect_notebook(str(path))
    assert list(inferred) == build_notebooks.parameter_names(source)
    assert "Unable to parse" not in caplog.text
    for parameter in inferred.values():
        assert parameter["inferred_type_name"] != "None" and parameter["default"] and parameter["help"]


def test_a_help_comment_with_an_equals_sign_is_refused():
    with pytest.raises(SystemExit, match="more than one '='"):
        build_notebooks.parameter_names("steps: int = 0  # 0 = auto\n")


def test_a_parameters_line_over_100_characters_is_refused():
    line = "steps: int = 0  # " + "x" * 82
    assert build_notebooks.parameter_names(line) == ["steps"] and len(line) == 100
    with pytest.raises(SystemExit, match="101 characters long"):
        build_notebooks.parameter_names(line + "x")


@pytest.mark.parametrize("recipe", RECIPES)
def test_parameters_cell_is_grouped_under_short_headings(recipe):
    nb = build_notebooks.render(REPO / "recipes" / f"{recipe}.py", "colab")
    source = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    lines = source.splitlines()
    headings = [line[2:] for above, line in zip([""] + lines, lines) if not above and line.startswith("# ")]
    assert headings == ["Model and data", "LoRA", "Training", "Checkpoints", "Evaluation", "Export"]


def test_generated_json_is_stable_text():
    path = REPO / "notebooks" / "colab" / "svg_coder.ipynb"
    data = json.loads(path.read_text())
    assert data["nbformat"] == 4 and all("id" in c for c in data["cells"])
    assert "execution" not in json.dumps(data["metadata"]) and "papermill" not in json.dumps(data["metadata"])


NEW_PARAMETERS = {"chat_template": '"auto": the model\'s own', "eval_steps": "held-out (eval) loss every N steps",
                  "report_to": '"tensorboard" or "trackio"'}


@pytest.mark.parametrize("recipe", RECIPES)
def test_papermill_help_lists_the_chat_template_eval_and_logging_parameters(recipe):
    import subprocess
    import sys
    from pathlib import Path

    papermill = Path(sys.executable).parent / "papermill"
    done = subprocess.run([str(papermill), "--help-notebook", str(REPO / "notebooks" / "colab" / f"{recipe}.ipynb")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    help_text = " ".join(done.stdout.split())
    for name, help_words in NEW_PARAMETERS.items():
        assert f"{name}: " in help_text and help_words in help_text, (name, done.stdout)
    source = (REPO / "recipes" / f"{recipe}.py").read_text()
    for line in source.splitlines():
        if line.split(":")[0] in NEW_PARAMETERS:
            assert len(line) <= 100, line


def test_every_recipe_tells_the_same_story_in_code():
    """What varies between recipes is their prose, parameters and header; the code cells are the one story, in the
    same order (a recipe may add a cell of its own, e.g. svg_coder's side-by-side picture). A change to the story is
    made in every recipe, or the drift shows here."""
    stories = {recipe: [c.source for c in jupytext.read(REPO / "recipes" / f"{recipe}.py").cells
                        if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])]
               for recipe in RECIPES}
    shared = [cell for cell in stories[RECIPES[0]] if all(cell in story for story in stories.values())]
    assert len(shared) >= 9, shared
    for recipe, story in stories.items():
        assert [cell for cell in story if cell in shared] == shared, recipe
        own = [cell for cell in story if cell not in shared]
        assert len(own) <= 1, (recipe, own)
