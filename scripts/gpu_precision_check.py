"""GPU check of issue 4's precision policy and 4 GiB memory budget, on the real 4-bit training path.

Run on a machine with torch + CUDA (an H200 emulates the T4 policy and a 4 GiB card):

    python scripts/gpu_precision_check.py --out reports/gpu_precision.json            # the three checks
    python scripts/gpu_precision_check.py --out reports/gpu_precision.json --calibrate  # + the memory model
    python scripts/gpu_precision_check.py --out /tmp/smoke.json --cpu-smoke             # the code path, on a CPU

Checks, each in its own process (a memory cap or a peak statistic never leaks into the next one):
  turing     the T4 policy forced (fp16 compute, fp16 mixed precision) on a model whose config says bfloat16:
             10 steps with finite, decreasing loss and no `_amp_foreach_non_finite_check_and_unscale_cuda ...
             'BFloat16'` error; trainable weights fp32, no bf16 tensor left in the model.
  bf16       the Ampere+ policy (bf16), likewise.
  tiny_4gb   TinyLlama-1.1B's shape (public config, random weights, built here) under a 4 GiB cap
             (torch.cuda.set_per_process_memory_fraction): LoRA r8, batch 1 x accumulation 8, paged 8-bit AdamW,
             gradient checkpointing (use_reentrant=False), max_grad_norm 0.3, rows of 300-1,024 tokens. Peak
             allocated memory must stay below 3.75 GiB; freetune.plan.memory's estimate is printed beside it.
  preflight  read_hardware() + make_plan() leave no CUDA context behind (the Kaggle notebook's kernel runs
             preflight, then torchrun's ranks need all of every GPU).
  calibrate  (--calibrate) Qwen2.5-1.5B's shape at batch 1 and 8 with checkpointing, 1,024-token rows:
             measured peak against freetune.plan.memory.estimate.

The model is loaded and trained by freetune's own code (freetune.model.load_base_model, attach_lora and
freetune.sft_config.make_config, which set BitsAndBytesConfig's compute dtype and the non-quantised weights from the
plan, run peft's prepare_model_for_kbit_training, keep LoRA in fp32 and give TRL's SFTConfig fp16/bf16), with
TRL's SFTTrainer on pre-tokenised synthetic rows. It prints a table and writes JSON to --out; exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

CAP_GIB = 4.0
PEAK_LIMIT_GIB = 3.75
BF16_AMP_ERROR = "_amp_foreach_non_finite_check_and_unscale_cuda"
CHECKS = ("preflight", "turing", "bf16", "tiny_4gb")


def synthetic_rows(n_rows: int, lengths: tuple[int, int], vocab: int, seed: int):
    """Pre-tokenised rows a model can learn from quickly: each row cycles through a short pattern of a few dozen
    token ids, so the loss falls within a few steps even from random weights."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    ids = rng.sample(range(10, vocab), 48)
    rows = []
    for _ in range(n_rows):
        pattern = rng.sample(ids, 12)
        length = rng.randint(*lengths)
        rows.append({"input_ids": [pattern[i % len(pattern)] for i in range(length)]})
    return Dataset.from_list(rows)


def build_random_model(out_dir: Path, config_values: dict, model_type: str, device: str) -> Path:
    """A random-weight model of a real architecture, saved in bfloat16 with a config that says bfloat16."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **config_values, dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device(device):  # initialising a billion weights on a GPU takes seconds, on a CPU minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(str(out_dir))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out_dir


TINYLLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                 num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)


def tokenizer_with_low_pad(vocab: int):
    """Qwen's real tokenizer (offline fixture) with a pad id inside a smaller vocabulary (TinyLlama has 32,000)."""
    from transformers import AutoTokenizer

    from freetune.fixtures import cached_tiny_model

    tokenizer = AutoTokenizer.from_pretrained(str(cached_tiny_model("qwen2")))
    if tokenizer.pad_token_id >= vocab:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(0)
    return tokenizer


