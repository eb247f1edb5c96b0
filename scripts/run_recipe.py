"""Run a generated notebook headless through papermill, and summarise the run as JSON.

    python scripts/run_recipe.py svg_coder --embedded              # tiny local model + bundled data, CPU is fine
    python scripts/run_recipe.py svg_coder --real-model            # a real model learns, on a CPU, in minutes
    python scripts/run_recipe.py svg_coder --target kaggle --embedded -p ddp_processes 2
    python scripts/run_recipe.py svg_coder -p max_steps 50          # the real recipe (needs a GPU and the hub)

Writes <out>/<recipe>-<target>.ipynb (the executed notebook) and <out>/<recipe>-<target>.json: status, steps,
first/last loss, wall time, peak memory, adapter path. Exits non-zero naming the failing cell and its error.
While it runs, each cell's heading (or first statement) and the notebook's printed output (the step lines, the
audit) stream to this terminal. The kernel runs in <out>; relative paths given with -p (dataset, model_id,
output_dir) are taken from the folder this command runs in.
`--embedded` builds (once, cached) a tiny model of the recipe's architecture with Qwen's real tokenizer, and
points the recipe at the sample data bundled in freetune/sample_data, with settings sized for a CPU: it shows the
mechanics (random weights learn nothing). `--real-model` trains SmolLM2-135M-Instruct (built offline by
scripts/setup.sh, freetune.fixtures.cached_smollm2) on a short-row sample instead, with settings for a real model
on a CPU, so the Evaluate cell shows the base failing and the adapter doing what held-out prompts ask.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What --embedded runs a recipe on (the tiny model's architecture, the bundled sample) is declared in the recipe's
# header (`freetune: embedded:`), which the notebook carries in its metadata; the knobs sized for a CPU are here.
CPU_SIZED = {"max_steps": 8, "micro_batch": 2, "grad_accum": 1, "max_length": 256, "learning_rate": 2e-2,
             "logging_steps": 1, "save_steps": 4, "eval_rows": 8, "eval_steps": 2, "sanity_rows": 2,
             "max_new_tokens": 32}

# What --real-model runs: SmolLM2-135M-Instruct on a sample of short rows (~65 answer tokens; the bundled svg sample's
# ~160-token rows cost 2-3x the training and decoding time), at a real model's learning rate (the tiny model's 2e-2
# wipes out what SmolLM2 knows). ChatML, because SmolLM2's own template adds a default system prompt to every row.
# No system prompt and short answers: every token costs training and generation time on a CPU.
# Which recipes have such a sample, and which: the recipe's header (`freetune: real_model:`).
REAL_MODEL_CPU = {"chat_template": "chatml", "system_prompt": "", "max_steps": 24, "micro_batch": 4, "grad_accum": 1,
                  "max_length": 128, "learning_rate": 1e-3, "logging_steps": 2, "save_steps": 24, "eval_rows": 6,
                  "eval_steps": 0, "sanity_rows": 6, "max_new_tokens": 80}

# Parameters that may name a local file or folder. The kernel's working folder is --out, not the caller's.
PATH_PARAMETERS = ("dataset", "model_id", "output_dir")
# The summary line's fields from the run's run_summary.json; steps_this_session is 0 for a rerun that trained nothing.
SHOWN = ("steps", "steps_this_session", "resumed_from", "stopped_early", "first_loss", "last_loss", "peak_memory_gib",
         "adapter")


def parse_value(text: str):
    """-p values: Python/JSON literals (5, 0.1, True, {"a": 1}); anything else is a string."""
    for parse in (ast.literal_eval, json.loads):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            continue
    return text


def parse_parameters(pairs: list[tuple[str, str]], base: Path | None = None) -> dict:
    """-p NAME VALUE pairs -> values, with relative local paths made absolute against `base` (the current folder)."""
    from freetune.data import LOCAL_SUFFIXES

    base = base or Path.cwd()
    parameters = {name: parse_value(value) for name, value in pairs}
    for name in PATH_PARAMETERS:
        value = parameters.get(name)
        if not isinstance(value, str) or not value:
            continue
        if Path(value).expanduser().is_absolute():  # "~/runs" too: the summary is read back from that folder here
            parameters[name] = str(Path(value).expanduser())
            continue
        local = base / value
        # A hub id ("user/name") stays as it is unless a folder of that name is here.
        if name == "output_dir" or local.exists() or value.startswith(".") or Path(value).suffix in LOCAL_SUFFIXES:
            parameters[name] = str(local.resolve())
    return parameters


def notebook_path(recipe: str, target: str) -> Path:
    """notebooks/<target>/<recipe>.ipynb, or the notebook a path names (a recipe built elsewhere, e.g. a test's)."""
    if recipe.endswith(".ipynb"):
        return Path(recipe).resolve()
    return ROOT / "notebooks" / target / f"{recipe}.ipynb"


def declared(notebook: Path) -> dict:
    """What the recipe's header declares (embedded, real_model, readme): build_notebooks.py puts it in the notebook."""
    import nbformat

    if not notebook.exists():
        raise SystemExit(f"{notebook} does not exist: run `python build_notebooks.py` (recipes: "
                         f"{sorted(p.stem for p in (ROOT / 'recipes').glob('*.py'))})")
    return nbformat.read(notebook, as_version=4).metadata.get("freetune", {})


def sample_path(sample: str) -> str:
    """A bundled sample's name (freetune/sample_data), or a data file's path (absolute, or from the repository root)."""
    from freetune.fixtures import sample_data_path

    if Path(sample).suffix:
        return str((ROOT / sample).resolve())
    return str(sample_data_path(sample))


def embedded_parameters(recipe: str, real_model: bool = False, target: str = "colab") -> dict:
    from freetune.fixtures import cached_smollm2, cached_tiny_model

    notebook = notebook_path(recipe, target)
    kind = "real_model" if real_model else "embedded"
    spec = declared(notebook).get(kind)
    if spec is None:
        known = sorted(p.stem for p in (ROOT / "notebooks" / target).glob("*.ipynb") if kind in declared(p))
        more = (" For another recipe: --embedded -p model_id <the model's folder> -p learning_rate 1e-3"
                if real_model else "")
        raise SystemExit(f"no {kind.replace('_', '-')} default for recipe {recipe!r}; known: {known} (a recipe "
                         f"declares one in its header, under `freetune:` `{kind}:`).{more}")
    if real_model:
        return {"model_id": str(cached_smollm2()), "dataset": sample_path(spec["sample"]), **REAL_MODEL_CPU}
    model_dir = cached_tiny_model(spec["architecture"])
    return {"model_id": str(model_dir), "dataset": sample_path(spec["sample"]), **CPU_SIZED}


def failing_cell(notebook_path: Path) -> str:
    import nbformat
    from papermill.execute import remove_error_markers

    # Numbered as the progress lines number them: without the marker cells papermill adds around an error.
    nb = remove_error_markers(nbformat.read(notebook_path, as_version=4))
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                return (f"cell {index} (`{first_statement(cell)[:70]}`) failed: {output.get('ename')}: "
                        f"{output.get('evalue')}")
    return "no cell holds an error output"


def first_statement(cell) -> str:
    """A code cell's first line that is not a comment or an import (its first line if all are)."""
    lines = [line.strip() for line in cell.source.splitlines() if line.strip()]
    return next((line for line in lines if not line.startswith(("#", "import ", "from "))), lines[0] if lines else "")


def cell_line(cell, index: int) -> str | None:
    """What the terminal shows as a cell starts: a markdown heading, or a code cell's first statement."""
    if cell.cell_type == "markdown":
        heading = next((line.lstrip("#").strip() for line in cell.source.splitlines() if line.startswith("#")), None)
        return f"\n== {heading}" if heading else None
    if cell.cell_type != "code" or not cell.source.strip():
        return None
    if "injected-parameters" in cell.metadata.get("tags", []):
        from freetune.params import injected_names

        return f"-- cell {index}: the -p parameters ({', '.join(injected_names({'In': [cell.source]}))})"
    return f"-- cell {index}: {first_statement(cell)[:100]}"


def progress_engine() -> str:
    """Register papermill's own engine, announcing each cell as it starts (papermill's log_output went to a logger
    nobody configured: a long run looked dead); returns its name for execute_notebook."""
    from papermill.engines import NBClientEngine, papermill_engines

    class AnnouncingEngine(NBClientEngine):
        @classmethod
        def execute_managed_notebook(cls, nb_man, kernel_name, **kwargs):
            start = nb_man.cell_start

            def announce(cell, cell_index=None, **more):
                line = cell_line(cell, cell_index)
                if line:
                    print(line, flush=True)
                return start(cell, cell_index, **more)

            nb_man.cell_start = announce
            return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)

    papermill_engines.register("freetune-progress", AnnouncingEngine)
    return "freetune-progress"


