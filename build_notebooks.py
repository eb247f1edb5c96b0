"""Build every recipe x target (colab, kaggle) into notebooks/<target>/<recipe>.ipynb through jupytext.

    python build_notebooks.py           # (re)write the notebooks
    python build_notebooks.py --check   # regenerate in memory; name stale files and exit 1 if any differ

The recipes (recipes/*.py, percent format) are the source of truth. The builder changes only cells the recipe
tags explicitly, using the platform table in freetune/platform.py:
  install  -> the pinned install for that platform, rendered from pyproject.toml (torch is never reinstalled)
  run      -> `recipe=None, target=None` becomes `recipe="<name>", target="<platform>"` in the cell that makes
              the run's one record (freetune.RunConfig), so the notebook knows what it was built from and for
  train    -> Colab: run inline. Kaggle: collected into one `%%writefile train_ddp.py` cell (the code exists
              once, in the recipe), followed by a cell that saves the run (RunConfig, the job file the script
              reads) and launches torchrun; the section's prose (from its heading on) becomes one cell above them.
  colab, kaggle -> the cell is in that target's notebook only (say what holds there: its GPU, its menus).
Around the recipe's cells: the first cell is the recipe's opening prose with "Open in Colab" / "Open in Kaggle"
badges and what to set before "Run all" (from the platform table); the last two are "Next steps" and, for
contributors, which recipe the notebook is generated from (also in the notebook metadata, under "freetune").
What a recipe declares besides its cells sits in its header, under `freetune:` (the README's row, what
scripts/run_recipe.py --embedded / --real-model run it on); it goes into the notebook's metadata, and the README's
recipe table is rendered from it (`--check` fails when the table differs).
Output is deterministic: no outputs, no execution counts, stable cell ids and metadata, no timestamps.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
import tomllib
from pathlib import Path

import jupytext
import nbformat

from freetune.platform import PLATFORMS  # the table lives in the library (no torch import)

ROOT = Path(__file__).resolve().parent
RECIPES = ROOT / "recipes"
NOTEBOOKS = ROOT / "notebooks"
TARGETS = ("colab", "kaggle")

KERNELSPEC = {"name": "python3", "display_name": "Python 3", "language": "python"}
MAX_PARAMETER_LINE = 100  # the parameters cell is read without scrolling sideways
RUN_SLOTS = "recipe=None, target=None"  # what the builder fills in the cell tagged `run`
README = ROOT / "README.md"
TABLE_START = "<!-- recipes table: rendered by build_notebooks.py from each recipe's header -->"
TABLE_END = "<!-- end of recipes table -->"


@functools.cache
def project_meta() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pinned_requirements() -> list[str]:
    """The libraries a notebook installs: the train and tasks extras, minus torch (the platform's CUDA build)."""
    extras = project_meta()["optional-dependencies"]
    return [req for req in extras["train"] + extras["tasks"] if not req.replace(" ", "").startswith("torch")]


def render_install(target: str) -> str:
    repo = repo_url()
    pins = ",\n    ".join(f'"{req}"' for req in pinned_requirements())
    platform = PLATFORMS[target]
    return f'''# Install freetune and the library versions it was tested with (rendered from pyproject.toml).
# Does nothing when freetune is already importable (CI, local runs). torch is never reinstalled: {platform.name}'s
# own CUDA build stays. freetune itself goes in with --no-deps so pip cannot swap torch underneath, at the release
# this notebook was generated from ({release_tag()}), not whatever main holds the day it runs.
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("freetune") is None:
    PINNED = [
    {pins},
    ]
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", *PINNED])
    subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                           "freetune @ git+{repo}@{release_tag()}"])
    importlib.invalidate_caches()
import freetune  # noqa: E402
print("freetune", freetune.__version__)'''


def parameter_names(source: str) -> list[str]:
    """Names declared in the parameters cell, in order (`name: type = value  # help`)."""
    names = []
    for line in source.splitlines():
        if len(line) > MAX_PARAMETER_LINE:
            raise SystemExit(f"parameters cell: {line.strip()[:60]!r}... is {len(line)} characters long; keep "
                             f"lines within {MAX_PARAMETER_LINE} (papermill reads a parameter's help from its own "
                             f"line: shorten the help, and explain more in a comment line above it)")
        # papermill skips any parameter line with two '=' signs (e.g. "0 = auto" in the help comment), and
        # then `papermill --help-notebook` cannot show it and warns on injection.
        if not line.lstrip().startswith("#") and line.count("=") > 1:
            raise SystemExit(f"parameters cell: {line.strip()!r} has more than one '=': papermill cannot parse "
                             f"it; write the help comment without '='")
    for node in ast.parse(source).body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None):
            raise SystemExit(f"parameters cell: every line must be `name: type = literal  # help`, "
                             f"got {ast.unparse(node)!r}")
        try:  # literals only: papermill injects new values after this cell, so derived values would go stale
            ast.literal_eval(node.value)
        except ValueError:
            raise SystemExit(f"parameters cell: {node.target.id} must be a literal, got "
                             f"{ast.unparse(node.value)!r}; compute derived values in a later cell") from None
        names.append(node.target.id)
    return names


