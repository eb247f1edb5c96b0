"""Padding-free batches: a micro-batch's rows concatenated into one sequence, padded only to a multiple of 8 tokens.

A batch of rows of 300-1,200 tokens padded to its longest row is ~30% pad tokens, each costing a full forward and
backward. Padding-free, the micro-batch's rows are concatenated into one sequence with position_ids restarting at
0 per row (TRL's collator does this and adds the row boundaries, cu_seq_lens); transformers
(masking_utils.find_packed_sequence_indices) turns restarting position_ids into a block-diagonal causal mask, and
freetune.speed.attention's variable-length kernels take the row boundaries directly, so no token attends across rows:
the loss is the same as with padding. The concatenated row is padded to a multiple of 8 tokens by one row that trains
nothing (`AlignedPaddingFree`): compiled layers recompile whenever the length's remainder mod 8 changes. The plan
chooses the batching (freetune.plan.decisions.choose_batching); freetune.reach.trl.apply_batching switches TRL's collator to
it.
"""

from __future__ import annotations

BATCHING = ("padding_free", "grouped", "padded")

PAD_TO = 8  # padding-free sequences are padded to a multiple of this many tokens (AlignedPaddingFree)
PAD_KEY = "freetune_pad_tokens"  # batch key: how many of a padding-free batch's tokens are that padding


class AlignedPaddingFree:
    """TRL's padding-free collator, its one flat sequence padded to a multiple of PAD_TO tokens by one extra row
    that trains nothing (labels -100, positions restarting at 0, its own cu_seq_lens entry: attention keeps it
    apart). Why: compiled layers (torch.compile with dynamic shapes) guard on the token count's divisibility by 8
    (inductor's alignment assumptions), so an unaligned count meets a graph compiled for an aligned one and
    recompiles, mid-run, for seconds each (seen on an H200: one step in four slowed several times over).
    Always aligned, one graph serves every step. TRL's own pad_to_multiple_of pads with position 0 only, which
    makes every pad token a row of its own. At most PAD_TO - 1 tokens a micro-batch; their count travels in the
    batch under PAD_KEY for the token metrics; the trainer takes it out before the model sees the batch.

    multiple: a larger one (a whole micro-batch's worth of tokens) makes every batch the same length, as
    freetune.speed.cuda_graphs' CUDA graphs need; max_row then splits the padding into rows of at most that many tokens
    (the longest row the attention kernel is told of)."""

    def __init__(self, collator, multiple: int = PAD_TO, max_row: int | None = None):
        self.collator, self.multiple, self.max_row = collator, multiple, max_row

    def __getattr__(self, name):  # padding_free, pad_token_id, ...: what callers read from TRL's collator
        if name == "collator" or name.startswith("__"):  # not set yet (a copy or unpickling): no endless lookup
            raise AttributeError(name)
        return getattr(self.collator, name)

    def __call__(self, examples):
        import torch

        out = self.collator(examples)
        if "position_ids" in out and "cu_seq_lens_q" not in out:
            add_row_boundaries(out)
        length = out["input_ids"].size(1)
        pad = -length % self.multiple
        out[PAD_KEY] = pad
        if pad == 0:
            return out

        def extend(key, values):
            out[key] = torch.cat([out[key], values.to(out[key].dtype).reshape(1, -1)], dim=1)

        rows = pad_rows(pad, self.max_row)
        extend("input_ids", torch.full((pad,), self.collator.pad_token_id))
        extend("labels", torch.full((pad,), -100))
        extend("position_ids", torch.cat([torch.arange(n) for n in rows]))
        if "seq_idx" in out:
            first = int(out["seq_idx"].max()) + 1
            extend("seq_idx", torch.cat([torch.full((n,), first + j) for j, n in enumerate(rows)]))
        if "cu_seq_lens_q" in out:
            ends = torch.tensor(rows).cumsum(0) + length
            cu = torch.cat([out["cu_seq_lens_q"], ends.to(out["cu_seq_lens_q"].dtype)])
            out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
            out["max_length_q"] = out["max_length_k"] = max(out["max_length_q"], max(rows))
        return out


def add_row_boundaries(batch) -> None:
    """cu_seq_lens and max_length (q and k) from a padding-free batch's restarting position_ids, as TRL 1.16's
    collator adds them. TRL 1.15's adds none (written against 1.15.0 and 1.16.0): freetune's attention then took the
    sdpa path with a block-diagonal mask built in every layer, 3.7x slower on an H200 (docs/performance.md,
    issue 49)."""
    import torch

    starts = (batch["position_ids"][0] == 0).nonzero().flatten()
    cu = torch.cat([starts, torch.tensor([batch["position_ids"].size(1)])]).to(torch.int32)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
    batch["max_length_q"] = batch["max_length_k"] = int(cu.diff().max())


def pad_rows(pad: int, max_row: int | None = None) -> list[int]:
    """The lengths of the rows that make up `pad` padding tokens: one row, or rows of at most max_row tokens."""
    if not max_row or pad <= max_row:
        return [pad]
    return [max_row] * (pad // max_row) + ([pad % max_row] if pad % max_row else [])


def most_rows(micro_batch: int, multiple: int, max_row: int) -> int:
    """The most rows one padded padding-free batch holds: its own and the padding's."""
    return micro_batch + len(pad_rows(multiple - 1, max_row))


def padding_stats(batch) -> dict:
    """Real and pad tokens of one collated batch (what a forward pass computes on)."""
    ids = batch["input_ids"]
    computed = int(ids.numel())
    if "attention_mask" in batch:
        real = int(batch["attention_mask"].sum())
    else:  # padding-free: one row, its alignment padding counted by AlignedPaddingFree
        real = computed - int(batch.get(PAD_KEY, 0))
    return {"computed_tokens": computed, "real_tokens": real, "pad_tokens": computed - real}
