"""Run a generated notebook headless through papermill, and summarise the run as JSON.

    python scripts/run_recipe.py svg_coder --embedded              # tiny local model + bundled data, CPU is fine
    python scripts/run_recipe.py svg_coder --target kaggle --embedded -p ddp_processes 2
    python scripts/run_recipe.py svg_coder -p max_steps 50          # the real recipe (needs a GPU and the hub)

Writes <out>/<recipe>-<target>.ipynb (the executed notebook) and <out>/<recipe>-<target>.json: status, steps,
first/last loss, wall time, peak memory, adapter path. Exits non-zero naming the failing cell and its error.
`--embedded` builds (once, cached) a tiny model of the recipe's architecture with Qwen's real tokenizer, and
points the recipe at the sample data bundled in freetune/sample_data, with settings sized for a CPU.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# What --embedded runs each recipe on: the tiny model's architecture, the bundled sample, and CPU-sized knobs.
EMBEDDED = {
    "svg_coder": {"architecture": "qwen2", "sample": "svg"},
    "home_assistant": {"architecture": "qwen3", "sample": "home_assistant"},
    "tiny_4gb": {"architecture": "llama", "sample": "alpaca"},
}
CPU_SIZED = {"max_steps": 8, "micro_batch": 2, "grad_accum": 1, "max_length": 256, "learning_rate": 2e-2,
             "logging_steps": 1, "save_steps": 4, "eval_rows": 8, "eval_steps": 2, "sanity_rows": 2,
             "max_new_tokens": 32}


def parse_value(text: str):
    """-p values: Python/JSON literals (5, 0.1, True, {"a": 1}); anything else is a string."""
    for parse in (ast.literal_eval, json.loads):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            continue
    return text


def embedded_parameters(recipe: str) -> dict:
    from freetune.fixtures import cached_tiny_model, sample_data_path

    spec = EMBEDDED.get(recipe)
    if spec is None:
        raise SystemExit(f"no embedded default for recipe {recipe!r}; known: {sorted(EMBEDDED)}")
    model_dir = cached_tiny_model(spec["architecture"])
    return {"model_id": str(model_dir), "dataset": str(sample_data_path(spec["sample"])), **CPU_SIZED}


def failing_cell(notebook_path: Path) -> str:
    import nbformat

    nb = nbformat.read(notebook_path, as_version=4)
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                first_line = cell.source.strip().splitlines()[0] if cell.source.strip() else ""
                return (f"cell {index} (`{first_line[:70]}`) failed: {output.get('ename')}: "
                        f"{output.get('evalue')}")
    return "no cell holds an error output"


def run(recipe: str, target: str, parameters: dict, out: Path, timeout_s: int) -> dict:
    import papermill

    notebook = ROOT / "notebooks" / target / f"{recipe}.ipynb"
    if not notebook.exists():
        raise SystemExit(f"{notebook} does not exist: run `python build_notebooks.py` (recipes: "
                         f"{sorted(p.stem for p in (ROOT / 'recipes').glob('*.py'))})")
    out.mkdir(parents=True, exist_ok=True)
    executed = out / f"{recipe}-{target}.ipynb"
    record = {"recipe": recipe, "target": target, "executed_notebook": str(executed),
              "parameters": {k: v for k, v in parameters.items()}}
    start = time.time()
    try:
        papermill.execute_notebook(str(notebook), str(executed), parameters=parameters, cwd=str(out),
                                   kernel_name="python3", progress_bar=False, log_output=True,
                                   execution_timeout=timeout_s)
        record["status"] = "ok"
    except papermill.PapermillExecutionError as exc:
        record["status"] = "failed"
        record["error"] = failing_cell(executed)
        record["exception"] = f"{exc.ename}: {exc.evalue}"
    record["notebook_wall_s"] = round(time.time() - start, 1)
    run_dir = Path(parameters.get("output_dir") or out / "runs") / parameters.get("run_name", _default(recipe))
    summary_file = run_dir / "reports" / "run_summary.json"
    if summary_file.exists():
        record["training"] = json.loads(summary_file.read_text())
    return record


def _default(recipe: str) -> str:
    """The recipe's own run_name default (read from its parameters cell), to find the run folder."""
    tree = ast.parse((ROOT / "recipes" / f"{recipe}.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "run_name":
            return ast.literal_eval(node.value)
    return recipe


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="recipe name, e.g. svg_coder")
    parser.add_argument("--target", choices=["colab", "kaggle"], default="colab")
    parser.add_argument("--embedded", action="store_true",
                        help="tiny local model + bundled sample data, sized for a CPU")
    parser.add_argument("-p", "--parameter", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"))
    parser.add_argument("--out", default="runs/headless", help="folder for the executed notebook and JSON")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds one cell may run")
    args = parser.parse_args(argv)

    out = Path(args.out).resolve()
    parameters = {}
    if args.embedded:
        # A run folder per target: the Kaggle run after the Colab one trains a run of its own instead of resuming
        # the Colab run's last checkpoint (at max_steps: nothing left to train).
        parameters = {**embedded_parameters(args.recipe), "output_dir": str(out / "runs" / args.target)}
    parameters.update({name: parse_value(value) for name, value in args.parameter})
    record = run(args.recipe, args.target, parameters, out, args.timeout)
    summary_path = out / f"{args.recipe}-{args.target}.json"
    summary_path.write_text(json.dumps(record, indent=2, sort_keys=True))
    training = record.get("training", {})
    print(json.dumps({k: record[k] for k in ("recipe", "target", "status", "notebook_wall_s")} |
                     {k: training.get(k) for k in ("steps", "first_loss", "last_loss", "peak_memory_gib",
                                                   "adapter")}, indent=2))
    if record["status"] != "ok":
        print(f"FAILED: {record['error']}", file=sys.stderr)
        return 1
    print(f"executed notebook: {record['executed_notebook']}\nsummary: {summary_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