def _code(source: str, tags=()) -> nbformat.NotebookNode:
    cell = nbformat.v4.new_code_cell(source)
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def _markdown(source: str) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell(source)


def release_tag() -> str:
    """The git tag of the freetune release the notebooks are generated from: v<version> (docs/releasing.md)."""
    return f"v{project_meta()['version']}"


def repo_url() -> str:
    return project_meta()["urls"]["Repository"]


def notebook_url(name: str, target: str) -> str:
    return f"{repo_url()}/blob/main/notebooks/{target}/{name}.ipynb"


def badge(name: str, target: str) -> str:
    """The "Open in Colab" or "Open in Kaggle" badge of a recipe's notebook (its first cell, and the README's table).
    Kaggle's import link takes the notebook's URL only; the notebook's metadata asks for the T4 x2 accelerator."""
    url = notebook_url(name, target)
    if target == "colab":
        link = url.replace("https://github.com/", "https://colab.research.google.com/github/")
        return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({link})"
    return (f"[![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]"
            f"(https://kaggle.com/kernels/welcome?src={url})")


def intro_cell(name: str, target: str, prose: list[str]) -> nbformat.NotebookNode:
    """The recipe's opening prose, its title first, then the badges; last, what to set before "Run all"."""
    title, _, rest = "\n\n".join(prose).partition("\n")
    links = " ".join(badge(name, t) for t in TARGETS)
    return _markdown(f"{title}\n\n{links}\n{rest}\n\n{PLATFORMS[target].before_run}")


def next_steps_cell(name: str, target: str) -> nbformat.NotebookNode:
    return _markdown(
        "## Next steps\n"
        "- **Try the adapter:** it is in the run folder printed above (`run.paths.adapter`); the Evaluate cells "
        "compare it with the base model on held-out prompts.\n"
        "- **Export for llama.cpp / Ollama:** set `export_gguf = True` and run all again. Training is not repeated: "
        "the run resumes at its last step.\n"
        f"- **Push to the Hub:** set `hub_repo = \"you/{name.replace('_', '-')}\"` and add your token to "
        f"{PLATFORMS[target].secrets}.\n"
        "- **Train longer, or resume after a lost session:** run all again with the same `run_name` (raise "
        "`max_steps` to go further); a new `run_name` starts fresh. " + PLATFORMS[target].keeps_runs)


def generated_from_cell(name: str, target: str) -> nbformat.NotebookNode:
    return _markdown(f"<!-- generated from recipes/{name}.py by build_notebooks.py: edit that file, not this "
                     f"notebook -->\n*For contributors: this notebook is generated from "
                     f"[`recipes/{name}.py`]({repo_url()}/blob/main/recipes/{name}.py) for **{target}** "
                     f"({PLATFORMS[target].gpus}); edit that file, then run `python build_notebooks.py`.*")


