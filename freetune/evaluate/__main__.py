"""python -m freetune.evaluate: compare what a LoRA adapter generates with its base model (exit 1: collapsed)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from freetune.errors import FreetuneError
from freetune.evaluate.loading import compare, pick_rows
from freetune.tasks import TASK_NAMES


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m freetune.evaluate", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Compare what a LoRA adapter generates with its base model, and say whether it collapsed. "
                    "Exit status 1 when the adapter collapsed.")
    parser.add_argument("--base", required=True, help="base model folder or hub id the adapter was trained on")
    parser.add_argument("--adapter", required=True, help="adapter folder: the final one or a checkpoint-N")
    parser.add_argument("--data", required=True, help="data set file (.jsonl/.json/.csv/.parquet) or hub id")
    parser.add_argument("--task", choices=TASK_NAMES, help="also report this task's metrics")
    parser.add_argument("--rows", type=int, default=8, help="how many prompts, spread over the data set")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--seeds", default="0,1,2", help="sampling seeds, comma-separated ('' for greedy only)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--png", help="SVG task: also write the side-by-side renders to this PNG")
    parser.add_argument("--json", action="store_true", help="print the full report as JSON")
    args = parser.parse_args(argv)

    from freetune.data import load_rows, normalize

    try:
        with contextlib.redirect_stdout(sys.stderr):  # the progress lines; stdout holds the report alone
            rows = pick_rows(normalize(load_rows(args.data)), args.rows)
            seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
            report = compare(args.base, args.adapter, rows, task=args.task, seeds=seeds,
                             temperature=args.temperature, max_new_tokens=args.max_new_tokens)
    except FreetuneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.png:
        if args.task != "svg":
            print("warning: --png draws SVG renders; it needs --task svg", file=sys.stderr)
        else:
            from freetune.tasks.svg import side_by_side_png

            side_by_side_png(report.examples(), args.png)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.table())
    return 1 if report.collapsed else 0


if __name__ == "__main__":
    sys.exit(main())
