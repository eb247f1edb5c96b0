"""No rank waits for another at the all-reduce (issue 8): each optimizer step's rows are dealt out by length.

Under DDP (and FSDP) every rank waits at each optimizer step for the rank with the most tokens. freetune's
RankBalancedSampler (freetune.speed.sampler) gives every rank the same number of tokens to within one row, keeps every
micro-batch at the planned number of rows, and takes the same rows per optimizer step whatever the number of
ranks. Checked on the sampler itself over realistic row lengths, and through the Trainer under torchrun (gloo).
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import sampler_driver

DRIVER = Path(sampler_driver.__file__)


def sft_lengths(n: int, seed: int = 0) -> list[int]:
    """Row lengths like the benchmark's SFT rows: 300-1,200 tokens, cut at 1,024."""
    rng = random.Random(seed)
    return [min(rng.randint(300, 1200), 1024) for _ in range(n)]


def walk(lengths, ranks, grad_accum, micro_batch, group_by_length=False, epoch=0):
    """Every rank's micro-batches for one epoch, as the DataLoader would ask for them: [rank][k] -> indices."""
    from freetune.speed.sampler import _rank_balanced_sampler_class

    out = []
    for rank in range(ranks):
        sampler = _rank_balanced_sampler_class()(
            lengths=lengths, effective_batch_size=micro_batch * grad_accum * ranks, dp_size=ranks,
            grad_accum=grad_accum, rank=rank, seed=3, drop_last=False, group_by_length=group_by_length)
        sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


def test_each_step_is_dealt_out_whole_with_equal_tokens_per_rank():
    lengths = sft_lengths(1000)
    longest = max(lengths)
    for ranks, grad_accum, micro_batch in [(2, 1, 8), (2, 8, 1), (2, 2, 4), (4, 2, 2), (3, 1, 5)]:
        per_rank = walk(lengths, ranks, grad_accum, micro_batch)
        steps = len(per_rank[0]) // grad_accum
        assert all(len(mine) == steps * grad_accum for mine in per_rank)
        seen, spread_balanced, spread_random = [], [], []
        rng = random.Random(1)
        for step in range(steps):
            window = slice(step * grad_accum, (step + 1) * grad_accum)
            mine = [[i for batch in per_rank[r][window] for i in batch] for r in range(ranks)]
            rows = [i for m in mine for i in m]
            if step < len(lengths) // (ranks * grad_accum * micro_batch):  # the last, partial step is padded
                assert all(len(b) == micro_batch for r in range(ranks) for b in per_rank[r][window]), \
                    "every micro-batch holds exactly the planned rows (memory as planned)"
                assert len(set(rows)) == len(rows), "no row twice in a step"
                seen += rows
                tokens = [sum(lengths[i] for i in m) for m in mine]
                spread_balanced.append(max(tokens) - min(tokens))
                # The same rows dealt out at random, as DistributedSampler does.
                shuffled = rng.sample(rows, len(rows))
                share = len(rows) // ranks
                random_tokens = [sum(lengths[i] for i in shuffled[r * share:(r + 1) * share]) for r in range(ranks)]
                spread_random.append(max(random_tokens) - min(random_tokens))
        full = (len(lengths) // (ranks * grad_accum * micro_batch)) * ranks * grad_accum * micro_batch
        assert len(seen) == full and len(set(seen)) == full, "each row once per epoch"
        assert max(spread_balanced) <= longest, (ranks, grad_accum, micro_batch, max(spread_balanced))
        mean_balanced = sum(spread_balanced) / len(spread_balanced)
        mean_random = sum(spread_random) / len(spread_random)
        assert mean_balanced < 0.15 * mean_random, (ranks, grad_accum, micro_batch, mean_balanced, mean_random)


def test_the_rows_of_a_step_do_not_depend_on_the_number_of_gpus():
    lengths = sft_lengths(240, seed=5)
    one = walk(lengths, ranks=1, grad_accum=4, micro_batch=4)[0]
    two = walk(lengths, ranks=2, grad_accum=2, micro_batch=4)
    for step in range(len(one) // 4):
        alone = sorted(i for batch in one[step * 4:(step + 1) * 4] for i in batch)
        shared = sorted(i for r in range(2) for batch in two[r][step * 2:(step + 1) * 2] for i in batch)
        assert alone == shared
    # A new epoch draws a new order.
    assert walk(lengths, 2, 2, 4, epoch=1)[0][0] != two[0][0]


def test_length_grouped_steps_pad_less_and_stay_balanced():
    lengths = sft_lengths(800, seed=2)

    def padding(per_rank):
        return sum(len(b) * max(lengths[i] for i in b) - sum(lengths[i] for i in b) for mine in per_rank for b in mine)

    grouped = walk(lengths, 2, 2, 4, group_by_length=True)
    plain = walk(lengths, 2, 2, 4)
    assert padding(grouped) < 0.5 * padding(plain), (padding(grouped), padding(plain))
    for step in range(len(grouped[0]) // 2):
        tokens = [sum(lengths[i] for b in grouped[r][step * 2:(step + 1) * 2] for i in b) for r in range(2)]
        assert abs(tokens[0] - tokens[1]) <= max(lengths)


def test_under_torchrun_the_trainer_feeds_each_rank_its_balanced_share(tmp_path, tiny_model_dir):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(DRIVER), str(tiny_model_dir), str(tmp_path)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert all(r["sampler"] == "rank_balanced" and r["sampler_class"] == "RankBalancedSampler" for r in ranks)
    assert "ranks" in ranks[0]["why"]
    lengths = sampler_driver.row_lengths()
    per_step = sampler_driver.MICRO_BATCH * sampler_driver.GRAD_ACCUM
    steps = len(lengths) // (2 * per_step)
    assert len(ranks[0]["batches"]) == len(ranks[1]["batches"]) == steps * sampler_driver.GRAD_ACCUM
    seen = []
    for step in range(steps):
        window = slice(step * sampler_driver.GRAD_ACCUM, (step + 1) * sampler_driver.GRAD_ACCUM)
        mine = [[row for b in r["batches"][window] for row in b["rows"]] for r in ranks]
        # The Trainer did not shard the rank-aware sampler again: each rank got its full share of the step.
        assert [len(m) for m in mine] == [per_step, per_step]
        tokens = [sum(t for b in r["batches"][window] for t in b["tokens"]) for r in ranks]
        assert tokens == [sum(lengths[i] for i in m) for m in mine], "the real tokens are the rows' own"
        assert abs(tokens[0] - tokens[1]) <= max(lengths)
        seen += mine[0] + mine[1]
    assert len(set(seen)) == len(seen) == steps * 2 * per_step
