"""The rows as TRL's SFTTrainer tokenises them, and the findings on their tokens: no answer tokens left after
truncation, rows longer than max_length, the EOS not trained on, the pad token equal to EOS.

Conversational rows are rendered with the tokenizer's chat template (the prompt with the generation prompt, and
the full conversation), tokenised, and the completion starts where the two agree; plain `prompt`/`completion`
strings are tokenised as text with EOS appended, as TRL does (no chat template); `messages` rows with
assistant-only loss use TRL's assistant mask (its training chat template's {% generation %} spans). Truncation
keeps the start (`truncation_mode="keep_start"`).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress

from freetune.audit.findings import BLOCKING, WARNING, Finding, _n, _nearest_rank, _share
from freetune.audit.twin import _Encoder
from freetune.errors import FreetuneError


TOKENIZE_BATCH = 2048     # rows per tokeniser call: big enough for the Rust side's threads, small for memory


def _load_tokenizer(tokenizer):
    """A tokenizer as given, or loaded from a model folder / hub id as training loads it."""
    if not isinstance(tokenizer, str):
        return tokenizer
    from freetune.model import load_tokenizer

    return load_tokenizer(tokenizer)


def _conversations(rows: list[dict], shape: str) -> tuple[list[list[dict]], list[list[dict]]]:
    """(prompt turns, full conversation) per row, as TRL hands them to the chat template."""
    prompts, fulls = [], []
    for row in rows:
        if shape == "messages":
            turns = [m for m in row["messages"] if isinstance(m, dict)]
            last = max((i for i, m in enumerate(turns) if m.get("role") == "assistant"), default=len(turns))
            prompts.append(turns[:last])
            fulls.append(turns)
        else:  # prompt/completion as message lists
            completion = row["completion"] or []
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": completion}]
            prompts.append(list(row["prompt"] or []))
            fulls.append(list(row["prompt"] or []) + list(completion))
    return prompts, fulls


def _require_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise FreetuneError("This data set is conversational but the tokenizer has no chat template, so TRL could "
                            "not render it. Use an instruct model's tokenizer, or set tokenizer.chat_template.")


def _training_template(tokenizer) -> str | None:
    """The template TRL trains with under assistant_only_loss (one with {% generation %} markers); None when TRL
    is not installed (the audit then counts the last assistant turn). Refused, naming the `chat_template` to set,
    when TRL cannot patch it."""
    from freetune.templates import training_template

    return training_template(tokenizer)


def _completion_starts(encode: _Encoder, prompts: list[str], fulls: list[str], special: bool):
    """(input ids, where the completion starts) per row: where the tokenised prompt and prompt + completion stop
    agreeing, as TRL computes it (a token merging across the boundary belongs to the completion)."""
    full_ids = encode(fulls, special)
    prompt_ids = encode(prompts, special)
    return full_ids, [_common_prefix(p, f) for p, f in zip(prompt_ids, full_ids)]


def _common_prefix(a, b) -> int:
    """How many ids two lists (or numpy arrays, from the twin) share at the start."""
    n = min(len(a), len(b))
    if not isinstance(a, list):
        differ = (a[:n] != b[:n]).nonzero()[0]
        return int(differ[0]) if len(differ) else n
    if a[:n] == b[:n]:
        return n
    return next(i for i in range(n) if a[i] != b[i])


def _tokenised(tokenizer, rows: list[dict], shape: str, assistant_only: bool):
    """(batches, loss_on, encoder): batches yield (input ids, trained) per row, built the way TRL's SFTTrainer
    builds them, where `trained` is the index the completion starts at or a 0/1 loss mask. loss_on says what
    the loss is on: "completion", "assistant turns" or "all tokens"."""
    encode = _Encoder(tokenizer)
    if shape == "prompt_completion":
        # Plain strings are not chats to TRL: it tokenises prompt and prompt + completion + EOS as text.
        eos = tokenizer.eos_token or ""

        def plain_batches():
            for start in range(0, len(rows), TOKENIZE_BATCH):
                chunk = rows[start:start + TOKENIZE_BATCH]
                prompts = [row["prompt"] or "" for row in chunk]
                fulls = [p + (c if c.endswith(eos) else c + eos)
                         for p, c in zip(prompts, (row["completion"] or "" for row in chunk))]
                yield _completion_starts(encode, prompts, fulls, True)

        return plain_batches(), "completion", encode
    _require_template(tokenizer)
    template = _training_template(tokenizer) if shape == "messages" and assistant_only else None
    loss_on = ("all tokens" if shape == "messages" and not assistant_only
               else "assistant turns" if template is not None else "completion")

    def chat_batches():
        for start in range(0, len(rows), TOKENIZE_BATCH):
            prompt_turns, full_turns = _conversations(rows[start:start + TOKENIZE_BATCH], shape)
            if loss_on == "assistant turns":
                # transformers maps the template's {% generation %} spans to tokens, exactly as TRL asks it to.
                out = tokenizer.apply_chat_template(full_turns, chat_template=template, tokenize=True,
                                                    return_dict=True, return_assistant_tokens_mask=True)
                yield out["input_ids"], out["assistant_masks"]
                continue
            # Whole lists per call: transformers renders each conversation in one loop.
            fulls = tokenizer.apply_chat_template(full_turns, tokenize=False)
            if loss_on == "all tokens":
                ids = encode(fulls, False)
                yield ids, [0] * len(ids)
            else:
                prompts = tokenizer.apply_chat_template(prompt_turns, tokenize=False, add_generation_prompt=True)
                yield _completion_starts(encode, prompts, fulls, False)

    return chat_batches(), loss_on, encode


def _holds(ids, token: int | None, start: int, end: int) -> bool:
    """Whether ids[start:end] (a list, or a numpy array from the twin) holds the token (the EOS is usually last:
    looked at first)."""
    if token is None:
        return False
    return bool(ids[end - 1] == token) or token in ids[start:end]


@dataclass
class RowTokens:
    """Per row, what the token rules judge: its tokens, its trained tokens, whether the EOS is among them, and the
    last trained ids of a row left whole (None otherwise). A subset of the same rows tokenises the same, so the
    audit of the cleaned rows (audit_and_clean) takes the kept rows' values instead of tokenising them again."""

    lengths: list[int]
    trainable: list[int]
    has_eos: list[bool]
    tails: list[tuple[int, ...] | None]
    loss_on: str
    engine: str
    setup: tuple  # (tokenizer, shape, max_length, assistant_only): the values hold only for these

    def subset(self, keep: list[int]) -> "RowTokens":
        pick = [self.lengths, self.trainable, self.has_eos, self.tails]
        return RowTokens(*([values[i] for i in keep] for values in pick), self.loss_on, self.engine, self.setup)