def dtypes_of(model) -> dict:
    import collections

    counts = collections.Counter()
    trainable = collections.Counter()
    for p in model.parameters():
        counts[str(p.dtype).replace("torch.", "")] += p.numel()
        if p.requires_grad:
            trainable[str(p.dtype).replace("torch.", "")] += p.numel()
    return {"all": dict(counts), "trainable": dict(trainable)}


def train_steps(model_dir: str, plan, tokenizer, dataset, *, steps: int, lora_rank: int, micro_batch: int,
                grad_accum: int, max_length: int, learning_rate: float, max_grad_norm: float, optimizer: str,
                work: Path) -> dict:
    """Load, attach LoRA and train with freetune's code; returns losses, dtypes, peak memory, errors."""
    import torch
    from trl import SFTTrainer

    from freetune import model as ft_model
    from freetune.sft_config import make_config
    from freetune.platform import Paths

    result: dict = {"error": None}
    try:
        model = ft_model.load_base_model(model_dir, plan, gradient_checkpointing=True)
        model, trainable, total = ft_model.attach_lora(model, rank=lora_rank, alpha=2 * lora_rank, dropout=0.05)
        result["trainable_params"] = trainable
        result["dtypes"] = dtypes_of(model)
        paths = Paths.under(work).make()
        config = make_config(
            paths, plan, max_steps=steps, micro_batch=micro_batch, grad_accum=grad_accum,
            learning_rate=learning_rate, max_length=max_length, optimizer=optimizer, max_grad_norm=max_grad_norm,
            logging_steps=1, save_steps=10**6, gradient_checkpointing=True, seed=0)
        result["sft_config"] = {"fp16": config.fp16, "bf16": config.bf16, "optim": str(config.optim),
                                "max_grad_norm": config.max_grad_norm,
                                "gradient_checkpointing_kwargs": config.gradient_checkpointing_kwargs}
        trainer = SFTTrainer(model=model, args=config, train_dataset=dataset, processing_class=tokenizer,
                             callbacks=[ft_model.adapter_dtype_guard()])
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = time.time()
        trainer.train()
        result["wall_s"] = round(time.time() - start, 1)
        result["dtypes_after_training"] = dtypes_of(model)
        result["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        if torch.cuda.is_available():
            result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    except Exception as exc:  # recorded, not raised: the point is to report which error (the BFloat16 one?)
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
    return result


def judge_training(result: dict, steps: int, *, require_decrease: bool = True) -> list[str]:
    """The failures of a training check (empty when it passed)."""
    failures = []
    if result.get("error"):
        failures.append(("the fp16 path hit the BFloat16 AMP error: " if BF16_AMP_ERROR in result["error"] else "")
                        + result["error"][:300])
        return failures
    losses = result.get("losses", [])
    if len(losses) < steps:
        failures.append(f"only {len(losses)} losses logged for {steps} steps")
    if not all(math.isfinite(x) for x in losses):
        failures.append(f"non-finite loss: {losses}")
    elif require_decrease and len(losses) >= 4:
        head, tail = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
        if not tail < head:
            failures.append(f"loss did not decrease: first three {head:.4f}, last three {tail:.4f}")
    non_fp32 = {k: v for k, v in result.get("dtypes", {}).get("trainable", {}).items() if k != "float32"}
    if non_fp32:
        failures.append(f"trainable (LoRA) weights not all fp32: {non_fp32}")
    return failures


def check_policy(name: str, args, work: Path) -> dict:
    """turing / bf16: the forced policy on a model whose config says bfloat16."""
    import torch

    from freetune.fixtures import cached_tiny_model
    from freetune.plan import make_plan

    # The default size is the test suite's cached fixture; other sizes are built (and cached) on first use.
    size = {} if (args.tiny_hidden, args.tiny_layers) == (64, 2) else dict(hidden_size=args.tiny_hidden,
                                                                          num_layers=args.tiny_layers)
    model_dir = cached_tiny_model("qwen2", **size)
    config_dtype = json.loads((model_dir / "config.json").read_text()).get("dtype") or \
        json.loads((model_dir / "config.json").read_text()).get("torch_dtype")
    policy = "turing" if name == "turing" else "ampere"
    plan = make_plan(force_policy=policy, model_shape=str(model_dir), micro_batch=2, grad_accum=2, max_length=256)
    tokenizer = tokenizer_with_low_pad(151936)
    data = synthetic_rows(64, (96, 256), vocab=151643, seed=1)
    result = train_steps(str(model_dir), plan, tokenizer, data, steps=args.steps, lora_rank=16, micro_batch=2,
                         grad_accum=2, max_length=256, learning_rate=args.lr, max_grad_norm=1.0,
                         optimizer="paged_adamw_8bit", work=work)
    expected = {"turing": ("float16", "fp16"), "bf16": ("bfloat16", "bf16")}[name]
    failures = judge_training(result, args.steps)
    if config_dtype != "bfloat16":
        failures.append(f"the model's config says {config_dtype}, not bfloat16: the check proves nothing")
    if torch.cuda.is_available():
        if (plan.precision.compute_dtype, plan.precision.mixed) != expected:
            failures.append(f"plan chose {plan.precision.compute_dtype}/{plan.precision.mixed}, expected {expected}")
        if name == "turing" and result.get("dtypes", {}).get("all", {}).get("bfloat16"):
            failures.append(f"bf16 weights left on the fp16 path: {result['dtypes']['all']}")
    return {"check": name, "plan": {"compute_dtype": plan.precision.compute_dtype, "mixed_precision": plan.precision.mixed,
                                    "attn_implementation": plan.kernels.attention},
            "config_dtype": config_dtype, **result, "failures": failures, "passed": not failures}


def check_tiny_4gb(args, work: Path) -> dict:
    """TinyLlama's shape under a 4 GiB cap: the tiny_4gb recipe's settings."""
    import torch

    from freetune.plan import KNOWN_SHAPES
    from freetune.plan import make_plan

    cuda = torch.cuda.is_available()
    shape_values = dict(TINYLLAMA)
    max_length, lengths, steps = 1024, (300, 1024), args.steps
    if not cuda:  # --cpu-smoke: the same code path on a few-layer TinyLlama-like model
        shape_values.update(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2)
        max_length, lengths, steps = 128, (40, 128), min(steps, 3)
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, CAP_GIB / total))
    model_dir = build_random_model(work / "tinyllama-shape", shape_values, "llama", "cuda" if cuda else "cpu")
    plan = make_plan(force_policy=args.tiny_policy, model_shape=KNOWN_SHAPES["tinyllama-1.1b"], micro_batch=1,
                     grad_accum=8, lora_rank=8, max_length=max_length, memory_budget_gib=CAP_GIB)
    tokenizer = tokenizer_with_low_pad(shape_values["vocab_size"])
    data = synthetic_rows(16 * 8, lengths, vocab=shape_values["vocab_size"], seed=2)
    result = train_steps(str(model_dir), plan, tokenizer, data, steps=steps, lora_rank=8, micro_batch=1,
                         grad_accum=8, max_length=max_length, learning_rate=args.lr, max_grad_norm=0.3,
                         optimizer="paged_adamw_8bit", work=work)
    # Random weights on a 32k vocabulary learn slowly through a rank-8 adapter: finite loss is what is required.
    failures = judge_training(result, steps, require_decrease=False)
    peak = result.get("peak_allocated_gib")
    if cuda and peak is not None and peak >= PEAK_LIMIT_GIB:
        failures.append(f"peak allocated {peak:.2f} GiB >= {PEAK_LIMIT_GIB} GiB")
    return {"check": "tiny_4gb", "cap_gib": CAP_GIB if cuda else None, "policy": plan.precision.policy,
            "estimate_peak_allocated_gib": plan.memory.estimate.peak_allocated_gib if plan.memory.estimate else None,
            "estimate": plan.memory.estimate.to_dict() if plan.memory.estimate else None, **result,
            "failures": failures, "passed": not failures}


