"""Data audit: find the rows that would quietly ruin a fine-tune, show them, and clean them before training.

Why this exists: a public SVG data set had 84 of 4,750 completions equal to a pipeline's error string, "No
valid response from model."; an adapter trained on it answered that string to every prompt. The audit looks
for that and for the other defects that cost a training run:

  blocking (the recipe stops until they are cleaned or knowingly accepted)
    malformed             rows the trainer cannot read: content that is a number or null, no assistant turn, a
                          role such as "bot" (the message names the file, row and field)
    empty                 empty or whitespace-only completions
    repeated              a short completion repeated verbatim across >= `repeat_share_block` of the rows (or,
                          among fewer than 5 distinct answers that are no label set, one answer given to half the
                          rows or more)
    refusal               refusals and AI boilerplate distilled from a chat model     } a warning instead when
    error_string          API/pipeline error strings and placeholders (null, N/A)      } they cover over 10% of
    cut_off               answers stopped mid-sentence or with brackets/tags open       } the rows: then they are
    echo                  the prompt copied back as the answer                          } likely the data's purpose
    check:<name>          rows failing a recipe's validity check (SVG parses, the action is valid JSON, ...)
    no_trainable_tokens   rows whose completion is entirely cut off by `max_length` (TRL drops them silently)
    duplicate             exact copies of an earlier row
    conflict              a prompt seen earlier with a different answer
    overlap               training rows whose prompt is also in the evaluation set
  warning (shown, never dropped by default)
    repeated_other        answers repeated by many rows that look legitimate (as long as typical answers, or rare)
    short                 completions under `min_completion_chars` where most answers are longer
    language              answers in another language than the rest and than their own prompt
    rare_class, dominant_class, off_label
                          a label set's class under 3%, one over 90%, a few answers outside the classes
    truncated             rows longer than `max_length` (the end of their answer and its EOS are cut)
    eos_not_in_labels     the stop token is not among the tokens trained on: the model may never learn to stop
    pad_is_eos            the pad token is the EOS token: collators that mask pad ids also mask EOS

Exact duplicates are blocking although one copy is harmless: dropping the later copies loses no information,
each copy doubles that row's weight, and when the data is later split into train and eval, copies land on both
sides and inflate the eval score. Cleaning them costs nothing, so the default is to clean.

Label sets (sentiment, yes/no, topics, ratings, repeated tool calls) are not junk: when answers repeated by 3+ rows
each cover 80% of the rows they are classes, and the report prints the class balance (see labels.py).

Duplicates and conflicts are looked for among rows that pass the row checks (not empty, not junk, not failing
a check), so the first *valid* answer to a prompt is the one kept.

Token counts follow TRL's SFTTrainer on the same rows (freetune.audit.tokens says how), so audit the data in the
form the trainer gets it: after freetune.data.as_chat when the recipe trains on chats. Duplicates and repeats are
found with dictionaries keyed by the texts, in one pass.

The files, one job each:
    findings.py   what a Finding is; the parameter names and figures messages use
    rows.py       reading normalised rows as text
    rules.py      the rules on the rows' text (empty, repeated, short, checks, duplicates, conflicts, overlap)
    labels.py     label sets: their classes, class balance, answers outside the classes
    junk.py       refusals, error strings, cut-off answers, echoed prompts
    language.py   answers in another language
    structure.py  rows the trainer cannot read
    tokens.py     the rows as TRL tokenises them, and the token findings (truncated, no answer, EOS, pad)
    twin.py       tokenising fast: the tiktoken twin of the tokenizer, used once it matched it
    run.py        audit(): every rule, in order, into one report
    report.py     AuditReport: stable JSON, a table as text or HTML
    cleaning.py   clean(), enforce() and audit_and_clean(), the recipe's audit cell in one call
    cli.py        python -m freetune.audit

Usage:
    report = audit(dataset, tokenizer=tokenizer, max_length=1024, checks=freetune.tasks.svg.AUDIT_CHECKS)
    report.display()                        # a table in a notebook, text elsewhere
    cleaned, summary = clean(dataset, report)
    enforce(audit(cleaned, ...), accept_problems=False)
    # or all of it in one line:
    dataset, report, summary = audit_and_clean(dataset, auto_clean=True, accept_problems=False, ...)

Command line:
    python -m freetune.audit DATASET [--json] [--columns JSON] [--split train] [--model DIR_OR_ID]
                                     [--max-length N] [--checks svg|home_assistant] [--eval DATASET]
                                     [--eval-split test] [--strict]
"""

from freetune.audit.cleaning import CleanSummary, audit_and_clean, clean, enforce
from freetune.audit.cli import main, resolve_checks
from freetune.audit.findings import ACCEPT_PARAMETER, BLOCKING, CLEAN_PARAMETER, WARNING, Check, Finding
from freetune.audit.report import AuditReport
from freetune.audit.rules import WHY_REPEATS_DOMINATE
from freetune.audit.run import audit
from freetune.audit.twin import tiktoken_twin

__all__ = ["ACCEPT_PARAMETER", "BLOCKING", "CLEAN_PARAMETER", "WARNING", "WHY_REPEATS_DOMINATE", "AuditReport", "Check",
           "CleanSummary", "Finding", "audit", "audit_and_clean", "clean", "enforce", "main", "resolve_checks",
           "tiktoken_twin"]
