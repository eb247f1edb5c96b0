"""After training: what does the adapter actually generate, next to the base model, and has it collapsed?

A falling loss proves little. An adapter trained on data where 2% of completions were one error string
answered that string to every prompt, with a fine-looking loss curve. This module generates for a few
varied prompts, greedy and with a few seeds at a temperature, from the base model and from the adapter,
and reports:
- the share of the most common output (near-identical ones counted together) and the distinct-output ratio,
- repeated n-gram rate (looping), how often generation stopped at EOS, mean length,
- one verdict per model that weighs all of it: "collapsed" when one output answers most of the varied prompts
  (that output shown), "weak" when its outputs ignore the prompt, loop, never stop or are empty, "inconclusive"
  when the prompts cannot show collapse, "ok" only when nothing looks wrong,
- the recipe's task metrics (freetune.tasks) for both.

It reuses one base model for both sides (peft's `disable_adapter()` gives the base outputs), so memory is
not doubled, and it reads a Trainer `checkpoint-N` folder as well as the final adapter folder.

Command line:
    python -m freetune.sanity --base BASE_DIR_OR_HUB_ID --adapter ADAPTER_DIR --data rows.jsonl \
        [--task svg|home_assistant] [--rows 8] [--json]
It exits with status 1 when the adapter's verdict is "collapsed".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import json
import os
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from difflib import SequenceMatcher
from pathlib import Path
from types import ModuleType

from freetune.checkpoint import checkpoint_step
from freetune.data import completion_text, prompt_messages
from freetune.errors import FreetuneError
from freetune.resources import release_memory
from freetune.tasks import TASK_NAMES, load_task, normalise_answer, reference_metrics, summarise_metrics

# One verdict per model, the worst its findings imply: "ok" only when nothing looks wrong; "inconclusive" when the
# prompts cannot show collapse; "weak" when the outputs ignore the prompt, loop, run on or are empty; "collapsed"
# when one output answers most prompts.
OK, INCONCLUSIVE, WEAK, COLLAPSED = "ok", "inconclusive", "weak", "collapsed"
VERDICTS = (OK, INCONCLUSIVE, WEAK, COLLAPSED)
# One output making up at least this share of the generations, over varied prompts, is collapse. Raised when
# the references themselves repeat (a yes/no task), so a model answering "yes" as often as its data does is
# not flagged.
COLLAPSE_SHARE = 0.5
REFERENCE_MARGIN = 0.25
# Near-identical: outputs differing in at most this many characters (one substituted character counts 2),
# or this fraction of their length when that is more. "No valid response (3)." and "... (4)." are the same
# answer; two SVGs that differ in a colour (6 hex digits = 12) are not, even when 95% of their text is shared.
NEAR_IDENTICAL_MIN_CHARS = 4
NEAR_IDENTICAL_FRACTION = 0.03
NGRAM = 4
# The verdict is "ok" only when at least this share of greedy answers does what the prompt asked (the task's
# ADHERENCE metric against the reference), and an adapter whose greedy answers hold at most DIVERSITY_SHARE of the
# references' different answers (pictures, actions, texts) is warned that it ignores the prompt.
ADHERENCE_OK = 0.8
DIVERSITY_SHARE = 0.5
DIVERSITY_MIN_REFERENCES = 4  # fewer different references (a yes/no task) cannot show that the prompt is ignored
_WORDS = re.compile(r"\w+|[^\w\s]")


@dataclass
class Generation:
    prompt_index: int        # which prompt (position in the list given to generate)
    mode: str                # "greedy" or "seed N"
    text: str                # the new text, up to (not including) EOS
    ended_with_eos: bool = True
    new_tokens: int | None = None  # tokens generated, EOS included


# ----------------------------------------------------------------------------------------------- generation

def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _chat_prompt(tokenizer, messages: list[dict]) -> str:
    if not tokenizer.chat_template:
        raise FreetuneError(
            "The tokenizer has no chat template, so the sanity check cannot build prompts. Use the instruct "
            "model's tokenizer (the one training used), or set tokenizer.chat_template.")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def generate(model, tokenizer, prompts: list[list[dict]], *, greedy: bool = True, seeds=(0, 1, 2),
             temperature: float = 0.7, max_new_tokens: int = 256, batch_size: int = 8) -> list[Generation]:
    """Generate for each chat prompt: once greedy, and once per seed sampling at `temperature`.

    The samples of a batch of prompts come from one call (len(seeds) sequences per prompt, the noise seeded from the
    first seed): decoding costs a step per token whatever the batch, so on a CPU this halved the evaluation's time.

    Decoding is plain on purpose (no top-k/top-p, no repetition penalty, whatever the model's
    generation_config says): the check is about what the weights learnt, and those tricks can hide collapse.
    """
    import torch

    if not prompts:
        raise FreetuneError("No prompts to generate from: give the sanity check at least two rows.")
    eos_ids = _eos_ids(model, tokenizer)
    if not eos_ids:
        raise FreetuneError("Neither the model's generation_config nor the tokenizer names an EOS token, so "
                            "generation could never stop. Set tokenizer.eos_token (e.g. '<|im_end|>').")
    stop = set(eos_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_ids[0]
    texts = [_chat_prompt(tokenizer, messages) for messages in prompts]
    modes = ([("greedy", None)] if greedy else []) + [(f"seed {s}", s) for s in seeds]
    if not modes:
        raise FreetuneError("Nothing to generate: set greedy=True or give at least one seed.")
    # (modes, the seed) per call: greedy alone, then every sample at once
    sampled = modes[1:] if greedy else modes
    calls = ([([("greedy", None)], None)] if greedy else []) + ([(sampled, seeds[0])] if seeds else [])

    was_training, padding_side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # new tokens must follow each prompt directly
    generations = []
    try:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(texts[start:start + batch_size], return_tensors="pt", padding=True,
                              add_special_tokens=False).to(model.device)
            for call_modes, seed in calls:
                # top_k=0 and top_p=1.0 switch off the model's own sampling filters (Qwen ships top_k=20).
                decoding = (dict(do_sample=False) if seed is None
                            else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                      num_return_sequences=len(call_modes)))
                if seed is not None:
                    torch.manual_seed(seed)  # the same noise for base and adapter
                with torch.no_grad():
                    out = model.generate(**batch, **decoding, repetition_penalty=1.0, max_new_tokens=max_new_tokens,
                                         eos_token_id=eos_ids, pad_token_id=pad_id, use_cache=True)
                # generate returns a prompt's sequences next to each other: prompt i's j-th is row i * n + j
                for k, ids in enumerate(out[:, batch["input_ids"].shape[1]:].tolist()):
                    end = next((t for t, token in enumerate(ids) if token in stop), None)
                    kept = ids if end is None else ids[:end]
                    generations.append(Generation(
                        prompt_index=start + k // len(call_modes), mode=call_modes[k % len(call_modes)][0],
                        text=tokenizer.decode(kept, skip_special_tokens=True),
                        ended_with_eos=end is not None, new_tokens=len(kept) + (end is not None)))
    finally:
        tokenizer.padding_side = padding_side
        model.train(was_training)
    order = {mode: k for k, (mode, _) in enumerate(modes)}
    return sorted(generations, key=lambda g: (g.prompt_index, order[g.mode]))


# ------------------------------------------------------------------------------------------ the sanity report

normalise = normalise_answer  # case and whitespace do not make two answers different


Q = 8


@functools.lru_cache(maxsize=4096)
def _qgrams(text: str) -> frozenset:
    return frozenset(text[i:i + Q] for i in range(len(text) - Q + 1))


def near_identical(a: str, b: str) -> bool:
    """True when two (normalised) outputs differ in only a few characters: the same answer, give or take."""
    if a == b:
        return True
    total = len(a) + len(b)
    allowance = max(NEAR_IDENTICAL_MIN_CHARS, NEAR_IDENTICAL_FRACTION * total / 2)
    if abs(len(a) - len(b)) > allowance:
        return False
    # Each edit touches at most Q of a text's Q-grams, so texts whose Q-gram sets differ by more cannot be
    # near-identical: this rules out most pairs of long outputs in O(length), before the quadratic diff.
    grams_a, grams_b = _qgrams(a), _qgrams(b)
    if len(grams_a - grams_b) > Q * allowance or len(grams_b - grams_a) > Q * allowance:
        return False
    # The diff is quadratic: run it only on what lies between the common prefix and suffix.
    prefix = len(os.path.commonprefix([a, b]))
    suffix = len(os.path.commonprefix([a[prefix:][::-1], b[prefix:][::-1]]))
    middle_a, middle_b = a[prefix:len(a) - suffix], b[prefix:len(b) - suffix]
    matcher = SequenceMatcher(None, middle_a, middle_b, autojunk=False)
    matching = prefix + suffix + sum(block.size for block in matcher.get_matching_blocks())
    return total - 2 * matching <= allowance


@dataclass
class Cluster:
    text: str                      # its most frequent exact output
    count: int                     # outputs in it
    prompts: set = field(default_factory=set)


def largest_cluster(texts: list[str], prompt_ids: list[int]) -> Cluster | None:
    """The biggest group of near-identical outputs (the most frequent texts seed the groups)."""
    if not texts:
        return None
    exact = Counter(normalise(t) for t in texts)
    first_seen = {}
    for text in texts:
        first_seen.setdefault(normalise(text), text)
    clusters: list[tuple[str, Cluster]] = []  # (normalised representative, cluster)
    members: dict[str, Cluster] = {}
    for key, count in exact.most_common():
        home = next((c for rep, c in clusters if near_identical(rep, key)), None)
        if home is None:
            home = Cluster(text=first_seen[key], count=0)
            clusters.append((key, home))
        home.count += count
        members[key] = home
    for text, pid in zip(texts, prompt_ids):
        members[normalise(text)].prompts.add(pid)
    return max((c for _, c in clusters), key=lambda c: c.count)


def repeated_ngram_rate(texts: list[str], n: int = NGRAM) -> float:
    """Share of word n-grams that repeat an earlier n-gram of the same output (loops score high)."""
    total = repeated = 0
    for text in texts:
        words = _WORDS.findall(text)
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        total += len(grams)
        repeated += len(grams) - len(set(grams))
    return repeated / total if total else 0.0


def _shorten(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + f"… ({len(text)} characters)"


def sanity_report(generations: list[Generation], references: list[str] | None = None,
                  collapse_share: float = COLLAPSE_SHARE, following: dict | None = None) -> dict:
    """Distinct outputs, the most common output and its share, looping, EOS rate, length, and a verdict.

    Verdict "collapsed": one near-identical output makes up at least `collapse_share` of all generations (greedy
    and sampled pooled: an estimate of how much of the model's probability mass, over varied prompts, sits on
    one answer), and it answers two or more different prompts. references (the data's answers for the same
    prompts, optional) raise that bar to their own most-common share + REFERENCE_MARGIN, for tasks whose right
    answers repeat. `warnings` says what else looks wrong, and weighs in the verdict: greedy outputs that ignore
    the prompt, no EOS, loops or empty outputs make it "weak"; one prompt, or references that repeat as much as
    collapse would, make it "inconclusive"; "ok" only without any.
    """
    if not generations:
        raise FreetuneError("No generations to check: the sanity report needs outputs for at least two prompts.")
    texts = [g.text for g in generations]
    pids = [g.prompt_index for g in generations]
    n, n_prompts = len(texts), len(set(pids))
    overall = largest_cluster(texts, pids)
    greedy = [g for g in generations if g.mode == "greedy"]
    greedy_cluster = largest_cluster([g.text for g in greedy], [g.prompt_index for g in greedy])
    greedy_share = greedy_cluster.count / len(greedy) if greedy_cluster else 0.0

    threshold, reference_share = collapse_share, None
    if references and len(references) > 1:
        ref = largest_cluster(list(references), list(range(len(references))))
        reference_share = ref.count / len(references)
        threshold = max(collapse_share, reference_share + REFERENCE_MARGIN)

    share = overall.count / n
    collapsed = n_prompts >= 2 and share >= threshold and len(overall.prompts) >= 2
    shown = overall.text if overall.text.strip() else "(empty output)"
    if collapsed:
        reason = (f"the same output for {len(overall.prompts)} of {n_prompts} prompts ({overall.count} of {n} "
                  f"generations): {_shorten(shown)!r}")
    else:
        reason = (f"the most common output makes up {share:.0%} of generations (collapse is {threshold:.0%} or more), "
                  f"for {len(overall.prompts)} of {n_prompts} prompts")

    eos_rate = sum(g.ended_with_eos for g in generations) / n
    tokens = [g.new_tokens for g in generations if g.new_tokens is not None]
    ngram_rate = repeated_ngram_rate(texts)
    empty_share = sum(not t.strip() for t in texts) / n
    found = []  # (verdict it implies, warning)
    if n_prompts < 2:
        found.append((INCONCLUSIVE, "Only one prompt: collapse across prompts cannot be judged. Give several "
                                    "varied rows."))
    if reference_share is not None and threshold >= 1:
        found.append((INCONCLUSIVE, f"The references repeat too ({reference_share:.0%} share one answer): collapse "
                                    f"cannot be told from the task's own answers. Pick more varied rows."))
    if not collapsed and greedy_cluster and len(greedy_cluster.prompts) >= 2 and greedy_share >= threshold:
        found.append((WEAK, f"Greedy decoding gives the same output for {len(greedy_cluster.prompts)} of "
                            f"{len(greedy)} prompts, though samples vary: the model does not follow the prompt yet "
                            f"(undertrained?): {_shorten(greedy_cluster.text, 120)!r}"))
    if eos_rate < 0.5:
        found.append((WEAK, f"Only {eos_rate:.0%} of generations ended with EOS; the rest ran to max_new_tokens. "
                            f"Either max_new_tokens is too small for this task, or the model did not learn to stop "
                            f"(check that the EOS token is inside the labels and that pad is not the EOS token)."))
    if ngram_rate > 0.5:
        found.append((WEAK, f"{ngram_rate:.0%} of {NGRAM}-grams repeat within their output: the model loops."))
    if empty_share > 0.25:
        found.append((WEAK, f"{empty_share:.0%} of outputs are empty."))
    found += _following_findings(following) if following else []
    warnings = [text for _, text in found]
    verdict = COLLAPSED if collapsed else max((v for v, _ in found), key=VERDICTS.index, default=OK)
    if verdict == WEAK:
        reason = (f"{sum(v == WEAK for v, _ in found)} warning(s) about the outputs themselves (below); not collapsed: "
                  + reason)
    elif verdict == INCONCLUSIVE:
        reason = "collapse cannot be judged on these prompts (below); " + reason

    return {
        "verdict": verdict,
        "reason": reason,
        "generations": n,
        "prompts": n_prompts,
        "distinct_ratio": len({normalise(t) for t in texts}) / n,
        # Across prompts a few distinct outputs are collapse; for one prompt, few are a model sure of its answer.
        "answers_per_prompt": sum(len({normalise(t) for t, p in zip(texts, pids) if p == q}) for q in set(pids))
        / n_prompts,
        "most_common_output": overall.text,
        "most_common_share": share,
        "most_common_prompts": len(overall.prompts),
        "greedy_most_common_share": greedy_share if greedy_cluster else None,
        "collapse_threshold": threshold,
        "reference_most_common_share": reference_share,
        "repeated_ngram_rate": ngram_rate,
        "eos_rate": eos_rate,
        "mean_new_tokens": sum(tokens) / len(tokens) if tokens else None,
        "mean_chars": sum(len(t) for t in texts) / n,
        "empty_share": empty_share,
        "following": following,
        "warnings": warnings,
    }


# ------------------------------------------------------------------------ does it do what the prompt asked?

def prompt_following(generations: list[Generation], rows: list[dict], task_metrics: list[dict],
                     task_module: ModuleType | None) -> dict:
    """The greedy answers (the first sample where there is no greedy one) judged as the task judges them:
    adherence, the share doing what the prompt asked (the task's ADHERENCE metric against the reference; None for
    a task without one), and how many different answers (the task's signature: a picture's size, colours and
    shapes, an action; the normalised text without a task) they hold, next to how many the references hold.

    task_metrics: the task's metrics for each generation, in the same order (empty without a task).
    """
    chosen = {}
    for k, g in enumerate(generations):
        if g.mode == "greedy" or g.prompt_index not in chosen:
            chosen[g.prompt_index] = k
    signature = getattr(task_module, "signature", None) or normalise_answer
    answers = [signature(generations[k].text) for k in chosen.values()]
    references = {signature(completion_text(rows[i])) for i in chosen}
    adherence_key = getattr(task_module, "ADHERENCE", None)
    judged = [task_metrics[k][adherence_key] for k in chosen.values()
              if task_metrics and task_metrics[k].get(adherence_key) is not None]
    common = Counter(a for a in answers if a is not None).most_common(1)
    return {
        "answers": len(answers),
        "answered": sum(a is not None for a in answers),
        "distinct_answers": len({a for a in answers if a is not None}),
        "reference_distinct_answers": len(references - {None}),
        "most_common_answer": _describe(common[0][0]) if common else None,
        "most_common_count": common[0][1] if common else 0,
        "adherence": sum(judged) / len(judged) if judged else None,
        "adherence_means": getattr(task_module, "ADHERENCE_MEANS", None),
        "answers_mean": getattr(task_module, "SIGNATURE_MEANS", "answers"),
    }


def _describe(answer) -> str:
    return answer.describe() if hasattr(answer, "describe") else _shorten(str(answer), 120)


def _following_findings(following: dict) -> list[tuple[str, str]]:
    found = []
    adherence, n = following["adherence"], following["answers"]
    if adherence is not None and adherence < ADHERENCE_OK:
        found.append((WEAK, f"Only {adherence:.0%} of the {n} greedy answers match {following['adherence_means']} "
                            f"(ok needs {ADHERENCE_OK:.0%}): it does not do what the prompts ask."))
    distinct, wanted = following["distinct_answers"], following["reference_distinct_answers"]
    if (wanted >= DIVERSITY_MIN_REFERENCES and following["answered"] * 2 >= n
            and distinct <= DIVERSITY_SHARE * wanted):
        found.append((WEAK, f"Its {n} greedy answers hold {distinct} different {following['answers_mean']}, where "
                            f"the references hold {wanted}: it answers much the same whatever the prompt asks "
                            f"({following['most_common_count']} of {n}: {following['most_common_answer']})."))
    return found


# ------------------------------------------------------------------------------------------ base vs adapter

# (label, key, format) of the sanity rows in the table.
_SANITY_ROWS = [
    ("verdict", "verdict", "{}"),
    ("most common output: share", "most_common_share", "{:.0%}"),
    ("most common output: prompts", "most_common_prompts", "{}"),
    (f"repeated {NGRAM}-grams", "repeated_ngram_rate", "{:.0%}"),
    ("ended with EOS", "eos_rate", "{:.0%}"),
    ("mean new tokens", "mean_new_tokens", "{:.1f}"),
]


def _fmt(template: str, value) -> str:
    return "n/a" if value is None else template.format(value)


@dataclass
class ComparisonReport:
    base: dict                      # sanity_report of the base model's generations
    adapter: dict                   # sanity_report of the adapter's
    base_task: dict | None          # task summary (freetune.tasks.<task>.summarise), None without a task
    adapter_task: dict | None
    task: str | None
    prompts: list[str]              # the last user turn of each prompt, for display
    references: list[str | None]
    base_generations: list[Generation]
    adapter_generations: list[Generation]
    adapter_dir: str | None = None
    base_text: dict | None = None     # any task: exact match and similarity to the references (summarise_metrics)
    adapter_text: dict | None = None

    @property
    def collapsed(self) -> bool:
        return self.adapter["verdict"] == "collapsed"

    def examples(self) -> list[dict]:
        """Per prompt: prompt, base, adapter (greedy outputs, else the first sample) and reference.
        Ready for freetune.tasks.svg.side_by_side_png."""
        def pick(generations):
            chosen = {}
            for g in generations:
                if g.mode == "greedy" or g.prompt_index not in chosen:
                    chosen[g.prompt_index] = g.text
            return chosen
        base, adapter = pick(self.base_generations), pick(self.adapter_generations)
        return [{"prompt": p, "base": base.get(i), "adapter": adapter.get(i), "reference": self.references[i]}
                for i, p in enumerate(self.prompts)]

    def rows(self) -> list[tuple[str, str, str]]:
        """(metric, base, adapter) rows: the sanity numbers, then the task metrics."""
        rows = [(label, _fmt(f, self.base[key]), _fmt(f, self.adapter[key])) for label, key, f in _SANITY_ROWS]
        rows += self._per_prompt_rows()
        rows += self._following_rows()
        for key, label in (("exact_match", "answer = reference"), ("similarity", "similarity to reference")):
            if self.adapter_text and self.adapter_text.get(key) is not None:
                base = (self.base_text or {}).get(key)
                rows.append((label, _fmt("{:.0%}", base), _fmt("{:.0%}", self.adapter_text[key])))
        if self.base_task and self.adapter_task:
            for key, value in self.adapter_task.items():
                if key == "outputs":
                    continue
                is_rate = not key.endswith(("violations", "entities"))
                f = "{:.0%}" if is_rate else "{:.2f} per output"
                rows.append((f"{self.task}: {key}", _fmt(f, self.base_task.get(key)), _fmt(f, value)))
        return rows

    def _per_prompt_rows(self) -> list[tuple[str, str, str]]:
        """How often a prompt asked again got a different answer: "1.0 of 4" is a model sure of its answer (a share
        of distinct outputs over all prompts read 25% there, like a fault)."""
        tries = self.adapter["generations"] / self.adapter["prompts"]
        if tries < 2 or "answers_per_prompt" not in self.adapter:
            return []
        label = f"different answers to one prompt asked {tries:g} times (greedy + samples)"
        return [(label, *(f"{getattr(self, side)['answers_per_prompt']:.1f} of {tries:g}" for side in ("base",
                                                                                                         "adapter")))]

    def _following_rows(self) -> list[tuple[str, str, str]]:
        base, adapter = self.base.get("following"), self.adapter.get("following")
        if not base or not adapter:
            return []
        rows = []
        if adapter["adherence"] is not None:
            rows.append(("does what was asked (greedy)", _fmt("{:.0%}", base["adherence"]),
                         _fmt("{:.0%}", adapter["adherence"])))
        wanted = adapter["reference_distinct_answers"]
        rows.append((f"different {adapter['answers_mean']}, greedy (references: {wanted})",
                     f"{base['distinct_answers']} of {base['answers']}", f"{adapter['distinct_answers']} of "
                     f"{adapter['answers']}"))
        return rows

    def table(self) -> str:
        """A plain-text table, base vs adapter columns, then the verdict and warnings in words."""
        rows = [("metric", "base", "adapter")] + self.rows()
        widths = [max(len(r[c]) for r in rows) for c in range(3)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        for side in ("base", "adapter"):
            report = getattr(self, side)
            lines.append(f"{side}: {report['verdict'].upper()}: {report['reason']}")
            lines += [f"{side}: warning: {w}" for w in report["warnings"]]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"task": self.task, "adapter_dir": self.adapter_dir, "base": self.base, "adapter": self.adapter,
                "base_task": self.base_task, "adapter_task": self.adapter_task, "base_text": self.base_text,
                "adapter_text": self.adapter_text, "examples": self.examples(),
                "base_generations": [asdict(g) for g in self.base_generations],
                "adapter_generations": [asdict(g) for g in self.adapter_generations]}

    def _repr_html_(self) -> str:
        esc = html.escape
        out = []
        if self.collapsed:
            out.append(f'<div style="background:#fdd;border:2px solid #c00;padding:8px;margin:4px 0">'
                       f'<b>The adapter has COLLAPSED</b>: {esc(self.adapter["reason"])}<pre style="white-space:'
                       f'pre-wrap">{esc(_shorten(self.adapter["most_common_output"], 1000))}</pre></div>')
        out.append("<table><thead><tr><th>metric</th><th>base</th><th>adapter</th></tr></thead><tbody>")
        for label, base, adapter in self.rows():
            style = ' style="color:#c00;font-weight:bold"' if adapter == COLLAPSED else (
                ' style="color:#b60"' if adapter == WEAK else "")
            out.append(f"<tr><td>{esc(label)}</td><td>{esc(base)}</td><td{style}>{esc(adapter)}</td></tr>")
        out.append("</tbody></table>")
        for side in ("base", "adapter"):
            report = getattr(self, side)
            out.append(f"<p><b>{side}</b>: {esc(report['verdict'])}: {esc(report['reason'])}</p>")
            out += [f"<p>⚠ {side}: {esc(w)}</p>" for w in report["warnings"]]
        return "\n".join(out)

    def __repr__(self) -> str:
        return self.table()


def _last_user_turn(messages: list[dict]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    return users[-1] if users else messages[-1]["content"]


def compare_model(model, tokenizer, rows, *, task: str | ModuleType | None = None, greedy: bool = True,
                  seeds=(0, 1, 2), temperature: float = 0.7, max_new_tokens: int = 256,
                  batch_size: int = 8, adapter_dir: str | None = None) -> ComparisonReport:
    """Base vs adapter on an already loaded peft model (the notebook's trained model, or one compare loaded).

    rows: normalised rows (freetune.data.normalize); each gives a prompt and the reference answer.
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise FreetuneError(
            f"compare needs the model with its LoRA adapter attached (a peft PeftModel), got "
            f"{type(model).__name__}. Pass the trained model before merging, or use compare(base, adapter_dir, ...).")
    task_module = load_task(task)
    rows = [dict(row) for row in rows]
    prompts = [prompt_messages(row) for row in rows]
    options = dict(greedy=greedy, seeds=seeds, temperature=temperature, max_new_tokens=max_new_tokens,
                   batch_size=batch_size)
    print(f"Generating from {len(rows)} held-out prompt(s), with the adapter and without ...", flush=True)
    adapter_generations = generate(model, tokenizer, prompts, **options)
    with model.disable_adapter():
        base_generations = generate(model, tokenizer, prompts, **options)
    return judge(rows, base_generations, adapter_generations, task=task_module, adapter_dir=adapter_dir)


def judge(rows, base_generations: list[Generation], adapter_generations: list[Generation], *,
          task: str | ModuleType | None = None, adapter_dir: str | None = None) -> ComparisonReport:
    """The report on generations already made (compare_model's, or ones saved with to_dict): sanity numbers,
    task metrics against each row's reference, and one verdict per model. Needs no model, so a saved run can be
    judged again by a newer freetune."""
    task_module = load_task(task)
    rows = [dict(row) for row in rows]
    references = [completion_text(row) for row in rows]

    def judged(generations):
        task_metrics = ([task_module.metrics(g.text, rows[g.prompt_index]) for g in generations]
                        if task_module else [])
        text_metrics = [reference_metrics(g.text, references[g.prompt_index]) for g in generations]
        following = prompt_following(generations, rows, task_metrics, task_module)
        summary = task_module.summarise(task_metrics) if task_module else None
        return summary, summarise_metrics(text_metrics), sanity_report(generations, references, following=following)

    base_task, base_text, base = judged(base_generations)
    adapter_task, adapter_text, adapter = judged(adapter_generations)
    return ComparisonReport(
        base=base, adapter=adapter, base_task=base_task, adapter_task=adapter_task,
        task=task_module.__name__.rsplit(".", 1)[-1] if task_module else None,
        prompts=[_last_user_turn(prompt_messages(row)) for row in rows], references=references,
        base_generations=base_generations, adapter_generations=adapter_generations, adapter_dir=adapter_dir,
        base_text=base_text, adapter_text=adapter_text)


def resolve_adapter_dir(adapter_dir: str | Path) -> Path:
    """The folder itself when it holds an adapter (final folder or a Trainer checkpoint-N), else a FreetuneError
    that says which folder to pass instead."""
    path = Path(adapter_dir).expanduser()
    if not path.is_dir():
        raise FreetuneError(f"Adapter folder {str(path)!r} does not exist. Point `adapter_dir` at the folder "
                            f"training saved (output_dir, or one of its checkpoint-N folders).")
    if (path / "adapter_config.json").exists():
        return path
    checkpoints = sorted((p for p in path.glob("checkpoint-*") if (p / "adapter_config.json").exists()),
                         key=lambda p: -1 if checkpoint_step(p) is None else checkpoint_step(p))
    if checkpoints:
        names = ", ".join(p.name for p in checkpoints)
        raise FreetuneError(f"{str(path)!r} holds no adapter of its own (no adapter_config.json), but has saved "
                            f"checkpoints: {names}. Pass one of them, e.g. {str(checkpoints[-1])!r} (the newest).")
    if (path / "config.json").exists():
        raise FreetuneError(f"{str(path)!r} is a full model, not a LoRA adapter (no adapter_config.json). The "
                            f"sanity check compares a base model with an adapter: pass the adapter folder.")
    raise FreetuneError(f"{str(path)!r} holds no adapter (no adapter_config.json). Pass the folder training "
                        f"saved the adapter to, or one of its checkpoint-N folders.")


def load_for_comparison(base_model: str | Path, adapter_dir: str | Path, plan=None):
    """(peft model, tokenizer): the base 4-bit on a GPU (as it trained) or fp32 on a CPU, the adapter on top.

    plan: the run's freetune.plan.Plan, for its compute dtype (read from this machine when None).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    adapter_dir = resolve_adapter_dir(adapter_dir)
    if torch.cuda.is_available():
        from freetune.model import nf4_config
        from freetune.plan import make_plan

        dtype = (plan or make_plan()).torch_dtype
        kwargs = dict(dtype=dtype, device_map={"": torch.cuda.current_device()}, quantization_config=nf4_config(dtype))
    else:  # bf16 matmuls are slow on most CPUs, and 4-bit brings nothing where memory is plentiful
        kwargs = dict(dtype=torch.float32)
    print(f"Loading {base_model} with the trained adapter ...", flush=True)
    base = AutoModelForCausalLM.from_pretrained(str(base_model), **kwargs)
    try:
        model = PeftModel.from_pretrained(base, str(adapter_dir))
    except Exception as exc:
        trained_on = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise FreetuneError(
            f"Could not put the adapter {str(adapter_dir)!r} on {str(base_model)!r}: {type(exc).__name__}: "
            f"{str(exc)[:300]}. The adapter was trained on {trained_on!r}: pass that model as the base.") from exc
    # A Trainer checkpoint saves the tokenizer training used (chat template, pad token): prefer it.
    tokenizer_source = adapter_dir if (adapter_dir / "tokenizer_config.json").exists() else base_model
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_source))
    return model, tokenizer


def compare(base_model: str | Path, adapter_dir: str | Path, rows, *, task: str | ModuleType | None = None,
            greedy: bool = True, seeds=(0, 1, 2), temperature: float = 0.7, max_new_tokens: int = 256,
            batch_size: int = 8, plan=None) -> ComparisonReport:
    """Load the base model and the adapter (final folder or checkpoint-N) and compare their generations.

    base_model: the folder or hub id training started from. rows: normalised rows with varied prompts (a few
    held-out ones; 8 is plenty). task: "svg", "home_assistant" or None for the sanity numbers only.
    This loads a second copy of the base: free the training model first on a small GPU, or call
    compare_model on the model already in memory.
    """
    adapter_dir = resolve_adapter_dir(adapter_dir)
    model, tokenizer = load_for_comparison(base_model, adapter_dir, plan=plan)
    try:
        return compare_model(model, tokenizer, rows, task=task, greedy=greedy, seeds=seeds,
                             temperature=temperature, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             adapter_dir=str(adapter_dir))
    finally:
        del model
        release_memory()


def pick_rows(dataset, n: int) -> list[dict]:
    """n rows spread evenly over the data set (deterministic), so the prompts are varied, not the first few."""
    total = len(dataset)
    if n >= total:
        return [dict(dataset[i]) for i in range(total)]
    return [dict(dataset[i * total // n]) for i in range(n)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m freetune.sanity", formatter_class=argparse.RawDescriptionHelpFormatter,
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
