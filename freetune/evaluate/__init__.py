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
    python -m freetune.evaluate --base BASE_DIR_OR_HUB_ID --adapter ADAPTER_DIR --data rows.jsonl \
        [--task svg|home_assistant] [--rows 8] [--json]
It exits with status 1 when the adapter's verdict is "collapsed".
"""

from freetune.evaluate.comparison import ComparisonReport, compare_model, judge
from freetune.evaluate.generation import Generation, generate
from freetune.evaluate.loading import compare, load_for_comparison, pick_rows, resolve_adapter_dir
from freetune.evaluate.verdict import (ADHERENCE_OK, COLLAPSED, INCONCLUSIVE, OK, VERDICTS, WEAK, largest_cluster,
                                       near_identical, normalise, prompt_following, repeated_ngram_rate,
                                       sanity_report)

__all__ = ["ADHERENCE_OK", "COLLAPSED", "INCONCLUSIVE", "OK", "VERDICTS", "WEAK", "ComparisonReport", "Generation",
           "compare", "compare_model", "generate", "judge", "largest_cluster", "load_for_comparison", "near_identical",
           "normalise", "pick_rows", "prompt_following", "repeated_ngram_rate", "resolve_adapter_dir", "sanity_report"]
