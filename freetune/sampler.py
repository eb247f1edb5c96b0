"""Which rows each rank trains on: every optimizer step's rows dealt out to the ranks with equal tokens each.

Under DDP (and FSDP) the gradients are averaged once per optimizer step, so every rank waits for the one with the
most tokens. With 8 random rows of 300-1,200 tokens per rank, two ranks' token counts differ by ~15% of the mean, so
the slower one has ~7% more. `RankBalancedSampler` deals each optimizer step's rows (the same random rows any GPU
count would take) out to the ranks so their token counts are equal to within a row, each micro-batch still holding
exactly micro_batch rows (memory as planned). The plan chooses it under torchrun (freetune.choices.choose_sampler);
freetune.trainer.FreetuneTrainer hands it to the Trainer.
"""

from __future__ import annotations

import functools


def step_rows(order: list[int], lengths: list[int], ranks: int, grad_accum: int) -> list[list[list[int]]]:
    """One optimizer step's rows, `order` (dataset indices), dealt out as [rank][micro-batch] -> indices.

    Longest first, tier by tier (one row per rank per tier), the rank with the fewest tokens so far takes the
    tier's longest row: every rank ends within one row's length of the others. Each rank's rows are then cut into
    grad_accum micro-batches in that order, so a micro-batch holds rows of similar length (little padding), the
    same micro-batch of every rank holds rows of the same tiers, and every micro-batch has the same number of rows
    (len(order) / (ranks * grad_accum), the planned micro-batch)."""
    by_length = sorted(order, key=lambda i: (-lengths[i], i))
    rows = [[] for _ in range(ranks)]
    tokens = [0] * ranks
    for start in range(0, len(by_length), ranks):
        takers = sorted(range(ranks), key=lambda r: (tokens[r], r))
        for index, rank in zip(by_length[start:start + ranks], takers):
            rows[rank].append(index)
            tokens[rank] += lengths[index]
    out = []
    for mine in rows:
        cuts = [round(k * len(mine) / grad_accum) for k in range(grad_accum + 1)]
        out.append([mine[a:b] for a, b in zip(cuts, cuts[1:])])
    return out


@functools.cache
def _rank_balanced_sampler_class():
    # A subclass of transformers' BatchRebalanceSampler: the Trainer hands that class to the DataLoader as its
    # batch_sampler and keeps accelerate from sharding it again (it is rank-aware already). Its own assignment
    # sizes micro-batches by a padded-cost model (more rows where rows are short), which would break the plan's
    # memory budget; this one keeps every micro-batch at micro_batch rows.
    import math

    import torch
    from transformers.trainer_pt_utils import BatchRebalanceSampler, get_length_grouped_indices

    class RankBalancedSampler(BatchRebalanceSampler):
        """Every rank draws the same random permutation (same seed, no communication) and takes its share of each
        optimizer step's rows from `step_rows`. group_by_length: the permutation is length-grouped first (padded
        batches on GPUs without a variable-length kernel), so a step's rows have similar lengths."""

        def __init__(self, *args, group_by_length: bool = False, **kwargs):
            super().__init__(*args, **kwargs)
            self.group_by_length = group_by_length

        def __iter__(self):
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            n = len(self.lengths)
            if self.group_by_length:
                order = get_length_grouped_indices(self.lengths, self.effective_batch_size, generator=g)
            elif self.shuffle:
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            size = self.effective_batch_size
            for step in range(self.num_global_batches):
                rows = order[step * size:(step + 1) * size]
                short = self.dp_size * self.grad_accum - len(rows)
                if short > 0:  # the last, partial step (drop_last off): at least one row per micro-batch
                    rows = rows + (order * math.ceil(short / n))[:short]
                yield from self._yield_global_batch(rows)

        def _assign(self, indices, lengths):
            # step_rows looks lengths up by dataset index (a padded last step may repeat an index).
            return step_rows(list(indices), self.lengths, self.dp_size, self.grad_accum)

    return RankBalancedSampler


def rank_balanced_sampler(dataset, args, group_by_length: bool = False):
    """The sampler for a Trainer's training set under torchrun (args: its TrainingArguments)."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    world = max(1, args.world_size)
    return _rank_balanced_sampler_class()(
        lengths=lengths, effective_batch_size=args.train_batch_size * args.gradient_accumulation_steps * world,
        dp_size=world, grad_accum=args.gradient_accumulation_steps, rank=args.process_index,
        seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
        group_by_length=group_by_length)