def run(recipe: str, target: str, parameters: dict, out: Path, timeout_s: int) -> dict:
    import papermill
    from traitlets.config import Config

    from freetune.platform import PLATFORMS

    notebook = notebook_path(recipe, target)
    declared(notebook)  # it exists, or say how to build it
    recipe = notebook.stem
    out.mkdir(parents=True, exist_ok=True)
    executed = out / f"{recipe}-{target}.ipynb"
    record = {"recipe": recipe, "target": target, "executed_notebook": str(executed),
              "parameters": {k: v for k, v in parameters.items()}}
    start = time.time()
    try:
        # The notebook's printed output (the step lines, the audit, torchrun's rank 0) streams here as it comes.
        # The kernel talks over local sockets (ipc) where there are some: over TCP ipykernel warns at every start
        # that anyone could listen.
        local_sockets = {"config": Config({"KernelManager": {"transport": "ipc"}})} if os.name == "posix" else {}
        papermill.execute_notebook(str(notebook), str(executed), parameters=parameters, cwd=str(out),
                                   kernel_name="python3", progress_bar=False, engine_name=progress_engine(),
                                   stdout_file=sys.stdout, stderr_file=sys.stderr, execution_timeout=timeout_s,
                                   **local_sockets)
        record["status"] = "ok"
    except papermill.PapermillExecutionError as exc:
        record["status"] = "failed"
        record["error"] = failing_cell(executed)
        record["exception"] = f"{exc.ename}: {exc.evalue}"
    record["notebook_wall_s"] = round(time.time() - start, 1)
    # output_dir "" is the platform's default: the local one, relative to the kernel's folder (out).
    root = parameters.get("output_dir") or out / PLATFORMS["local"].work_root
    run_dir = Path(root) / parameters.get("run_name", _default(notebook))
    summary_file = run_dir / "reports" / "run_summary.json"
    if summary_file.exists():
        record["training"] = json.loads(summary_file.read_text())
    return record


