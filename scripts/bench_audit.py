"""Benchmark the data audit on a large synthetic SVG data set: how long each phase takes.

The target (issue 45): a 100,000-row data set audits in under 15 s with a tokenizer on a 2-core machine. The rows are
shaped like thesantatitan/deepseek-svg-dataset (a description -> SVG code, a few hundred to a few thousand
characters) with the junk a real set carries: the pipeline's error string, empty answers, broken SVG, exact
copies, and a few answers too long for max_length. The tokenizer is the tiny fixture model's, which is Qwen2.5's
real tokenizer, so token counts are the real ones.

Usage: python scripts/bench_audit.py [--rows 100000] [--max-length 1024] [--no-checks]
       taskset -c 0,1 python scripts/bench_audit.py     # a 2-core machine, on a bigger idle one
       python scripts/bench_audit.py --shapes [--rows 1000] [--share 0.02]
       python scripts/bench_audit.py --fingerprint [--rows 100000]   # before and after a change made for speed

--shapes measures what the audit keeps and drops instead of how fast (issue 45): 13 data-set shapes people
fine-tune on (scripts/audit_shapes.py), each audited clean and with every kind of junk planted at --share of the
rows, then cleaned and audited again as the recipes do. Per shape: legit rows dropped, whether it stopped, and per
junk kind the planted rows no finding names. Targets: 0 legit rows dropped and no stop on any clean set; >= 95%
of planted junk dropped or named, per kind.

Wall time depends on what else the machine runs (the load average is printed); the CPU time does much less, so
it is the figure to compare between runs on a shared machine (docs/audit.md has the measurements).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import time

COLOURS = ["#e53935", "#1e88e5", "#43a047", "#fb8c00", "#8e24aa", "#000000", "#00897b", "#fdd835", "#d81b60"]
NAMES = ["red", "blue", "green", "orange", "purple", "black", "teal", "gold", "pink"]
SUBJECTS = ["a house", "a tree", "a cat face", "a rocket", "a coffee cup", "a sailing boat", "a mountain range",
            "a bicycle", "a lighthouse", "an owl", "a robot", "a flower pot"]


def svg_row(i: int, rng: random.Random) -> dict:
    size = rng.choice([64, 128, 256, 512])
    colour = rng.randrange(len(COLOURS))
    elements = []
    # Element count drawn from a long-tailed distribution: most answers are a few hundred tokens, a few are long.
    for _ in range(min(int(rng.expovariate(1 / 8)) + 1, 120)):
        kind = rng.random()
        x, y, r = rng.randrange(size), rng.randrange(size), rng.randrange(2, size // 3)
        fill = rng.choice(COLOURS)
        if kind < 0.4:
            elements.append(f'<circle cx="{x}" cy="{y}" r="{r}" fill="{fill}"/>')
        elif kind < 0.7:
            elements.append(f'<rect x="{x}" y="{y}" width="{r}" height="{r * 2}" fill="{fill}" rx="3"/>')
        else:
            points = " ".join(f"{rng.randrange(size)},{rng.randrange(size)}" for _ in range(rng.randint(3, 7)))
            elements.append(f'<polygon points="{points}" fill="{fill}" stroke="#222" stroke-width="1.5"/>')
    completion = (f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size}" '
                  f'viewBox="0 0 {size} {size}"><rect width="{size}" height="{size}" fill="#fafafa"/>'
                  + "".join(elements) + "</svg>")
    prompt = (f"Generate SVG code for {rng.choice(SUBJECTS)} in {NAMES[colour]}, {size}x{size} pixels, "
              f"flat style, design #{i}.")
    return {"prompt": prompt, "completion": completion}


def synthetic_rows(n: int, seed: int = 0) -> tuple[list[dict], dict[str, int]]:
    rng = random.Random(seed)
    rows = [svg_row(i, rng) for i in range(n)]
    junk = {"error string": int(0.018 * n), "empty": int(0.001 * n), "broken svg": int(0.002 * n),
            "exact copy": int(0.003 * n)}
    picks = rng.sample(range(n), sum(junk.values()))
    at = 0
    for kind, count in junk.items():
        for i in picks[at:at + count]:
            if kind == "error string":
                rows[i]["completion"] = "No valid response from model."
            elif kind == "empty":
                rows[i]["completion"] = "  "
            elif kind == "broken svg":
                rows[i]["completion"] = rows[i]["completion"][: len(rows[i]["completion"]) // 2]
            else:
                rows[i] = dict(rows[rng.randrange(n)])
        at += count
    return rows, junk


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def shapes_table(rows: int, shares: list[float]) -> None:
    from scripts.audit_shapes import JUNK_KINDS, SHAPES, measure

    caught = {k: 0 for k in JUNK_KINDS}
    dropped = {k: 0 for k in JUNK_KINDS}
    planted = {k: 0 for k in JUNK_KINDS}
    print(f"Audit of {len(SHAPES)} data-set shapes, {rows:,} rows each, junk planted at {', '.join(map(str, shares))} "
          f"of the rows per kind")
    kinds = " ".join(f"{k[:8]:>8}" for k in JUNK_KINDS)
    print(f"{'shape':<32}{'share':>6}  {'clean: dropped':>14} {'stop':>5}  {'junk: legit dropped':>19} {'stop':>5}  "
          f"junk missed: {kinds}")
    for share in shares:
        for shape in SHAPES:
            m = measure(shape, n=rows, share=share)
            j = m["junk"]
            missed = []
            for kind in JUNK_KINDS:
                if kind in j["planted"]:
                    planted[kind] += len(j["planted"][kind])
                    caught[kind] += len(j["planted"][kind]) - len(j["missed"][kind])
                    dropped[kind] += j["dropped"][kind]
                    missed.append(f"{len(j['missed'][kind]):>8}")
                else:
                    missed.append(f"{'-':>8}")
            print(f"{shape:<32}{share:>6}  {m['clean']['dropped']:>14} {str(m['clean']['stopped']):>5}  "
                  f"{j['legit_dropped']:>19} {str(j['stopped']):>5}  {'':>12} {' '.join(missed)}")
            if m["clean"]["warnings"]:
                print(f"{'':<8}warnings on the clean set: {', '.join(m['clean']['warnings'])}")
    print("junk dropped or named, per kind: " + ", ".join(
        f"{k} {caught[k]}/{planted[k]} ({100 * caught[k] / max(planted[k], 1):.1f}%, dropped {dropped[k]})"
        for k in JUNK_KINDS))
    print("what the audit said of the clean sentiment set: "
          + (measure(next(iter(SHAPES)), n=rows)["clean"]["labels"] or "no label set"))


def fingerprint(rows: int) -> str:
    """A hash of the reports (and cleaning summaries) of the 13 shapes, clean and planted at 1% and 5%, with and
    without the tokenizer (chats too, the SVG shape with its checks), and of `rows` bench rows: a change made for
    speed must leave it as it was (run it before and after)."""
    import hashlib

    import datasets

    from freetune.audit import audit, clean
    from freetune.tasks.svg import AUDIT_CHECKS
    from scripts.audit_shapes import SHAPES, legit_rows, plant

    tokenizer, digest = _tokenizer(), hashlib.sha256()

    def add(data: list[dict], **kwargs) -> None:
        dataset = datasets.Dataset.from_list(data)
        report = audit(dataset, **kwargs)
        digest.update(report.to_json().encode() + str(clean(dataset, report)[1]).encode())

    for shape in SHAPES:
        for share in (0.0, 0.01, 0.05):
            data = plant(legit_rows(shape, 400), shape, share)[0] if share else legit_rows(shape, 400)
            add(data)
            add(data, tokenizer=tokenizer, max_length=96, checks=AUDIT_CHECKS if shape == "SVG" else None)
            if "messages" in data[0]:  # loss on every token
                add(data, tokenizer=tokenizer, max_length=96, assistant_only=False)
            else:  # the same rows as chats
                add([{"prompt": [{"role": "user", "content": r["prompt"]}],
                      "completion": [{"role": "assistant", "content": r["completion"]}]} for r in data],
                    tokenizer=tokenizer, max_length=96)
    add(synthetic_rows(rows)[0], tokenizer=tokenizer, max_length=1024, checks=AUDIT_CHECKS)
    return digest.hexdigest()


def _tokenizer():
    from transformers import AutoTokenizer

    from freetune.fixtures import cached_tiny_model

    return AutoTokenizer.from_pretrained(str(cached_tiny_model("qwen2")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=None, help="rows (default 100,000; 1,000 with --shapes)")
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--no-checks", action="store_true", help="skip the SVG checks (XML parsing)")
    parser.add_argument("--shapes", action="store_true", help="what the audit keeps and drops on 13 shapes")
    parser.add_argument("--share", type=float, nargs="+", default=[0.01, 0.02, 0.05],
                        help="with --shapes: the shares of rows planted with each kind of junk")
    parser.add_argument("--fingerprint", action="store_true",
                        help="print a hash of the reports on the shapes and --rows bench rows (speed changes keep it)")
    args = parser.parse_args()
    if args.fingerprint:
        print(f"audit fingerprint: {fingerprint(args.rows or 100_000)}")
        return
    if args.shapes:
        shapes_table(args.rows or 1000, args.share)
        return
    args.rows = args.rows or 100_000
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    import datasets

    from freetune.audit import audit, clean
    from freetune.tasks.svg import AUDIT_CHECKS

    rows, junk = synthetic_rows(args.rows)
    dataset = datasets.Dataset.from_list(rows)
    tokenizer = _tokenizer()
    checks = None if args.no_checks else AUDIT_CHECKS

    load_before = os.getloadavg()[0]
    wall0, cpu0 = time.perf_counter(), cpu_seconds()
    report = audit(dataset, tokenizer=tokenizer, max_length=args.max_length, checks=checks)
    audit_wall, audit_cpu = time.perf_counter() - wall0, cpu_seconds() - cpu0
    t0 = time.perf_counter()
    cleaned, summary = clean(dataset, report)
    clean_wall = time.perf_counter() - t0

    load = os.getloadavg()[0]
    cores = len(os.sched_getaffinity(0))
    checked = "none" if checks is None else ", ".join(sorted(checks))
    print(f"Audit of {len(dataset):,} synthetic SVG rows on {cores} CPU cores, load average {load_before:.1f} when "
          f"it started, {load:.1f} when it ended (max_length {args.max_length}, checks: {checked})")
    print("  planted junk: " + ", ".join(f"{k} {v:,}" for k, v in junk.items()))
    print(f"{'phase':<16}{'seconds':>9}")
    for phase, seconds in report.timings.items():
        if phase != "total":
            print(f"{phase:<16}{seconds:>9.2f}")
    print(f"{'audit total':<16}{audit_wall:>9.2f}   (CPU time {audit_cpu:.2f} s)")
    print(f"{'clean':<16}{clean_wall:>9.2f}")
    print(f"{'rows/second':<16}{len(dataset) / audit_wall:>9,.0f}")
    print(f"tokenised with: {report.engine}")
    lengths = report.tokens["sequence_tokens"]
    print(f"tokens per row: median {lengths['median']:,}, p95 {lengths['p95']:,}, max {lengths['max']:,}; "
          f"total {lengths['total']:,}")
    print(summary)


if __name__ == "__main__":
    main()
