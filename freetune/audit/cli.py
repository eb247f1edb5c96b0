"""`python -m freetune.audit DATASET ...`: audit a data set from the command line (see freetune.audit)."""

from __future__ import annotations

import json

from freetune.audit.findings import Check
from freetune.audit.run import audit
from freetune.errors import FreetuneError


def resolve_checks(name: str) -> dict[str, Check]:
    """A task's AUDIT_CHECKS by task name ("svg", "home_assistant"), imported only when asked for."""
    import importlib

    module_name = f"freetune.tasks.{name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name not in (module_name, "freetune.tasks"):
            raise
        raise FreetuneError(f"No checks named {name!r}: freetune has no module {module_name}. Use --checks svg or "
                            f"--checks home_assistant, or leave --checks out.") from exc
    checks = getattr(module, "AUDIT_CHECKS", None)
    if not isinstance(checks, dict):
        raise FreetuneError(f"{module_name} defines no AUDIT_CHECKS dict, so there is nothing to check. Leave "
                            f"--checks out, or add AUDIT_CHECKS to that module.")
    return checks


def main(argv: list[str] | None = None) -> int:
    import argparse
    import contextlib
    import sys

    from freetune.data import load_rows, normalize

    parser = argparse.ArgumentParser(prog="python -m freetune.audit",
                                     description="Audit a training data set before fine-tuning on it.")
    parser.add_argument("dataset", help="a .jsonl/.json/.csv/.parquet file, a saved data set folder, or a hub id")
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of a table")
    parser.add_argument("--columns", help='column mapping as JSON, e.g. \'{"prompt": "instruction", '
                                          '"completion": "output"}\'')
    parser.add_argument("--split", default="train")
    parser.add_argument("--eval", dest="eval_dataset", help="an evaluation data set to check for overlap")
    parser.add_argument("--eval-split", default="test", help="its split, for a hub id (default: test)")
    parser.add_argument("--model", help="model folder or hub id whose tokenizer counts tokens")
    parser.add_argument("--max-length", type=int, help="the training max_length (needs --model)")
    parser.add_argument("--checks", help="task checks to run: svg or home_assistant")
    parser.add_argument("--strict", action="store_true", help="exit with status 2 when blocking problems remain")
    args = parser.parse_args(argv)
    if args.max_length is not None and not args.model:
        parser.error("--max-length needs --model (the tokenizer that counts the tokens)")
    try:
        columns = json.loads(args.columns) if args.columns else None
        if columns is not None and not isinstance(columns, dict):
            raise FreetuneError("--columns must be a JSON object, e.g. '{\"completion\": \"output\"}'.")
        with contextlib.redirect_stdout(sys.stderr):  # the progress lines; stdout holds the report alone
            dataset = normalize(load_rows(args.dataset, split=args.split), columns=columns)
            eval_dataset = (normalize(load_rows(args.eval_dataset, split=args.eval_split), columns=columns)
                            if args.eval_dataset else None)
            report = audit(dataset, tokenizer=args.model, max_length=args.max_length,
                           checks=resolve_checks(args.checks) if args.checks else None, eval_dataset=eval_dataset,
                           source=args.dataset)
    except json.JSONDecodeError as exc:
        print(f"error: --columns is not valid JSON ({exc}).", file=sys.stderr)
        return 1
    except FreetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else report.table())
    return 2 if args.strict and report.blocking else 0
