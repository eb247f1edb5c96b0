"""Which rows each rank trains on: every optimizer step's rows dealt out to the ranks with equal tokens each.

Under DDP (and FSDP) the gradients are averaged once per optimizer step, so every rank waits for the one with the
most tokens. With 8 random rows of 300-1,200 tokens per rank, two ranks' token counts differ by ~15% of the mean, so
the slower one has ~7% more. `RankBalancedSampler` deals each optimizer step's rows (the same random rows any GPU
count would take) out to the ranks so their token counts are equal to within a row, each micro-batch still holding
exactly micro_batch rows (memory as planned). The plan chooses it under torchrun (freetune.plan.decisions.choose_sampler);
freetune.trainer.FreetuneTrainer hands it to the Trainer.
"""

from __future__ import annotations

from freetune.distributed import print0
from freetune.reach.transformers import rank_balanced_sampler_class
from freetune.speed.feature import Feature


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


def _rank_balanced_sampler_class():
    """RankBalancedSampler: transformers' BatchRebalanceSampler dealing each step's rows by step_rows (the subclass
    overrides and calls its private methods: freetune.reach.transformers.rank_balanced_sampler_class)."""
    return rank_balanced_sampler_class(step_rows)


def rank_balanced_sampler(dataset, args, group_by_length: bool = False):
    """The sampler for a Trainer's training set under torchrun (args: its TrainingArguments)."""
    lengths = [len(ids) for ids in dataset["input_ids"]]
    world = max(1, args.world_size)
    return _rank_balanced_sampler_class()(
        lengths=lengths, effective_batch_size=args.train_batch_size * args.gradient_accumulation_steps * world,
        dp_size=world, grad_accum=args.gradient_accumulation_steps, rank=args.process_index,
        seed=args.data_seed if args.data_seed is not None else args.seed, drop_last=args.dataloader_drop_last,
        group_by_length=group_by_length)


def _applies(plan, trainer) -> tuple[bool, str]:
    # One process has no ranks to balance: the plan takes this sampler under torchrun only.
    return plan.layout.sampler == "rank_balanced" and trainer.args.world_size > 1, ""


def _install(trainer, plan) -> None:
    """FreetuneTrainer puts the sampler in (its _get_train_sampler); here it is said."""
    print0(f"Sampler: each optimizer step's rows are dealt to the {trainer.args.world_size} ranks by length, "
           f"equal tokens per rank (freetune.speed.sampler.RankBalancedSampler).")


FEATURE = Feature("Sampler", _applies, _install)