def _default(notebook: Path) -> str:
    """The recipe's own run_name default (read from the notebook's parameters cell), to find the run folder."""
    import nbformat

    cells = nbformat.read(notebook, as_version=4).cells
    source = next((c.source for c in cells if "parameters" in c.metadata.get("tags", [])), "")
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "run_name":
            return ast.literal_eval(node.value)
    return notebook.stem


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe name, e.g. svg_coder, or a generated notebook's path")
    parser.add_argument("--target", choices=["colab", "kaggle"], default="colab")
    parser.add_argument("--embedded", action="store_true",
                        help="tiny local model + bundled sample data, sized for a CPU")
    parser.add_argument("--real-model", action="store_true",
                        help="as --embedded, on the real SmolLM2-135M-Instruct and short rows: it learns (minutes)")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument("--out", default="runs/headless", help="folder for the executed notebook and JSON")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one cell may run")
    args = parser.parse_args(argv)

    out = Path(args.out).resolve()
    parameters = {}
    if args.embedded or args.real_model:
        # A run folder per target: the Kaggle run after the Colab one trains a run of its own instead of resuming
        # the Colab run's last checkpoint (at max_steps: nothing left to train).
        # The real model's run has a folder of its own too: a tiny model's run there would be refused as another run.
        runs = out / "runs" / (f"{args.target}-real-model" if args.real_model else args.target)
        parameters = {**embedded_parameters(args.recipe, real_model=args.real_model, target=args.target),
                      "output_dir": str(runs)}
    parameters.update(parse_parameters(args.parameter))
    record = run(args.recipe, args.target, parameters, out, args.timeout)
    summary_path = out / f"{record['recipe']}-{args.target}.json"
    summary_path.write_text(json.dumps(record, indent=2, sort_keys=True))
    training = record.get("training", {})
    print(json.dumps({k: record[k] for k in ("recipe", "target", "status", "notebook_wall_s")} |
                     {k: training.get(k) for k in SHOWN}, indent=2))
    if record["status"] != "ok":
        print(f"FAILED: {record['error']}", file=sys.stderr)
        return 1
    print(f"executed notebook: {record['executed_notebook']}\nsummary: {summary_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
