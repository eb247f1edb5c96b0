"""Issue 44's GPU runs on the real SmolLM2-135M-Instruct: the data they train on, and a greedy judge of every
checkpoint of a finished notebook run (steps vs adherence: the curve), with the generations kept for re-judging.

    python scripts/real_model_gpu.py data OUT_DIR
        OUT_DIR/svg_4750.jsonl: make_sample_data's SVG generator at 4,750 rows (the size of the public set);
        OUT_DIR/svg_seed_story.jsonl: the same rows with answers that open with varied prose, as a chat model's
        do, and 1.77% (84 of 4,750, as in the public set) answering the identical stub.
    python scripts/real_model_gpu.py judge RUN_DIR --base MODEL --task svg --out FILE.json
        Greedy answers of the base and of each checkpoint-N (and the final adapter) to every held-out row the
        notebook kept (RUN_DIR/data/eval), judged by freetune.evaluate.judge.

Runs where the notebooks ran (the GPU machine); re-judge the saved generations anywhere with `rejudge FILE.json`,
or every run's with `report JUDGED_DIR --out SUMMARY.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

STUB = "No valid response from model."
STUB_ROWS = 84  # of 4,750: the share (1.77%) the public SVG set had
PROSE = [
    "Here is the SVG you asked for:",
    "Sure! Below is a {size}px SVG of a {fg} {shape} on a {bg} background.",
    "Certainly. This SVG draws a {shape} in {fg} over {bg}:",
    "Of course — the following code renders the requested {size}x{size} image.",
    "I have created the icon. It uses a {bg} background with a {fg} {shape}:",
    "Below you will find the SVG markup:",
    "Great idea! Here's a simple {shape} design in SVG:",
    "The image is {size} pixels wide; save this as a .svg file:",
]


def write_data(out: Path) -> None:
    from make_sample_data import svg_rows

    out.mkdir(parents=True, exist_ok=True)
    rows = svg_rows(4750, random.Random(0))
    (out / "svg_4750.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rng = random.Random(1)
    stubbed = set(rng.sample(range(len(rows)), STUB_ROWS))
    story = []
    for i, row in enumerate(rows):
        fg, shape, bg = re.search(r"an? (\w+) (.+?) (?:on a|over|with a) (\w+)", row["prompt"]).groups()
        size = re.search(r"(\d+)", row["prompt"]).group(1)
        intro = rng.choice(PROSE).format(fg=fg, shape=shape, bg=bg, size=size)
        story.append({"prompt": row["prompt"],
                      "completion": STUB if i in stubbed else f"{intro}\n\n{row['completion']}"})
    (out / "svg_seed_story.jsonl").write_text("".join(json.dumps(r) + "\n" for r in story))
    print(f"{len(rows)} rows; seed story: {len(stubbed)} stub rows ({len(stubbed) / len(rows):.2%})")


def _stub_share(generations) -> float:
    from freetune.evaluate import near_identical, normalise

    return sum(near_identical(normalise(g.text), normalise(STUB)) for g in generations) / max(len(generations), 1)


def _summary(name: str, report, generations) -> dict:
    side = report.base if name == "base" else report.adapter
    task = report.base_task if name == "base" else report.adapter_task
    following = side["following"]
    return {"verdict": side["verdict"], "warnings": side["warnings"], "adherence": following["adherence"],
            "distinct_answers": following["distinct_answers"],
            "reference_distinct_answers": following["reference_distinct_answers"],
            "most_common_answer": following["most_common_answer"], "most_common_count": following["most_common_count"],
            "stub_share": _stub_share(generations), "task": task}


def judge_run(run_dir: Path, base_model: str, task: str, max_new_tokens: int) -> dict:
    """Greedy answers of the base and of every saved adapter of the run to all its held-out rows, judged."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from freetune.data import load_prepared, prompt_messages
    from freetune.model import nf4_config
    from freetune.evaluate import generate, judge
    from freetune.checkpoint import checkpoint_step

    _, held_out = load_prepared(str(run_dir / "data"))
    rows = [dict(r) for r in held_out]
    prompts = [prompt_messages(r) for r in rows]
    adapters = sorted(run_dir.glob("checkpoints/checkpoint-*"), key=checkpoint_step)
    adapters = [a for a in adapters if (a / "adapter_config.json").exists()]
    # The T4 policy the notebooks ran under: fp16 compute on the 4-bit base.
    on_gpu = dict(dtype=torch.float16, device_map={"": 0}, quantization_config=nf4_config(torch.float16))
    base = AutoModelForCausalLM.from_pretrained(base_model, **(on_gpu if torch.cuda.is_available() else {}))
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "adapter"))
    model = PeftModel.from_pretrained(base, str(run_dir / "adapter"), adapter_name="final")
    options = dict(greedy=True, seeds=(), max_new_tokens=max_new_tokens, batch_size=len(prompts))
    with model.disable_adapter():
        base_generations = generate(model, tokenizer, prompts, **options)
    points = []
    for adapter in adapters + [run_dir / "adapter"]:
        name = adapter.name if adapter.name != "adapter" else "final"
        if name != "final":
            model.load_adapter(str(adapter), adapter_name=name)
        model.set_adapter(name)
        generations = generate(model, tokenizer, prompts, **options)
        report = judge(rows, base_generations, generations, task=task)
        step = checkpoint_step(adapter) if name != "final" else None
        point = {"adapter": name, "step": step, **_summary("adapter", report, generations),
                 "generations": [g.__dict__ for g in generations]}
        print(f"{name}: adherence {point['adherence']}, verdict {point['verdict']}, "
              f"stub {point['stub_share']:.0%}, task {json.dumps(point['task'])}", flush=True)
        points.append(point)
    base_report = judge(rows, base_generations, base_generations, task=task)
    return {"run_dir": str(run_dir), "task": task, "rows": rows, "max_new_tokens": max_new_tokens,
            "base": {**_summary("base", base_report, base_generations),
                     "generations": [g.__dict__ for g in base_generations]},
            "adapters": points}


