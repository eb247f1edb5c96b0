"""Tokenising fast and exactly: a tiktoken twin of the tokenizer, used only once it has given the tokenizer's own ids.

Tokenising is most of the audit's work. Qwen's and Llama 3's tokenizers are byte-level BPE with a regex pre-split,
which tiktoken runs several times faster than the tokenizer's own backend (scripts/bench_audit.py times it), so the
audit builds a tiktoken twin of the tokenizer and uses it once it has produced exactly the tokenizer's ids on the
first rows and a probe string; any other tokenizer (or no tiktoken installed) goes through the tokenizer in
batches.

The twin encodes a whole batch of rows in one call, joined by a special token of its own (ROW_SEPARATOR), into one
numpy array: tiktoken encodes the text between two special tokens on its own, so each row's ids are exactly its
ids alone. One call per batch releases the GIL for the whole batch (one call per row handed the GIL back and forth
with the text rules running beside it, 200,000 times on 100,000 rows), and no Python int is made per token.
"""

from __future__ import annotations

import json
import os
import unicodedata
import weakref
from concurrent.futures import ThreadPoolExecutor


# A string that exercises what tokenisers disagree on: digits, accents, non-Latin scripts, runs of spaces and
# newlines, and special tokens inside text.
_PROBE = ("Héllo wörld  12345 ÅÅ ﬁ Ω≈ç √ 你好，世界 こんにちは 🙂🙂 \n\n\t  x  <|im_end|>\n<|im_start|>a"
          "'s 'LL won't   \r\n end")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: the printable character each byte is written as, mapped back to it."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + n): b for n, b in enumerate(others)}}


# Joins the rows of a batch: private-use characters no tokenizer's special token holds. A row that holds this string
# itself would make the separator count wrong; that batch is then encoded a row at a time (see _Encoder).
ROW_SEPARATOR = "\U0010fffd<freetune-row>\U0010fffd"

_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _split_pattern(pre_tokenizer: dict | None) -> str | None:
    """The regex a byte-level pre-tokeniser splits text with, or None for any other pre-tokeniser."""
    if pre_tokenizer is None:
        return None
    if pre_tokenizer.get("type") == "ByteLevel":
        return _GPT2_PATTERN if pre_tokenizer.get("use_regex") and not pre_tokenizer.get("add_prefix_space") else None
    if pre_tokenizer.get("type") != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers", [])
    if (len(steps) == 2 and steps[0].get("type") == "Split" and "Regex" in steps[0].get("pattern", {})
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
            and steps[1].get("type") == "ByteLevel" and not steps[1].get("use_regex")
            and not steps[1].get("add_prefix_space")):
        return steps[0]["pattern"]["Regex"]
    return None


def tiktoken_twin(tokenizer):
    """(a tiktoken Encoding with this tokenizer's vocabulary and split rules, why) or (None, why not).

    The audit uses the twin only after it produced exactly the tokenizer's ids on the audited rows themselves (see
    _Encoder).
    """
    try:
        import tiktoken
        from tokenizers import models, normalizers
    except ImportError:
        return None, "tiktoken is not installed"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None, "not a fast tokenizer"
    model = backend.model
    if not isinstance(model, models.BPE) or model.dropout or model.byte_fallback or model.continuing_subword_prefix \
            or model.end_of_word_suffix:
        return None, f"its model is not a plain byte-level BPE ({type(model).__name__})"
    normalizer = backend.normalizer
    if normalizer is not None and not isinstance(normalizer, normalizers.NFC):
        return None, f"its normaliser ({type(normalizer).__name__}) has no tiktoken equivalent"
    pre_tokenizer = backend.pre_tokenizer
    pattern = _split_pattern(json.loads(pre_tokenizer.__getstate__()) if pre_tokenizer is not None else None)
    if pattern is None:
        return None, "its pre-tokeniser is not a regex split with byte-level encoding"
    added = tokenizer.added_tokens_decoder
    if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
        return None, "some added tokens strip surrounding spaces, which tiktoken does not do"
    # Each token's characters back to its bytes: str.translate then latin-1 (a tenth of a bytes() per character
    # over 150,000 tokens); a character outside the alphabet becomes U+FFFF, which latin-1 refuses.
    to_bytes = {**dict.fromkeys(range(256), "\uffff"), **{ord(ch): chr(b) for ch, b in _byte_level_alphabet().items()}}
    try:
        ranks = {token.translate(to_bytes).encode("latin-1"): rank
                 for token, rank in backend.get_vocab(with_added_tokens=False).items()}
        specials = {t.content: i for i, t in added.items()}
        separator = max([*ranks.values(), *specials.values()]) + 1
        twin = tiktoken.Encoding("freetune-audit", pat_str=pattern, mergeable_ranks=ranks,
                                 special_tokens={**specials, ROW_SEPARATOR: separator})
    except ValueError as exc:  # a token outside the byte alphabet (UnicodeEncodeError); a regex tiktoken refuses
        return None, f"tiktoken cannot mirror it ({type(exc).__name__}: {str(exc)[:80]})"
    return twin, "tiktoken twin of the tokenizer"


