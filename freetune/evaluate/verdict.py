"""One verdict per model from its generations: collapse (one output answering most prompts), loops, no EOS, empty
outputs, and whether the greedy answers do what the prompts asked (the task's metrics against the references)."""

from __future__ import annotations

import functools
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from types import ModuleType

from freetune.data import completion_text
from freetune.errors import FreetuneError
from freetune.evaluate.generation import Generation
from freetune.tasks import normalise_answer


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
    texts, pids = [g.text for g in generations], [g.prompt_index for g in generations]
    n, n_prompts = len(texts), len(set(pids))
    overall = largest_cluster(texts, pids)
    greedy = [g for g in generations if g.mode == "greedy"]
    greedy_cluster = largest_cluster([g.text for g in greedy], [g.prompt_index for g in greedy])
    greedy_share = greedy_cluster.count / len(greedy) if greedy_cluster else 0.0

    threshold, reference_share = _collapse_threshold(references, collapse_share)
    share = overall.count / n
    collapsed = n_prompts >= 2 and share >= threshold and len(overall.prompts) >= 2
    if collapsed:
        shown = overall.text if overall.text.strip() else "(empty output)"
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
    found += _output_findings(eos_rate, ngram_rate, empty_share)
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


def _collapse_threshold(references: list[str] | None, collapse_share: float) -> tuple[float, float | None]:
    """(the share of one output that is collapse, the references' own most-common share or None): references whose
    right answers repeat raise the bar to their share + REFERENCE_MARGIN."""
    if not references or len(references) < 2:
        return collapse_share, None
    reference_share = largest_cluster(list(references), list(range(len(references)))).count / len(references)
    return max(collapse_share, reference_share + REFERENCE_MARGIN), reference_share


def _output_findings(eos_rate: float, ngram_rate: float, empty_share: float) -> list[tuple[str, str]]:
    """(WEAK, warning) for outputs that do not stop, loop, or are empty."""
    found = []
    if eos_rate < 0.5:
        found.append((WEAK, f"Only {eos_rate:.0%} of generations ended with EOS; the rest ran to max_new_tokens. "
                            f"Either max_new_tokens is too small for this task, or the model did not learn to stop "
                            f"(check that the EOS token is inside the labels and that pad is not the EOS token)."))
    if ngram_rate > 0.5:
        found.append((WEAK, f"{ngram_rate:.0%} of {NGRAM}-grams repeat within their output: the model loops."))
    if empty_share > 0.25:
        found.append((WEAK, f"{empty_share:.0%} of outputs are empty."))
    return found


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
