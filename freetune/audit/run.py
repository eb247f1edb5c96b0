"""audit(): every rule over a normalised data set, in order, into one AuditReport."""

from __future__ import annotations

import copy
import time
from concurrent.futures import ThreadPoolExecutor

from freetune.audit.findings import BLOCKING, Check, Finding, _nearest_rank
from freetune.audit.report import AuditReport
from freetune.audit.rows import _prompt_key, _request, _safe_completion, _safe_prompt, _shape
from freetune.audit.junk import cut_off_finding, echo_finding, endings, error_finding, error_kinds, refusal_finding
from freetune.audit.labels import balance_findings, balance_line, label_classes
from freetune.audit.language import language_finding
from freetune.audit.rules import (_answer_groups, _check_findings, _duplicate_findings, _empty_finding,
                                  _overlap_finding, _repeat_findings, _short_finding)
from freetune.audit.structure import malformed_finding, stand_in
from freetune.audit.tokens import _load_tokenizer, _row_tokens, _token_findings
from freetune.errors import FreetuneError


def audit(dataset, *, tokenizer=None, max_length: int | None = None, checks: dict[str, Check] | None = None,
          eval_dataset=None, min_completion_chars: int = 8, repeat_min_rows: int = 3,
          repeat_share_block: float = 0.005, assistant_only: bool = True, source: str | None = None,
          row_tokens=None) -> AuditReport:
    """Audit a normalised data set (see freetune.data.normalize); returns an AuditReport.

    tokenizer: a tokenizer, or a model folder / hub id to load it from as training does
        (freetune.model.load_tokenizer); None skips the token checks.
    max_length: the training max_length; rows longer are reported as truncated.
    checks: {name: check(row) -> None if fine, else a short reason}, e.g. freetune.tasks.svg.AUDIT_CHECKS.
    eval_dataset: the evaluation split (normalised); training rows whose prompt is in it are flagged.
    min_completion_chars: completions shorter than this (and non-empty) are reported as very short.
    repeat_min_rows: a completion in at least this many rows counts as repeated.
    repeat_share_block: a repeated short completion covering at least this share of rows is blocking.
    assistant_only: for `messages` rows, whether training puts the loss on assistant turns only (TRL's
        assistant_only_loss, counted with TRL's own assistant mask) or on every token. Pass what training uses.
    source: where the rows come from (the `dataset` parameter), named in messages about unreadable rows.
    row_tokens: these rows' token counts from an earlier audit of a superset (RowTokens.subset, as audit_and_clean
        passes them): used instead of tokenising again when they were counted with the same settings.
    """
    lap = _Laps()
    shape = _shape(dataset)
    if len(dataset) == 0:
        raise FreetuneError("The data set has no rows to audit. Check the `dataset` parameter and its split.")
    rows = dataset.to_list()
    completions = [_safe_completion(r) for r in rows]
    prompts = [_safe_prompt(r) for r in rows]
    asked = [_request(r) for r in rows]
    malformed = malformed_finding(rows, shape, source)
    if malformed is not None:  # the checks and the tokenizer read a stand-in; the malformed finding names the row
        unreadable = set(malformed.rows)
        rows = [stand_in(r, shape) if i in unreadable else r for i, r in enumerate(rows)]
    lap("read rows")

    with ThreadPoolExecutor(1) as pool:
        # Tokenising is most of the work and tiktoken and the Rust tokenizer release the GIL: it runs beside the
        # text rules and the recipe's checks (pure Python) instead of after them. "tokens" is the wait that is left.
        tokenizer = _load_tokenizer(tokenizer) if tokenizer is not None else None
        tokens = _count_tokens(pool, tokenizer, rows, (shape, max_length, assistant_only), row_tokens)
        findings, labels = _text_findings(completions, asked, _Turns(rows, completions, asked),
                                          min_completion_chars=min_completion_chars,
                                          repeat_min_rows=repeat_min_rows, repeat_share_block=repeat_share_block)
        findings += [malformed] if malformed is not None else []
        lap("text checks")

        findings += _check_findings(rows, dict(checks or {}))
        lap("recipe checks")

        token_stats, counted = None, None
        if tokens is not None:
            counted = tokens.result()
            token_findings, token_stats = _token_findings(tokenizer, counted, max_length)
            findings += token_findings
        lap("tokens")

    requests = asked.__getitem__  # a row's request, as the duplicate and overlap messages quote it
    invalid = {i for f in findings if f.severity == BLOCKING for i in f.rows}
    findings += _duplicate_findings(prompts, completions, invalid, requests)
    if eval_dataset is not None:
        findings += _eval_overlap(prompts, eval_dataset, requests)
    lap("duplicates")

    # Blocking first, then the biggest: the table reads in order of what to look at.
    findings.sort(key=lambda f: (f.severity != BLOCKING, -f.count, f.id))
    settings = {
        "max_length": max_length,
        "min_completion_chars": min_completion_chars,
        "repeat_min_rows": repeat_min_rows,
        "repeat_share_block": repeat_share_block,
        "assistant_only": assistant_only,
        "checks": sorted(checks or {}),
        "eval_rows": None if eval_dataset is None else len(eval_dataset),
        "tokenizer": _tokenizer_settings(tokenizer),
    }
    counts = _counts(findings, settings)
    lap.timings["total"] = sum(lap.timings.values())
    return AuditReport(len(rows), shape, settings, findings, _completion_chars(completions), token_stats, counts,
                       lap.timings, counted.engine if counted else None, labels, counted)