def check_preflight(args, work: Path) -> dict:
    """read_hardware() and make_plan() must not create a CUDA context (it would hold memory on every GPU)."""
    import shutil

    from freetune.plan import make_plan, read_hardware

    hardware = read_hardware(str(work), str(work))
    plan = make_plan(hardware, model_shape="qwen2.5-1.5b")
    used_mib = None
    if shutil.which("nvidia-smi") and hardware.gpus:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        used_mib = sum(int(line.split(",")[1]) for line in out.splitlines()
                       if line.strip() and line.split(",")[0].strip() == str(os.getpid()))
    failures = [f"preflight left a CUDA context of {used_mib} MiB"] if used_mib else []
    return {"check": "preflight", "hardware": hardware.to_dict(), "plan": plan.to_dict(),
            "context_mib_after_preflight": used_mib, "failures": failures, "passed": not failures}


def check_calibrate(args, work: Path) -> dict:
    """Measured peak of the Qwen2.5-1.5B shape against freetune.plan.memory.estimate (batch 1 and 8, checkpointing)."""
    import torch

    from freetune.plan import KNOWN_SHAPES, estimate
    from freetune.plan import make_plan

    if not torch.cuda.is_available():
        return {"check": "calibrate", "skipped": "needs a GPU", "failures": [], "passed": True}
    model_dir = build_random_model(work / "qwen2.5-1.5b-shape", QWEN25_15B, "qwen2", "cuda")
    tokenizer = tokenizer_with_low_pad(151936)
    runs = []
    for micro_batch in (1, 8):
        plan = make_plan(model_shape=KNOWN_SHAPES["qwen2.5-1.5b"], micro_batch=micro_batch, grad_accum=1)
        data = synthetic_rows(8 * 3, (1024, 1024), vocab=151643, seed=3)
        result = train_steps(str(model_dir), plan, tokenizer, data, steps=3, lora_rank=16,
                             micro_batch=micro_batch, grad_accum=8 // micro_batch, max_length=1024,
                             learning_rate=args.lr, max_grad_norm=1.0, optimizer="paged_adamw_8bit",
                             work=work / f"b{micro_batch}")
        est = estimate(KNOWN_SHAPES["qwen2.5-1.5b"], max_length=1024, micro_batch=micro_batch,
                       compute_dtype=plan.precision.compute_dtype)
        runs.append({"micro_batch": micro_batch, "measured_peak_allocated_gib": result.get("peak_allocated_gib"),
                     "estimated_peak_allocated_gib": est.peak_allocated_gib, "estimate": est.to_dict(),
                     "error": result.get("error")})
        torch.cuda.empty_cache()
    failures = [f"batch {r['micro_batch']}: {r['error'][:200]}" for r in runs if r["error"]]
    for r in runs:
        measured = r["measured_peak_allocated_gib"]
        if measured and abs(r["estimated_peak_allocated_gib"] - measured) / measured > 0.30:
            failures.append(f"batch {r['micro_batch']}: estimate {r['estimated_peak_allocated_gib']:.2f} GiB is more "
                            f"than 30% from the measured {measured:.2f} GiB")
    return {"check": "calibrate", "runs": runs, "failures": failures, "passed": not failures}