def kaggle_train_cells(recipe_name: str, train_sources: list[str], prose: list[str]) -> list:
    header = (f"# Generated from recipes/{recipe_name}.py by build_notebooks.py: edit the recipe, not this cell.\n"
              "# torchrun starts this script once per GPU; each reads the run the notebook saved (parameters,\n"
              "# folders, plan): the same record the notebook's cells read.\n"
              "import sys\n\nimport freetune\n\n"
              "run = freetune.RunConfig.load(sys.argv[1])\n")
    body = "\n\n".join(src.strip() for src in train_sources)
    script = f"%%writefile train_ddp.py\n{header}\n{body}\n"
    launch = ("# Generated: run the training cells above on every visible GPU, one process each (DDP).\n"
              "job_file = run.save(f\"{run.paths.run_dir}/train_ddp.json\")  # the run, for the script to read\n"
              "freetune.launch.run_torchrun(\"train_ddp.py\", job_file, nproc=run.ddp_processes)")
    explain = ("## Model and training: one script on every GPU\n"
               "Kaggle runs the training cells as a script on both GPUs. The cell below writes them to "
               "`train_ddp.py`; the next one launches it with `torchrun --standalone --nproc_per_node=<GPUs>`, "
               "streams rank 0's log here and fails with the failing rank's error if any rank fails.")
    return [_markdown("\n\n".join([explain, *map(_lead_in, prose)])), _code(script, ["train-script"]),
            _code(launch, ["launch"])]


def _lead_in(markdown: str) -> str:
    """'## Model\\ntext' -> '**Model.** text': a section heading of the recipe, as a paragraph of the Kaggle cell."""
    first, _, rest = markdown.partition("\n")
    return f"**{first[3:].strip()}.** {rest.strip()}" if first.startswith("## ") else markdown


def _for_target(cells: list, target: str) -> list:
    """The recipe's cells for this target: a cell tagged with a target is left out of the others' notebooks."""
    kept = []
    for cell in cells:
        tags = list(cell.metadata.get("tags", []))
        only = [t for t in tags if t in TARGETS]
        if only and target not in only:
            continue
        if only:
            cell.metadata["tags"] = [t for t in tags if t not in TARGETS]
        kept.append(cell)
    return kept


def _section_prose(cells: list) -> list:
    """Pop the markdown cells at the end of `cells` from the last section heading on (the training section's prose,
    which the Kaggle notebook shows in one cell above the script)."""
    start = len(cells)
    while start and cells[start - 1].cell_type == "markdown":
        start -= 1
    headings = [i for i in range(start, len(cells)) if cells[i].source.startswith("## ")]
    start = headings[-1] if headings else len(cells)
    prose = [c.source for c in cells[start:]]
    del cells[start:]
    return prose


def render(recipe: Path, target: str) -> nbformat.NotebookNode:
    source_nb = jupytext.read(recipe, fmt="py:percent")
    platform = PLATFORMS[target]
    name = recipe.stem
    recipe_cells = _for_target(source_nb.cells, target)
    opening = []
    while recipe_cells and recipe_cells[0].cell_type == "markdown":
        opening.append(recipe_cells.pop(0).source)
    cells = [intro_cell(name, target, opening)]
    names: list[str] = []
    train_sources: list[str] = []
    prose: list[str] = []  # Kaggle: the training section's prose, shown above its script
    train_done = False
    for cell in recipe_cells:
        tags = list(cell.metadata.get("tags", []))
        if cell.cell_type == "markdown":
            if platform.launches_ddp and train_sources and not train_done:
                prose.append(cell.source)  # on Kaggle, shown above the script that holds the section's code
            else:
                cells.append(_markdown(cell.source))
            continue
        if "parameters" in tags:
            names = parameter_names(cell.source)
            cells.append(_code(cell.source, ["parameters"]))
        elif "install" in tags:
            cells.append(_code(render_install(target), ["install"]))
        elif "run" in tags:
            if RUN_SLOTS not in cell.source:
                raise SystemExit(f"{recipe}: the cell tagged `run` must call "
                                 f"freetune.RunConfig.from_cell(globals(), {RUN_SLOTS})")
            filled = cell.source.replace(RUN_SLOTS, f"recipe={name!r}, target={target!r}")
            cells.append(_code(filled.replace(" build_notebooks.py fills in recipe and target.", ""), ["run"]))
        elif "train" in tags and platform.launches_ddp:
            if not train_sources:
                prose = _section_prose(cells)
            train_sources.append(cell.source)
        else:
            if train_sources and not train_done and platform.launches_ddp:
                cells += kaggle_train_cells(name, train_sources, prose)
                train_done = True
            cells.append(_code(cell.source, tags))
    if train_sources and not train_done:
        cells += kaggle_train_cells(name, train_sources, prose)
    if not names:
        raise SystemExit(f"{recipe}: no cell is tagged `parameters` (the first code cell must be)")
    cells += [next_steps_cell(name, target), generated_from_cell(name, target)]

    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata = {"kernelspec": KERNELSPEC, "language_info": {"name": "python"}, **platform.metadata,
                   "freetune": {"generated_from": f"recipes/{name}.py", "target": target,
                                "edit": "the recipe, then run `python build_notebooks.py`; not this notebook",
                                **source_nb.metadata.get("freetune", {})}}
    for index, cell in enumerate(nb.cells):
        cell.id = f"{name.replace('_', '-')}-{index:02d}"
    nbformat.validate(nb)
    return nb