def _count_tokens(pool: ThreadPoolExecutor, tokenizer, rows: list[dict], how: tuple, earlier):
    """A future of the rows' RowTokens (None without a tokenizer): counted in the pool, or an earlier audit's counts
    of the same rows when they were counted the same way (`how`: shape, max_length, assistant_only)."""
    if tokenizer is None:
        return None
    if _counted_alike(earlier, (tokenizer, *how), len(rows)):
        return pool.submit(lambda: earlier)
    return pool.submit(_row_tokens, tokenizer, rows, *how)


def _counts(findings: list[Finding], settings: dict) -> dict[str, int | None]:
    """Rows per finding id, 0 for a check that ran and found nothing, None for one these settings could not run
    (no tokenizer, no max_length, no held-out rows)."""
    tokens = settings["tokenizer"] is not None
    measured = {"malformed": True, "refusal": True, "error_string": True, "cut_off": True, "echo": True,
                "language": True, "empty": True, "repeated": True, "repeated_other": True, "short": True,
                "duplicate": True, "conflict": True, "overlap": settings["eval_rows"] is not None,
                "no_trainable_tokens": tokens, "eos_not_in_labels": tokens,
                "truncated": tokens and settings["max_length"] is not None,
                **{f"check:{name}": True for name in settings["checks"]}}
    found = {f.id: f.count for f in findings}
    return {key: found.get(key, 0) if ok else None for key, ok in measured.items()}


def _counted_alike(row_tokens, setup: tuple, rows: int) -> bool:
    """Whether an earlier audit's token counts hold for these rows: the same tokenizer object, shape, max_length
    and loss, and one count per row."""
    return row_tokens is not None and len(row_tokens.lengths) == rows and all(
        a is b or a == b for a, b in zip(row_tokens.setup, setup))


class _Laps:
    """Seconds per phase of the audit (AuditReport.timings): lap("tokens") closes the phase that just ended."""

    def __init__(self):
        self.timings: dict[str, float] = {}
        self._clock = time.perf_counter()

    def __call__(self, phase: str) -> None:
        now = time.perf_counter()
        self.timings[phase] = now - self._clock
        self._clock = now


