"""Answers in another language than the rest: a Chinese paragraph among English answers (a bilingual teacher
model drifting), a Spanish answer to an English question. Told apart by script (CJK, Cyrillic, Arabic, ...) and,
among Latin-script languages, by their commonest words; no model, a few microseconds a row.

A judgement, never a drop: multilingual and translation sets exist. An answer counts only when the data set has one
clear language (MAJORITY_SHARE of the answers whose language is known) and the row's own prompt is not in the
answer's language (a question asked in Spanish may be answered in Spanish)."""

from __future__ import annotations

import re
from collections import Counter

from freetune.audit.findings import WARNING, Finding, _cut, _n

SAMPLE_CHARS = 200
MAJORITY_SHARE = 0.9
MIN_KNOWN = 20
OTHER_LANGUAGE_SHARE = 0.1   # more answers in other languages than this: a multilingual set, not a slip
PROMPTS_POOLED = 300
MIN_HITS = 3              # common words a Latin-script text must have to be given a language

SCRIPTS = {
    "Chinese/Japanese": re.compile(r"[\u3040-\u30ff\u4e00-\u9fff]"),
    "Korean": re.compile(r"[\uac00-\ud7af]"),
    "Cyrillic": re.compile(r"[\u0400-\u04ff]"),
    "Arabic": re.compile(r"[\u0600-\u06ff]"),
    "Devanagari": re.compile(r"[\u0900-\u097f]"),
    "Greek": re.compile(r"[\u0370-\u03ff]"),
    "Hebrew": re.compile(r"[\u0590-\u05ff]"),
    "Thai": re.compile(r"[\u0e00-\u0e7f]"),
}
NON_LATIN = re.compile("|".join(p.pattern for p in SCRIPTS.values()))
WORD = re.compile(r"[a-zà-öø-ÿ]+")
COMMON_WORDS = {
    "English": "the and is of to you that with for are this it was be have not they what can your".split(),
    "Spanish": "el la de en los las que y es una por con para del se no lo su como más pero muy".split(),
    "French": "le la de en un les et est des une que pour dans vous pas du sur au ce qui avec sont il".split(),
    "German": "der die das und ist nicht ein eine mit zu den sie ich auf für es sich auch von".split(),
    "Portuguese": "os da do que não uma com para em dos das é se mais como ao por você".split(),
    "Italian": "il di che è per una non sono gli della del le con si anche questo ma più".split(),
}
COMMON = frozenset(word for words in COMMON_WORDS.values() for word in words)
WORD_LANGUAGES: dict[str, list[str]] = {}
for _language, _words in COMMON_WORDS.items():
    for _word in _words:
        WORD_LANGUAGES.setdefault(_word, []).append(_language)


def language_of(text: str, sample_chars: int = SAMPLE_CHARS) -> str | None:
    """The text's language or script, or None when it has too few words to tell (code, numbers, labels)."""
    sample = text[:sample_chars]
    foreign = 0 if sample.isascii() else len(NON_LATIN.findall(sample))
    if foreign >= 5:
        counts = {name: len(p.findall(sample)) for name, p in SCRIPTS.items()}
        return max(counts, key=counts.get)
    words = WORD.findall(sample.lower())
    common = COMMON.intersection(words)  # in C: code, SVG and numbers share no word with the lists, and stop here
    if not common:
        return None
    hits: Counter = Counter()
    for word in words:
        if word in common:
            hits.update(WORD_LANGUAGES[word])
    if not hits:
        return None
    (best, n), *rest = hits.most_common(2) + [("", 0)]
    return best if n >= MIN_HITS and n >= 1.5 * rest[0][1] else None


def _majority(languages: list[str | None]) -> str | None:
    known = Counter(lang for lang in languages if lang)
    if sum(known.values()) < MIN_KNOWN:
        return None
    main, count = known.most_common(1)[0]
    return main if count >= MAJORITY_SHARE * sum(known.values()) else None


def language_finding(completions: list[str], requests: list[str]) -> tuple[Finding | None, str | None]:
    """(finding, the data set's language). The data set's language is its answers' (or, where answers are code,
    JSON or labels, its prompts'); a row is named when its answer is in another language than that and than its
    own prompt. When many rows are, the data is multilingual and nothing is named."""
    languages = [language_of(c) if c else None for c in completions]
    # Short prompts ("Draw design 5.") rarely tell their language one by one; a few hundred of them together do.
    main = (_majority(languages) or _majority([language_of(r) for r in requests[:PROMPTS_POOLED]])
            or language_of(" ".join(requests[:PROMPTS_POOLED]), 20_000))
    if main is None:
        return None, None
    rows = [i for i, lang in enumerate(languages) if lang and lang != main and language_of(requests[i]) != lang]
    if not rows or len(rows) > OTHER_LANGUAGE_SHARE * len(completions):
        return None, main
    found = Counter(languages[i] for i in rows)
    examples = [_cut(completions[i], 80) for i in rows[:3]]
    return Finding("language", "language", WARNING, "answer in another language",
                   f"{_n(len(rows), 'answer')} not in {main} like the rest ("
                   f"{', '.join(f'{k} {v}' for k, v in found.most_common())}) although their prompt is not either, "
                   f"e.g. {examples[0]!r}. Kept: check whether they belong.", rows, len(rows),
                   {"language": main, "found": dict(found), "examples": examples}), main