_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _cached_twin(tokenizer):
    # Building the twin reads the whole vocabulary (a second or two): once per tokenizer, and again only when
    # tokens were added (audit_and_clean audits twice; a notebook may re-run the cell).
    try:
        size, twin, why = _TWINS[tokenizer]
        if size == len(tokenizer):
            return twin, why
    except (KeyError, TypeError):
        pass
    twin, why = tiktoken_twin(tokenizer)
    try:
        _TWINS[tokenizer] = (len(tokenizer), twin, why)
    except TypeError:  # not weak-referenceable: no cache
        pass
    return twin, why


class _Encoder:
    """Batch tokenisation with the tokenizer's fast backend, or with its tiktoken twin once the twin has given
    exactly the tokenizer's ids on a sample of the audited texts plus a probe string (checked per call shape)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.twin, self.looked = None, False   # the twin is built on first use: some paths never need it
        self.engine = "the tokenizer"
        self.verified: set[bool] = set()
        self.prefix: dict[bool, list[int]] = {}

    def _with_tokenizer(self, texts: list[str], special: bool) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=special, truncation=False, padding=False,
                              return_attention_mask=False)["input_ids"]

    def _with_twin(self, texts: list[str], special: bool) -> list:
        """Each text's ids, as a numpy array."""
        import numpy as np  # with tiktoken (its encode_to_numpy needs it too), not on import of the audit

        # What the tokenizer's post-processor adds to plain text (a BOS for Llama), checked like the rest.
        if special not in self.prefix:
            self.prefix[special] = self._with_tokenizer([""], special)[0]
        if self.tokenizer.backend_tokenizer.normalizer is not None:  # NFC: tiktoken_twin accepts no other
            texts = [unicodedata.normalize("NFC", t) for t in texts]
        # One slice per core rather than tiktoken's encode_batch, which pays a thread-pool future per text.
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        workers = min(cores, max(1, len(texts) // 256))
        size = -(-len(texts) // workers)
        slices = [texts[i:i + size] for i in range(0, len(texts), size)]
        if len(slices) == 1:
            ids = self._encode_joined(slices[0])
        else:
            with ThreadPoolExecutor(len(slices)) as pool:  # tiktoken releases the GIL while it encodes
                ids = [row for part in pool.map(self._encode_joined, slices) for row in part]
        prefix = self.prefix[special]
        if prefix:
            head = np.asarray(prefix, dtype=np.uint32)
            ids = [np.concatenate((head, row)) for row in ids]
        return ids

    def _encode_joined(self, texts: list[str]) -> list:
        """Each text's ids from one tiktoken call on the texts joined by ROW_SEPARATOR; one call per text when the
        twin has no separator (a twin made elsewhere), a text holds it, or a text is not valid UTF-8 (tiktoken's
        encode repairs lone surrogates, its encode_to_numpy does not)."""
        import numpy as np

        twin = self.twin
        if ROW_SEPARATOR in twin.special_tokens_set:
            try:
                flat = twin.encode_to_numpy(ROW_SEPARATOR.join(texts), allowed_special="all")
            except UnicodeEncodeError:
                flat = None
            if flat is not None:
                cuts = np.flatnonzero(flat == twin.encode_single_token(ROW_SEPARATOR))
                if len(cuts) == len(texts) - 1:
                    starts, ends = [0, *(cuts + 1).tolist()], [*cuts.tolist(), len(flat)]
                    return [flat[a:b] for a, b in zip(starts, ends)]
        text_specials = twin.special_tokens_set - {ROW_SEPARATOR}  # in a row's text it is plain text
        return [np.asarray(twin.encode(t, allowed_special=text_specials, disallowed_special=()), dtype=np.uint32)
                for t in texts]

    def __call__(self, texts: list[str], special: bool) -> list:
        """Each text's ids: a list from the tokenizer, a numpy array from the twin (same values either way)."""
        if not self.looked:
            self.looked = True
            self.twin, why = _cached_twin(self.tokenizer)
            if self.twin is None:
                self.engine = f"the tokenizer (no tiktoken twin: {why})"
        if self.twin is not None and special not in self.verified:
            sample = texts[:64] + [_PROBE]
            if [ids.tolist() for ids in self._with_twin(sample, special)] == self._with_tokenizer(sample, special):
                self.verified.add(special)
                self.engine = "tiktoken twin of the tokenizer (matched it on the first rows)"
            else:
                self.twin, self.engine = None, "the tokenizer (its tiktoken twin differed on the first rows)"
        return self._with_twin(texts, special) if self.twin is not None else self._with_tokenizer(texts, special)