def _text_findings(completions: list[str], asked: list[str], turns: "_Turns", *, min_completion_chars: int,
                   repeat_min_rows: int, repeat_share_block: float) -> tuple[list[Finding], dict | None]:
    """(findings, the label set's classes or None): empty, repeated and very short answers, the junk real data
    carries, and for a label set its class balance. An answer counted as a junk repeat is not reported as short."""
    groups = _answer_groups(completions)
    # Junk named by what it says (a refusal, an error string) is not a class, however often it repeats.
    found: dict = {}
    content = _content_findings(turns, set(), found)
    named = {i for f in content for i in f.rows}
    label_groups = {t: kept for t, r in groups.items()
                    if (kept := r if named.isdisjoint(r) else [i for i in r if i not in named])}
    answered = sum(len(r) for r in label_groups.values())
    classes = label_classes(label_groups, answered, repeat_min_rows)
    repeats = _repeat_findings(completions, asked.__getitem__, repeat_min_rows=repeat_min_rows,
                               repeat_share_block=repeat_share_block, groups=groups, label_set=classes is not None,
                               yardstick=label_groups)
    stub = next((f for f in repeats if f.id == "repeated"), None)
    stub_rows = set(stub.rows) if stub else set()
    if stub_rows:  # the stub keeps its own finding (the 84 "No valid response from model." rows read as before)
        content = _content_findings(turns, stub_rows, found)
    found = [_empty_finding(completions), *repeats, *content]
    labels = None
    if classes is not None:
        found += balance_findings(classes, label_groups, answered, completions)
        labels = {"line": balance_line(classes, answered),
                  "classes": {text: len(rows) for text, rows in classes.items()}}
    else:
        found.append(_short_finding(completions, min_completion_chars, stub_rows))
    return [f for f in found if f is not None], labels


def _content_findings(turns: "_Turns", stub_rows: set[int], found: dict) -> list[Finding]:
    """Refusals, error strings, echoed prompts, other languages, then cut-off answers judged against the rows none
    of those explain; on rows. found: filled on the first call with what does not depend on stub_rows."""
    stub_turns = {t for t, row in enumerate(turns.rows) if row in stub_rows}
    if not found:
        found |= {"refusal": refusal_finding(turns.texts), "echo": echo_finding(turns.texts, turns.requests),
                  "language": language_finding(turns.texts, turns.requests)[0], "errors": error_kinds(turns.texts),
                  "endings": endings(turns.texts)}
    content = [found["refusal"], error_finding(turns.texts, found["errors"], stub_turns), found["echo"],
               found["language"]]
    explained = stub_turns | {t for f in content if f is not None for t in f.rows}
    cut_off = cut_off_finding(turns.texts, found["endings"], explained)
    return [turns.on_rows(copy.copy(f)) for f in (*content, cut_off) if f is not None]


class _Turns:
    """Every answer turn with the turn that asked for it: junk in any assistant turn of a conversation counts,
    not only in the last one. `rows[t]` is the row turn t belongs to."""

    def __init__(self, rows: list[dict], completions: list[str], asked: list[str]):
        self.texts, self.requests, self.rows = [], [], []
        for i, row in enumerate(rows):
            turns = row.get("messages") if isinstance(row.get("messages"), list) else None
            if turns is None:
                self.texts.append(completions[i].strip()), self.requests.append(asked[i]), self.rows.append(i)
                continue
            for k, turn in enumerate(turns):
                if isinstance(turn, dict) and turn.get("role") == "assistant" and isinstance(turn.get("content"), str):
                    before = turns[k - 1].get("content") if k and isinstance(turns[k - 1], dict) else ""
                    self.texts.append(turn["content"].strip())
                    self.requests.append(before if isinstance(before, str) else "")
                    self.rows.append(i)

    def on_rows(self, finding: Finding) -> Finding:
        rows = sorted({self.rows[t] for t in finding.rows})
        finding.rows, finding.count = rows, len(rows)
        return finding


def _eval_overlap(prompts: list[str], eval_dataset, requests) -> list[Finding]:
    _shape(eval_dataset)  # the evaluation split must be normalised too
    eval_prompts = {_prompt_key(_safe_prompt(r)) for r in eval_dataset.to_list()}
    overlap = _overlap_finding(prompts, eval_prompts, requests)
    return [overlap] if overlap is not None else []


def _tokenizer_settings(tokenizer) -> dict | None:
    # Class and special tokens, not name_or_path: a folder path would differ between machines.
    if tokenizer is None:
        return None
    return {"class": type(tokenizer).__name__, "vocab_size": len(tokenizer),
            "chat_template": bool(getattr(tokenizer, "chat_template", None)),
            "eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}


def _completion_chars(completions: list[str]) -> dict:
    lengths = sorted(len(c.strip()) for c in completions if c.strip())
    if not lengths:
        return {"min": 0, "median": 0, "max": 0}
    return {"min": lengths[0], "median": _nearest_rank(lengths, 0.5), "max": lengths[-1]}