def declared(recipe: Path) -> dict:
    """What a recipe declares besides its cells: its header's `freetune:` block (readme, embedded, real_model)."""
    return dict(jupytext.read(recipe, fmt="py:percent").metadata.get("freetune", {}))


def _default(recipe: Path, name: str):
    source = next(c.source for c in jupytext.read(recipe, fmt="py:percent").cells
                  if "parameters" in c.metadata.get("tags", []))
    return next(ast.literal_eval(node.value) for node in ast.parse(source).body
                if isinstance(node, ast.AnnAssign) and node.target.id == name)


def readme_table(recipes: Path = RECIPES) -> str:
    """The README's table of recipes: one row per recipe (in the order of their `row:`), from its header's `readme:`
    and its parameters' defaults."""
    rows = [TABLE_START, "| recipe | model | data | GPU | VRAM | time (defaults) | Colab | Kaggle |",
            "|---|---|---|---|---|---|---|---|"]
    by_row = sorted(recipes.glob("*.py"), key=lambda r: (declared(r).get("readme", {}).get("row", 99), r.stem))
    for recipe in by_row:
        row = declared(recipe).get("readme")
        if row is None:
            raise SystemExit(f"{recipe}: its header has no `freetune: readme:` (model, gpu, vram, time) for the "
                             f"README's table")
        name = recipe.stem
        rows.append(f"| [{name}](recipes/{name}.py) | {row['model']} | {_default(recipe, 'dataset')} | {row['gpu']} "
                    f"| {row['vram']} | {row['time']} | {badge(name, 'colab')} | {badge(name, 'kaggle')} |")
    return "\n".join([*rows, TABLE_END])


def readme_with_table(readme: str, table: str) -> str:
    if TABLE_START not in readme or TABLE_END not in readme:
        raise SystemExit(f"README.md has lost its table markers ({TABLE_START!r} ... {TABLE_END!r})")
    before, rest = readme.split(TABLE_START, 1)
    return before + table + rest.split(TABLE_END, 1)[1]


def expected_files(recipes: Path = RECIPES, notebooks: Path = NOTEBOOKS) -> dict[Path, str]:
    files = {}
    for recipe in sorted(recipes.glob("*.py")):
        for target in TARGETS:
            files[notebooks / target / f"{recipe.stem}.ipynb"] = nbformat.writes(render(recipe, target)) + "\n"
    if recipes == RECIPES:  # the repository's own recipes: the README's table is theirs
        files[README] = readme_with_table(README.read_text(), readme_table(recipes))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail (exit 1) if any notebook is out of date")
    parser.add_argument("--recipes", type=Path, default=RECIPES, help="folder of recipes (default: recipes/)")
    parser.add_argument("--notebooks", type=Path, default=NOTEBOOKS, help="folder to write (default: notebooks/)")
    args = parser.parse_args(argv)
    recipes, notebooks = args.recipes.resolve(), args.notebooks.resolve()
    files = expected_files(recipes, notebooks)
    shown = lambda path: path.relative_to(ROOT) if path.is_relative_to(ROOT) else path  # noqa: E731
    if args.check:
        stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
        generated = {p for p in notebooks.glob("*/*.ipynb")}
        orphans = sorted(generated - set(files))
        for path in stale:
            print(f"stale: {shown(path)} (rebuild with: python build_notebooks.py)")
        for path in orphans:
            print(f"orphan: {shown(path)} has no recipe (delete it)")
        if stale or orphans:
            return 1
        print(f"{len(files)} files up to date")
        return 0
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