def _row_tokens(tokenizer, rows: list[dict], shape: str, max_length: int | None, assistant_only: bool
                ) -> RowTokens:
    eos_id = tokenizer.eos_token_id
    lengths, trainable, has_eos, tails = [], [], [], []
    batches, loss_on, encoder = _tokenised(tokenizer, rows, shape, assistant_only)
    for ids_batch, trained_batch in batches:
        for ids, trained_spec in zip(ids_batch, trained_batch):
            end = len(ids) if max_length is None else min(len(ids), max_length)
            lengths.append(len(ids))
            if isinstance(trained_spec, int):  # no copy of the ids: most rows are only counted
                count = max(0, end - trained_spec)
                trainable.append(count)
                has_eos.append(count > 0 and _holds(ids, eos_id, trained_spec, end))
                whole = count and end == len(ids)
                tails.append(tuple(int(i) for i in ids[max(trained_spec, end - 3):end]) if whole else None)
                continue
            trained = list(compress(ids[:end], trained_spec[:end]))
            trainable.append(len(trained))
            has_eos.append(eos_id is not None and eos_id in trained)
            tails.append(tuple(trained[-3:]) if trained and end == len(ids) else None)
    return RowTokens(lengths, trainable, has_eos, tails, loss_on, encoder.engine,
                     (tokenizer, shape, max_length, assistant_only))


