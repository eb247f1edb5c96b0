"""A run's identity: what its checkpoints were trained with, checked before a resume loads anything.

A resume continues a run; it must be the same run. Without this check a changed `lora_rank` failed with a
state_dict size mismatch after the model had loaded, a changed `lora_targets` with an optimizer ValueError, and
another model of the same dimensions, other data, another `lora_alpha`, `max_length` or `seed` resumed without
a word (the summary's loss then spans two runs).

`check_same_run` runs in the data audit cell, after the rows are known and before the model loads. It writes
`run_identity.json` into the checkpoints folder; the trainer copies it into every checkpoint it saves (listed in
the completion marker), and the resume compares the checkpoint it picked (a local one, or one downloaded from
the Hub) with it again.

What may change on a resume: max_steps, logging_steps, save_steps, eval_steps, time_budget_min, the speed knobs
(micro_batch with grad_accum as long as the rows per step stay, gradient_checkpointing, torch_compile, optimizer
kernels aside), the evaluation and export settings. What may not: the settings below, the model's files, the
training rows and the rows per step. learning_rate may change and is applied: the cosine schedule goes on from
the checkpoint's step with the new peak (freetune.trainer.FreetuneTrainer._load_optimizer_and_scheduler), as a
raised max_steps stretches it; the resume says so. Applying it is what a user lowering it after a loss spike
wants, and it costs nothing: AdamW's state does not depend on the learning rate.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from freetune.checkpoint.marker import latest_complete
from freetune.distributed import context, print0
from freetune.errors import FreetuneError

IDENTITY = "run_identity.json"
# Parameters whose change makes another run (a recipe that lacks one simply does not record it).
FIXED = ("model_id", "dataset", "dataset_split", "lora_rank", "lora_alpha", "lora_dropout", "lora_targets",
         "max_length", "seed", "precision", "optimizer", "max_grad_norm", "warmup_ratio", "num_epochs")
APPLIED = ("learning_rate",)  # may change on a resume: applied from the checkpoint's step on
# Derived values: what each means, and what a user changes to change it.
DERIVED = {
    "model_files": "the model's files (config and weight sizes of a local folder, the Hub commit of a hub id)",
    "training_rows": "the training rows after the audit (the data file, or columns, system_prompt, chat_template, "
                     "eval_rows or auto_clean)",
    "rows_per_gpu_step": "rows per GPU per optimizer step (micro_batch x grad_accum; grad_accum when micro_batch "
                         "is 0)",
}


def model_files(model_id: str) -> str | None:
    """A fingerprint of the model's files: a local folder's config.json and weight file sizes, or the Hub commit
    of the cached snapshot; None where it is not known (nothing cached yet)."""
    folder = Path(model_id).expanduser()
    if folder.is_dir():
        digest = hashlib.sha256()
        config = folder / "config.json"
        if config.is_file():
            digest.update(config.read_bytes())
        for weights in sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf")):
            digest.update(f"{weights.name}:{weights.stat().st_size}\n".encode())
        return "folder " + digest.hexdigest()[:16]
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_id, "config.json")
    except Exception:  # an id the cache cannot hold: no fingerprint, the model_id comparison still holds
        return None
    return f"hub commit {Path(cached).parent.name}" if isinstance(cached, str) else None


def rows_fingerprint(rows) -> str:
    """The number of rows and a hash of their content, in order (a Dataset or a list of dicts)."""
    digest = hashlib.sha256()
    count = 0
    for row in rows:
        digest.update(json.dumps(row, sort_keys=True, default=str).encode())
        count += 1
    return f"{count} rows, sha256 {digest.hexdigest()[:16]}"


def run_identity(params: dict, train_rows) -> dict:
    """The identity of a run with these parameters (a recipe's parameters cell) on these training rows."""
    identity = {name: params[name] for name in (*FIXED, *APPLIED) if name in params}
    identity["model_files"] = model_files(params["model_id"]) if "model_id" in params else None
    identity["training_rows"] = rows_fingerprint(train_rows)
    if "grad_accum" in params:
        identity["rows_per_gpu_step"] = (params.get("micro_batch") or 1) * params["grad_accum"]
    return identity


def read_identity(folder: str | Path) -> dict | None:
    path = Path(folder) / IDENTITY
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def differences(recorded: dict, now: dict) -> tuple[list[str], list[str]]:
    """(names that may not change but did, names applied on resume that changed), both in FIXED/DERIVED order.
    A value one side does not know (None, or missing: an older record) is not compared."""
    refused = [name for name in (*FIXED, *DERIVED)
               if recorded.get(name) is not None and now.get(name) is not None and recorded[name] != now[name]]
    applied = [name for name in APPLIED if name in recorded and name in now and recorded[name] != now[name]]
    return refused, applied


def mismatch_message(refused: list[str], recorded: dict, now: dict, checkpoint: str, run_name: str) -> str:
    lines = []
    for name in refused:
        what = f"{name}" if name in FIXED else f"{name}: {DERIVED[name]}"
        lines.append(f"  {what}: {recorded[name]!r} in {checkpoint}, {now[name]!r} now")
    settable = [name for name in refused if name in FIXED]
    back = ", ".join(f"{name} = {recorded[name]!r}" for name in settable) or "the same model files and data"
    if "rows_per_gpu_step" in refused:
        back += (f"{', ' if back else ''}micro_batch and grad_accum giving {recorded['rows_per_gpu_step']} rows per "
                 f"GPU per step")
    return (f"This run folder holds {checkpoint}, trained with other settings than these, so resuming would mix two "
            f"runs:\n" + "\n".join(lines) + f"\nEither set them back ({back}) to continue from {checkpoint}, or set "
            f"run_name to a new name (e.g. {run_name + '-2'!r}) to start a new run from step 0. What may change on a "
            f"resume: max_steps, learning_rate, save_steps, logging_steps, eval_steps, time_budget_min, "
            f"gradient_checkpointing, torch_compile, and the evaluation and export settings.")


def compare(recorded: dict | None, now: dict, checkpoint: str, run_name: str) -> None:
    """Raise when `now` is another run than `recorded`; say what is applied; nothing when nothing is recorded."""
    if recorded is None:
        print0(f"{checkpoint} records no run settings (saved by an older freetune): the resume does not check them.")
        return
    refused, applied = differences(recorded, now)
    if refused:
        raise FreetuneError(mismatch_message(refused, recorded, now, checkpoint, run_name))
    for name in applied:
        print0(f"{name} changed from {recorded[name]!r} ({checkpoint}) to {now[name]!r}: applied from its step on "
               f"(the schedule goes on from there with the new value).")


def check_same_run(paths, params: dict, train_rows) -> dict:
    """Before the model loads: refuse to resume a checkpoint of this run folder trained with other settings, data
    or model (the message names each with both values, and the two ways out), then record this run's identity
    for the trainer to copy into every checkpoint. Returns the identity."""
    now = run_identity(params, train_rows)
    found = latest_complete(paths.checkpoints)
    if found is not None:
        compare(read_identity(found), now, found.name, Path(paths.run_dir).name)
    if context().is_main:
        Path(paths.checkpoints).mkdir(parents=True, exist_ok=True)
        (Path(paths.checkpoints) / IDENTITY).write_text(json.dumps(now, indent=1, sort_keys=True, default=str))
    return now


def check_resumed(checkpoints_dir: str | Path, resume_from: str | Path) -> None:
    """At the resume itself: the checkpoint picked (possibly just downloaded from the Hub) against the identity
    check_same_run recorded. Nothing to do where none was recorded (a library caller that skipped it)."""
    now = read_identity(checkpoints_dir)
    if now is None:
        return
    run_name = Path(checkpoints_dir).parent.name
    refused, _ = differences(read_identity(resume_from) or {}, now)
    if refused:
        raise FreetuneError(mismatch_message(refused, read_identity(resume_from), now, Path(resume_from).name,
                                             run_name))


def copy_into(checkpoint_folder: str | Path) -> None:
    """The run's identity into a checkpoint being saved (before its marker, which then lists it)."""
    folder = Path(checkpoint_folder)
    source = folder.parent / IDENTITY
    if source.is_file():
        (folder / IDENTITY).write_bytes(source.read_bytes())
