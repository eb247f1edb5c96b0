"""DDP scaling on one host: the same Kaggle notebook, the same model and data, on 1 GPU and then on N GPUs.

    python scripts/ddp_scaling.py --recipe home_assistant --shape qwen2.5-0.5b --gpus 2 --out runs/ddp

Builds a model of a public shape locally (random weights, Qwen's real tokenizer), runs
notebooks/kaggle/<recipe>.ipynb through scripts/run_recipe.py with ddp_processes=1 and then =N (torchrun,
NCCL on GPUs), and prints steps/s, tokens/s and the scaling efficiency (N-GPU tokens/s / (N x 1-GPU tokens/s)).
Each process keeps its per-GPU batch, so N GPUs see N times the rows per step: that is data parallelism.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Public config values (hidden, intermediate, layers, heads, kv heads).
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipe", default="home_assistant")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--micro-batch", type=int, default=1)
    parser.add_argument("--grad-accum", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--out", default="runs/ddp-scaling")
    parser.add_argument("--run-timeout", type=int, default=900, help="seconds per notebook run")
    args = parser.parse_args()

    from freetune.fixtures import build_tiny_model, cached_tiny_model, fixture_cache_dir, sample_data_path

    cached_tiny_model("qwen2")  # builds the tokenizer once
    out = Path(args.out).resolve()
    model_dir = out / f"model-{args.shape}"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir, architecture="qwen2", tokenizer_dir=fixture_cache_dir() / "qwen-tokenizer",
                         **SHAPES[args.shape])
    sample = {"home_assistant": "home_assistant", "svg_coder": "svg", "tiny_4gb": "alpaca"}[args.recipe]
    results = {}
    for procs in (1, args.gpus):
        run_out = out / f"{procs}gpu"
        params = {"model_id": str(model_dir), "dataset": str(sample_data_path(sample)), "ddp_processes": procs,
                  "max_steps": args.steps, "micro_batch": args.micro_batch, "grad_accum": args.grad_accum,
                  "max_length": args.max_length, "logging_steps": 1, "save_steps": 1000, "eval_rows": 4,
                  "eval_steps": 0,  # tokens/s of the training steps alone
                  "sanity_rows": 1, "max_new_tokens": 16, "output_dir": str(run_out / "runs")}
        cmd = [sys.executable, str(ROOT / "scripts" / "run_recipe.py"), args.recipe, "--target", "kaggle",
               "--out", str(run_out)]
        for name, value in params.items():
            cmd += ["-p", name, json.dumps(value) if not isinstance(value, str) else value]
        print("$", " ".join(cmd[1:]), flush=True)
        try:  # only the training summary counts here: the evaluation cells after it may be cut short
            subprocess.run(cmd, timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            print(f"{procs}-GPU notebook stopped after {args.run_timeout} s; reading its training summary")
        summaries = list((run_out / "runs").glob("*/reports/run_summary.json"))
        if not summaries:
            raise SystemExit(f"the {procs}-GPU run wrote no training summary: see {run_out}")
        results[procs] = json.loads(summaries[0].read_text())
    one, many = results[1], results[args.gpus]
    rows = []
    for procs, t in ((1, one), (args.gpus, many)):
        rows.append({"gpus": procs, "steps": t["steps"], "wall_s": t["wall_s"],
                     "steps_per_s": round(t["steps"] / t["wall_s"], 4), "tokens": t["tokens"],
                     "tokens_per_s": t["tokens_per_s"], "peak_gib_rank0": t["peak_memory_gib"]})
    efficiency = many["tokens_per_s"] / (args.gpus * one["tokens_per_s"])
    print(f"\nDDP scaling, {args.shape} shape, NF4 + LoRA r16 all-linear, per-GPU batch {args.micro_batch} x "
          f"{args.grad_accum}, max_length {args.max_length}, {args.steps} steps (wall time includes warm-up)")
    print(f"{'GPUs':>5} {'steps/s':>9} {'tokens/s':>10} {'peak GiB':>9}")
    for row in rows:
        print(f"{row['gpus']:>5} {row['steps_per_s']:>9.3f} {row['tokens_per_s']:>10.0f} {row['peak_gib_rank0']:>9.2f}")
    print(f"scaling efficiency: {efficiency:.1%}")
    (out / "ddp_scaling.json").write_text(json.dumps({"rows": rows, "efficiency": efficiency,
                                                       "shape": args.shape}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