def rejudge(path: Path, task: str | None) -> dict:
    """The saved generations judged again (by this freetune, with this machine's renderer)."""
    from freetune.evaluate import Generation, judge

    saved = json.loads(path.read_text())
    task = task or saved["task"]
    rows = saved["rows"]
    base = [Generation(**g) for g in saved["base"]["generations"]]
    out = {"base": None, "adapters": []}
    for point in saved["adapters"]:
        generations = [Generation(**g) for g in point["generations"]]
        report = judge(rows, base, generations, task=task)
        out["base"] = _summary("base", report, base)
        out["adapters"].append({"adapter": point["adapter"], "step": point["step"],
                                **_summary("adapter", report, generations)})
    return out


# The task metrics shown per point of the curve, where the task has them.
SHOWN = ("well_formed_xml", "size_matches", "background_matches", "colours_match", "shapes_match", "image_similarity",
         "follows_prompt", "valid_json", "schema_ok", "action_matches")


def report(judged_dir: Path, out: Path) -> None:
    """Every run's saved generations judged again here, as one JSON and a table per run on stdout."""
    summary = {}
    for path in sorted(judged_dir.glob("*.json")):
        judged = rejudge(path, None)
        summary[path.stem] = judged
        print(f"\n{path.stem}")
        for point in [{"adapter": "base", "step": 0, **judged["base"]}] + judged["adapters"]:
            task = point["task"] or {}
            shown = " ".join(f"{k} {task[k]:.0%}" for k in SHOWN if task.get(k) is not None)
            print(f"  {point['adapter']:>16}  {point['verdict']:>9}  adherence "
                  f"{'n/a' if point['adherence'] is None else format(point['adherence'], '.0%'):>4}  "
                  f"different {point['distinct_answers']:>2}/{point['reference_distinct_answers']:<2}  "
                  f"stub {point['stub_share']:.0%}  {shown}")
    out.write_text(json.dumps(summary, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    data = sub.add_parser("data")
    data.add_argument("out", type=Path)
    run = sub.add_parser("judge")
    run.add_argument("run_dir", type=Path)
    run.add_argument("--base", required=True)
    run.add_argument("--task", default=None)
    run.add_argument("--max-new-tokens", type=int, default=320)
    run.add_argument("--out", required=True, type=Path)
    again = sub.add_parser("rejudge")
    again.add_argument("saved", type=Path)
    again.add_argument("--task", default=None)
    summary = sub.add_parser("report")
    summary.add_argument("judged_dir", type=Path)
    summary.add_argument("--out", required=True, type=Path)
    args = parser.parse_args()
    if args.command == "data":
        write_data(args.out)
    elif args.command == "judge":
        args.out.write_text(json.dumps(judge_run(args.run_dir, args.base, args.task, args.max_new_tokens), indent=1))
    elif args.command == "report":
        report(args.judged_dir, args.out)
    else:
        print(json.dumps(rejudge(args.saved, args.task), indent=1))


if __name__ == "__main__":
    main()