def _token_findings(tokenizer, row_tokens: RowTokens, max_length: int | None) -> tuple[list[Finding], dict]:
    lengths, trainable, has_eos = row_tokens.lengths, row_tokens.trainable, row_tokens.has_eos
    eos_id = tokenizer.eos_token_id
    # the last trained tokens of the first row left whole: shows what the labels end with
    tail = next((t for t in row_tokens.tails if t is not None), None)
    n = len(lengths)
    truncated = [i for i, length in enumerate(lengths) if max_length is not None and length > max_length]
    none = [i for i, t in enumerate(trainable) if t == 0]
    truncated_set = set(truncated)
    no_eos = [i for i, ok in enumerate(has_eos) if not ok and i not in truncated_set]
    pad_id = tokenizer.pad_token_id
    pad_is_eos = pad_id is None or pad_id == eos_id
    labels_end = tokenizer.decode(list(tail)) if tail else ""
    ordered, trained_sorted = sorted(lengths), sorted(trainable)
    stats = {
        "loss_on": row_tokens.loss_on,
        "max_length": max_length,
        "sequence_tokens": {"min": ordered[0], "median": _nearest_rank(ordered, 0.5),
                            "p95": _nearest_rank(ordered, 0.95), "max": ordered[-1], "total": sum(ordered)},
        "trainable_tokens": {"min": trained_sorted[0], "median": _nearest_rank(trained_sorted, 0.5),
                             "max": trained_sorted[-1], "total": sum(trained_sorted)},
        "truncated_rows": len(truncated) if max_length is not None else None,
        "truncated_share": _share(len(truncated), n) if max_length is not None else None,
        "no_trainable_rows": len(none),
        "eos_token": tokenizer.eos_token,
        "eos_in_labels_rows": sum(has_eos),
        "pad_token": tokenizer.pad_token,
        "pad_is_eos": pad_is_eos,
        "labels_end_example": labels_end,
    }
    findings = []
    if none:
        findings.append(Finding(
            "no_trainable_tokens", "no_trainable_tokens", BLOCKING, "no trainable tokens",
            f"{_n(len(none), 'row')} with no answer tokens left after truncation to max_length={max_length}: TRL "
            f"drops them silently. Raise `max_length` or shorten their prompts.", none, len(none)))
    if truncated:
        lost_eos = sum(1 for i in truncated if not has_eos[i])
        findings.append(Finding(
            "truncated", "truncated", WARNING, "longer than max_length",
            f"{_n(len(truncated), 'row')} longer than max_length={max_length} (longest {ordered[-1]:,} tokens): "
            f"their answers are cut, {lost_eos:,} lose the EOS. Raise `max_length` if memory allows.",
            truncated, len(truncated), {"lost_eos": lost_eos}))
    if no_eos:
        findings.append(Finding(
            "eos_not_in_labels", "eos_not_in_labels", WARNING, "EOS not trained on",
            f"EOS {tokenizer.eos_token!r} is not among the trained tokens of {_n(len(no_eos), 'untruncated row')} "
            f"(the labels end like {labels_end!r}): the model may never learn to stop. Use a chat template that "
            f"closes the answer with EOS, or set the tokenizer's eos_token to the turn's end token.",
            no_eos, len(no_eos)))
    if pad_is_eos:
        findings.append(Finding(
            "pad_is_eos", "pad_is_eos", WARNING, "pad token is EOS",
            f"The pad token is {'unset (TRL pads with EOS)' if pad_id is None else 'the EOS token'}: collators "
            f"that mask pad ids (transformers' DataCollatorForLanguageModeling) also mask every EOS, and the model "
            f"never learns to stop. TRL's collator masks by position, so it is safe there; set a distinct pad "
            f"token to be safe everywhere.", [], 0))
    return findings, stats
