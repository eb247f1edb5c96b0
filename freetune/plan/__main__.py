"""python -m freetune.plan: report this machine and the training plan freetune would use."""

from __future__ import annotations

import argparse
import json
import sys

from freetune.errors import FreetuneError
from freetune.plan.hardware import read_hardware
from freetune.plan.make import make_plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m freetune.plan",
                                     description="Report this machine and the training plan freetune would use.")
    parser.add_argument("--json", action="store_true", help="print the hardware and plan as JSON")
    parser.add_argument("--work-dir", default=".", help="working folder (free disk is reported for it)")
    parser.add_argument("--checkpoint-dir", default=".", help="checkpoint folder (free disk is reported for it)")
    parser.add_argument("--model-shape", default=None,
                        help="size the batch for this model: a known name (qwen2.5-1.5b, qwen2.5-coder-1.5b, "
                             "qwen3-8b, tinyllama-1.1b), a hub id of one, or a local model folder")
    parser.add_argument("--max-length", type=int, default=1024, help="tokens per row")
    parser.add_argument("--micro-batch", type=int, default=0, help="rows per forward pass (0: choose)")
    parser.add_argument("--grad-accum", type=int, default=8, help="micro-batches per optimizer step")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--precision", default="auto", choices=["auto", "fp16", "bf16"])
    parser.add_argument("--budget-gib", type=float, default=None, help="plan for this much GPU memory")
    args = parser.parse_args(argv)

    hardware = read_hardware(args.work_dir, args.checkpoint_dir)
    try:
        plan = make_plan(hardware, model_shape=args.model_shape, max_length=args.max_length,
                         micro_batch=args.micro_batch, grad_accum=args.grad_accum, lora_rank=args.lora_rank,
                         precision=args.precision, memory_budget_gib=args.budget_gib)
    except FreetuneError as exc:
        if args.json:
            print(json.dumps({"hardware": hardware.to_dict(), "error": str(exc)}, indent=2))
        print(f"preflight refused: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"hardware": hardware.to_dict(), "plan": plan.to_dict()}, indent=2))
    else:
        print(hardware.report())
        print()
        print(plan.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