def run_one(name: str, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"freetune-{name}-") as tmp:
        work = Path(tmp)
        if name in ("turing", "bf16"):
            return check_policy(name, args, work)
        return {"tiny_4gb": check_tiny_4gb, "preflight": check_preflight,
                "calibrate": check_calibrate}[name](args, work)


def table(results: list[dict]) -> str:
    lines = [f"{'check':<10} {'result':<6} {'first loss':>10} {'last loss':>10} {'peak GiB':>9} {'estimate':>9}  "
             f"notes", "-" * 100]
    for r in results:
        losses = r.get("losses") or []
        first = f"{losses[0]:.4f}" if losses else "-"
        last = f"{losses[-1]:.4f}" if losses else "-"
        peak = f"{r['peak_allocated_gib']:.2f}" if r.get("peak_allocated_gib") is not None else "-"
        est = r.get("estimate_peak_allocated_gib")
        est = f"{est:.2f}" if est is not None else "-"
        notes = "; ".join(r.get("failures", [])) or ""
        if r["check"] in ("turing", "bf16"):
            plan = r.get("plan", {})
            notes = (f"{plan.get('compute_dtype')}/{plan.get('mixed_precision')}, config {r.get('config_dtype')}, "
                     f"trainable {r.get('dtypes', {}).get('trainable')}" + (f"; {notes}" if notes else ""))
        if r["check"] == "preflight":
            notes = f"CUDA context after preflight: {r.get('context_mib_after_preflight')} MiB" + (
                f"; {notes}" if notes else "")
        if r["check"] == "calibrate":
            runs = [f"batch {x['micro_batch']}: measured {x['measured_peak_allocated_gib']} vs estimate "
                    f"{x['estimated_peak_allocated_gib']} GiB" for x in r.get("runs", [])]
            notes = "; ".join(runs + r.get("failures", [])) or r.get("skipped", "")
        lines.append(f"{r['check']:<10} {'PASS' if r['passed'] else 'FAIL':<6} {first:>10} {last:>10} {peak:>9} "
                     f"{est:>9}  {notes}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="where to write the JSON results")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per training check")
    parser.add_argument("--lr", type=float, default=5e-3, help="learning rate (high: random weights, few steps)")
    parser.add_argument("--only", default=",".join(CHECKS), help=f"comma-separated subset of {CHECKS}")
    parser.add_argument("--calibrate", action="store_true", help="also measure the Qwen2.5-1.5B shape's memory")
    parser.add_argument("--tiny-policy", default="turing", choices=["turing", "ampere"],
                        help="precision policy of the 4 GiB check (most 4 GB cards are Turing)")
    parser.add_argument("--tiny-hidden", type=int, default=64, help="hidden size of the bf16-config tiny model")
    parser.add_argument("--tiny-layers", type=int, default=2)
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the code path on a CPU (fp32: proves the script, not the GPU policy)")
    parser.add_argument("--run-one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_one:
        if args.cpu_smoke:
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        result = run_one(args.run_one, args)
        Path(args.result_file).write_text(json.dumps(result, indent=2, default=str))
        return 0

    import torch

    if not args.cpu_smoke and not torch.cuda.is_available():
        print("No CUDA GPU here: run this on the GPU machine, or pass --cpu-smoke to check the code path.")
        return 2
    names = [n.strip() for n in args.only.split(",") if n.strip()] + (["calibrate"] if args.calibrate else [])
    unknown = [n for n in names if n not in (*CHECKS, "calibrate")]
    if unknown:
        parser.error(f"unknown checks {unknown}")
    results = []
    for name in names:
        print(f"== {name}", flush=True)
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
            result_file = f.name
        cmd = [sys.executable, __file__, "--out", args.out, "--run-one", name, "--result-file", result_file,
               "--steps", str(args.steps), "--lr", str(args.lr), "--tiny-policy", args.tiny_policy,
               "--tiny-hidden", str(args.tiny_hidden), "--tiny-layers", str(args.tiny_layers)]
        if args.cpu_smoke:
            cmd.append("--cpu-smoke")
        proc = subprocess.run(cmd)
        try:
            result = json.loads(Path(result_file).read_text())
        except (OSError, json.JSONDecodeError):
            result = {"check": name, "failures": [f"the check's process died (exit {proc.returncode})"],
                      "passed": False}
        finally:
            Path(result_file).unlink(missing_ok=True)
        results.append(result)
    print()
    print(table(results))
    summary = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() and not args.cpu_smoke else "cpu",
               "torch": torch.__version__, "cpu_smoke": args.cpu_smoke, "results": results,
               "passed": all(r["passed"] for r in results)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
    print(f"\n{'all checks passed' if summary['passed'] else 'FAILED'}; JSON: {args.out}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
