"""Training data in the shapes people actually have, normalised to what TRL's SFTTrainer trains on.

Shapes read without a column mapping (normalised to TRL's own names, so SFTTrainer masks the loss correctly):
- conversational `messages`: a list of {"role", "content"} turns, one or many exchanges; the loss is on every
  assistant turn (TRL's assistant_only_loss with a chat template whose {% generation %} markers wrap each one);
- ShareGPT `conversations`: a list of {"from": "human" | "gpt" | "system", "value": ...} turns -> `messages`;
- `prompt` / `completion`: strings or message lists; loss on the completion only;
- Alpaca `instruction` / `input` / `output` -> `prompt` (instruction and input joined) / `completion`.
Anything else through a column mapping, e.g. `columns={"prompt": ["question", "context"], "completion":
"answer"}` (several prompt columns are joined with a blank line, empty ones skipped).

`load_rows` takes a local file (.jsonl/.json/.csv/.parquet), a folder written by `Dataset.save_to_disk`, or a
hub id; every failure is a FreetuneError that says what to change, raised before any model is loaded.
"""

from __future__ import annotations

import codecs
import json
from pathlib import Path
from typing import Any

from freetune.errors import FreetuneError, reason
from freetune.platform import require_hub

LOCAL_SUFFIXES = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
TEXT_SUFFIXES = (".jsonl", ".json", ".csv")  # read as UTF-8 text; parquet is binary


def load_rows(source: str, split: str = "train", config: str | None = None):
    """Load a `datasets.Dataset` from a local file/folder or a hub id, with errors that say what to change."""
    import datasets

    path = Path(source).expanduser()
    looks_local = source.startswith((".", "/", "~")) or path.suffix in LOCAL_SUFFIXES or path.exists()
    if not looks_local:
        return _load_hub(source, split, config)
    if not path.exists():
        raise FreetuneError(
            f"Data set file {str(path)!r} does not exist. Check the `dataset` parameter: give an existing "
            f".jsonl/.json/.csv/.parquet file, a folder saved with Dataset.save_to_disk, or a hub id "
            f"such as 'thesantatitan/deepseek-svg-dataset'.")
    saved = path.is_dir() and (path / "dataset_info.json").exists()  # written by Dataset.save_to_disk
    if path.is_file() and path.suffix not in LOCAL_SUFFIXES:
        raise FreetuneError(
            f"Cannot read {path.name!r}: freetune reads {', '.join(sorted(LOCAL_SUFFIXES))} files. "
            f"Convert the file, or point `dataset` at a hub id.")
    files = [] if saved else _data_files(path)
    for file in files:
        _check_text(file)
    try:
        if saved:
            return datasets.load_from_disk(str(path))
        if path.is_dir():
            return datasets.load_dataset(str(path), config, split=split)
        return datasets.load_dataset(LOCAL_SUFFIXES[path.suffix], data_files=str(path), split="train")
    except Exception as exc:  # malformed JSON, wrong CSV, ...: say which file, where and why
        where = next(filter(None, map(_json_problem, files)), None) or _root_cause(exc)
        raise FreetuneError(f"Could not read data set {str(path)!r}: {where}. Fix the file or the `dataset` "
                            f"parameter.") from exc


def _load_hub(source: str, split: str, config: str | None):
    import datasets

    require_hub(f"the data set {source!r}", "dataset")
    print(f"Reading {source!r} (split {split!r}) from the Hugging Face Hub ...", flush=True)
    try:
        return datasets.load_dataset(source, config, split=split)
    except Exception as exc:
        raise FreetuneError(
            f"Could not load data set {source!r} (split {split!r}) from the Hugging Face Hub: "
            f"{type(exc).__name__}: {reason(exc)}. Check the `dataset` id and split, that this machine is "
            f"online, and for a private or gated data set that HF_TOKEN is set (Colab/Kaggle secrets).") from exc


def _data_files(path: Path) -> list[Path]:
    """The data files `load_rows` reads: the file itself, or a folder's .jsonl/.json/.csv/.parquet files."""
    if path.is_file():
        return [path]
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in LOCAL_SUFFIXES
                   and not any(part.startswith(".") for part in p.relative_to(path).parts))
    if not found:
        others = sorted(p.name for p in path.iterdir())[:8]
        raise FreetuneError(
            f"Folder {str(path)!r} holds no {', '.join(sorted(LOCAL_SUFFIXES))} files (it holds {others or 'nothing'})"
            f" and was not saved with Dataset.save_to_disk. Point `dataset` at a data file, or at a folder of them.")
    return found


def _check_text(path: Path) -> None:
    """Before datasets reads a file: an empty one, or text that is not UTF-8 (datasets would load it and fail later,
    at the first row it decodes, without naming the file), named with its line."""
    if path.stat().st_size == 0:
        raise FreetuneError(f"Data set file {str(path)!r} is empty (0 bytes). Point `dataset` at the file that holds "
                            f"your rows.")
    if path.suffix not in TEXT_SUFFIXES:
        return
    decoder, lines, blank = codecs.getincrementaldecoder("utf-8")(), 0, True
    with open(path, "rb") as f:
        while True:
            chunk = f.read(1 << 20)
            try:  # every chunk decoded (not only until the first text); the empty last one ends a cut-off character
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                seen = exc.object[:exc.start]
                line = lines + seen.count(b"\n") + 1
                shown = exc.object[seen.rfind(b"\n") + 1:exc.start + 1].decode("utf-8", "backslashreplace")[-60:]
                raise FreetuneError(
                    f"Data set file {str(path)!r} is not UTF-8 text: line {line} has the byte "
                    f"0x{exc.object[exc.start]:02x} ({shown!r}); Latin-1 or Windows-1252 files look like this. "
                    f"Save it as UTF-8 (e.g. `iconv -f latin1 -t utf-8 {path.name} > utf8-{path.name}`) and point "
                    f"`dataset` at the new file.") from exc
            blank = blank and not text.strip()
            if not chunk:
                break
            lines += chunk.count(b"\n")
    if blank:
        raise FreetuneError(f"Data set file {str(path)!r} holds only whitespace: no rows. Point `dataset` at the file "
                            f"that holds your rows.")


def _json_problem(path: Path) -> str | None:
    """Where a JSON / JSON Lines file stops being valid ("file, line N, column M: why"), or None if it is valid."""
    if path.suffix not in (".json", ".jsonl"):
        return None
    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith(("[", "{")):
        try:
            json.loads(text)
            return None  # one valid JSON document: the problem is not its syntax
        except json.JSONDecodeError as exc:
            if text.lstrip().startswith("["):
                return f"{path.name}, line {exc.lineno}, column {exc.colno}: {exc.msg}"
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            return f"{path.name}, line {number}, column {exc.colno}: {exc.msg} (JSON Lines: one JSON object per line)"
        if not isinstance(row, dict):
            return (f"{path.name}, line {number} holds a JSON {type(row).__name__}, not an object such as "
                    f"{{\"prompt\": ..., \"completion\": ...}}")
    return None


def _root_cause(exc: BaseException) -> str:
    """datasets wraps a reader's error in "An error occurred while generating the dataset": the reader's own words."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _is_message_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _is_sharegpt_list(value: Any) -> bool:
    return (isinstance(value, list) and bool(value)
            and all(isinstance(m, dict) and "from" in m and "value" in m for m in value))


# ShareGPT's speaker names -> chat roles. Exports differ in what they call the two sides; these are the common ones.
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "model": "assistant", "system": "system"}
ALPACA_COLUMNS = ("instruction", "input", "output")


def _sharegpt_turn(turn: dict) -> dict:
    role = SHAREGPT_ROLES.get(str(turn["from"]).strip().lower())
    if role is None:
        raise FreetuneError(
            f"A ShareGPT turn comes from {turn['from']!r}; freetune reads {sorted(SHAREGPT_ROLES)}. Rename those "
            f"turns in the data (tool calls and results are not supported), or drop the rows that have them.")
    return {"role": role, "content": turn["value"]}


def _turns(example_turns: list[dict]) -> list[dict]:
    """Chat turns as {"role", "content"}, from role/content or ShareGPT's from/value turns."""
    if _is_sharegpt_list(example_turns):
        return [_sharegpt_turn(m) for m in example_turns]
    return [{"role": m["role"], "content": m["content"]} for m in example_turns]


def _recognised_columns(present: set[str], columns: dict) -> tuple[dict, str]:
    """(mapping, what was recognised) for shapes known by their column names (ShareGPT, Alpaca), when no mapping
    was given and no column already has freetune's names; ({}, "") otherwise."""
    if columns or {"messages", "prompt", "completion"} & present:
        return {}, ""
    if "conversations" in present:
        return {"messages": "conversations"}, "ShareGPT rows (`conversations` of from/value turns) read as `messages`"
    if {"instruction", "output"} <= present:
        prompt = [c for c in ALPACA_COLUMNS[:2] if c in present]
        return ({"prompt": prompt, "completion": "output"},
                f"Alpaca rows read as prompt = {' + '.join(prompt)}, completion = output")
    return {}, ""


def _join_columns(example: dict, names: list[str]) -> str:
    return "\n\n".join(str(example[n]).strip() for n in names if example.get(n) not in (None, "")
                       and str(example[n]).strip())


def normalize(dataset, columns: dict[str, str | list[str]] | None = None, system_prompt: str | None = None):
    """Return a data set with exactly `messages`, or `prompt` + `completion` columns.

    columns: maps freetune's names ("messages", "prompt", "completion") to the data set's own column(s).
    system_prompt: prepended as a system turn to conversational rows that have none.
    """
    if len(dataset) == 0:
        raise FreetuneError("The data set has no rows. Check the `dataset` parameter and its split.")
    present = set(dataset.column_names)
    columns = dict(columns or {})
    wanted = {name for source in columns.values() for name in ([source] if isinstance(source, str) else source)}
    missing = sorted(wanted - present)
    if missing:
        raise FreetuneError(
            f"The column mapping names {missing}, which the data set does not have. Its columns are "
            f"{sorted(present)}: fix the `columns` parameter.")

    recognised, described = _recognised_columns(present, columns)
    if recognised:
        print(f"Data: {described}.")
        columns = recognised

    def column_for(name: str):
        if name in columns:
            return columns[name]
        return name if name in present else None

    messages_col = column_for("messages")
    prompt_col, completion_col = column_for("prompt"), column_for("completion")
    if messages_col is None and not (prompt_col and completion_col):
        raise FreetuneError(
            f"Cannot tell which columns to train on: the data set has {sorted(present)}. freetune reads chat "
            f"`messages`, ShareGPT `conversations`, `prompt` + `completion`, and Alpaca's instruction/input/output. "
            f"Map yours with the `columns` parameter, e.g. {{'prompt': ['question', 'context'], "
            f"'completion': 'answer'}}.")

    if messages_col is not None:
        first = dataset[0][messages_col] if isinstance(messages_col, str) else None
        if not (_is_message_list(first) or _is_sharegpt_list(first)):
            raise FreetuneError(
                f"Column {messages_col!r} should hold a list of {{'role': ..., 'content': ...}} turns (or ShareGPT's "
                f"{{'from': ..., 'value': ...}}); row 0 holds {type(first).__name__}. Map a prompt/completion pair "
                f"with `columns` instead.")

        def to_messages(example):
            turns = _turns(example[messages_col])
            if system_prompt and turns and turns[0]["role"] != "system":
                turns = [{"role": "system", "content": system_prompt}] + turns
            return {"messages": turns}

        out = dataset.map(to_messages, remove_columns=dataset.column_names, desc="Normalising rows")
        if not any(m["role"] == "assistant" for m in out[0]["messages"]):
            raise FreetuneError("Row 0 has no assistant turn: there is nothing to learn. Each conversation needs "
                                "at least one {'role': 'assistant', ...} turn.")
        return out

    prompt_names = [prompt_col] if isinstance(prompt_col, str) else list(prompt_col)
    completion_names = [completion_col] if isinstance(completion_col, str) else list(completion_col)
    conversational = _is_message_list(dataset[0][prompt_names[0]]) if len(prompt_names) == 1 else False

    def to_prompt_completion(example):
        if conversational:
            prompt, completion = example[prompt_names[0]], example[completion_names[0]]
            if isinstance(completion, str):
                completion = [{"role": "assistant", "content": completion}]
            if system_prompt and prompt and prompt[0]["role"] != "system":
                prompt = [{"role": "system", "content": system_prompt}] + prompt
            return {"prompt": prompt, "completion": completion}
        prompt_text = _join_columns(example, prompt_names)
        completion_text = _join_columns(example, completion_names)
        return {"prompt": prompt_text, "completion": completion_text}

    return dataset.map(to_prompt_completion, remove_columns=dataset.column_names, desc="Normalising rows")


def as_chat(dataset, system_prompt: str | None = None):
    """Normalised rows as chats, each with the system prompt: prompt/completion strings -> one-turn chats, so an
    instruct model trains on its own chat template; conversations without a system turn get the system prompt
    as their first turn (rows that carry their own keep it). The one way a recipe gives the system prompt."""
    if "messages" in dataset.column_names or not isinstance(dataset[0]["prompt"], str):
        if not system_prompt:
            return dataset
        column = "messages" if "messages" in dataset.column_names else "prompt"

        def add_system(example):
            turns = example[column]
            if turns and turns[0]["role"] != "system":
                turns = [{"role": "system", "content": system_prompt}] + turns
            return {column: turns}

        return dataset.map(add_system, desc="Adding the system prompt")

    def wrap(example):
        prompt = [{"role": "user", "content": example["prompt"]}]
        if system_prompt:
            prompt = [{"role": "system", "content": system_prompt}] + prompt
        return {"prompt": prompt, "completion": [{"role": "assistant", "content": example["completion"]}]}

    return dataset.map(wrap, desc="Wrapping rows in the chat template")


def completion_text(row: dict) -> str:
    """The text the model learns to produce for one normalised row (assistant turns joined)."""
    if "messages" in row:
        return "\n".join(m["content"] for m in row["messages"] if m["role"] == "assistant")
    completion = row["completion"]
    if isinstance(completion, list):
        return "\n".join(m["content"] for m in completion if m["role"] == "assistant")
    return completion


def prompt_text(row: dict) -> str:
    """The text the model is given for one normalised row (everything before the last assistant turn)."""
    if "messages" in row:
        turns = row["messages"]
        last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
        return "\n".join(m["content"] for m in turns[:last])
    prompt = row["prompt"]
    return "\n".join(m["content"] for m in prompt) if isinstance(prompt, list) else prompt


def prompt_messages(row: dict) -> list[dict]:
    """The chat turns to generate from for one normalised row (what precedes the last assistant turn)."""
    if "messages" in row:
        turns = row["messages"]
        last = max(i for i, m in enumerate(turns) if m["role"] == "assistant")
        return list(turns[:last])
    prompt = row["prompt"]
    return list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def split_eval(dataset, eval_rows: int, seed: int = 0):
    """Hold out `eval_rows` rows (seeded) for evaluation; returns (train, eval or None)."""
    if eval_rows <= 0:
        return dataset, None
    if len(dataset) < 2:  # eval_rows is at least 1: lowering it cannot help
        raise FreetuneError(f"The data set has {len(dataset)} row(s): training needs at least 2 (one is held out for "
                            f"the evaluation at the end). Add rows to the data set (a few hundred is a useful start), "
                            f"or check `dataset` and `dataset_split` point at the data you meant.")
    if eval_rows >= len(dataset):
        raise FreetuneError(f"eval_rows={eval_rows} leaves no training rows (the data set has {len(dataset)}). "
                            f"Set `eval_rows` to at most {len(dataset) - 1} (a tenth of the rows, "
                            f"{max(1, len(dataset) // 10)}, keeps most for training).")
    parts = dataset.train_test_split(test_size=eval_rows, seed=seed, shuffle=True)
    return parts["train"], parts["test"]


def save_prepared(data_dir: str, train, eval_rows=None) -> None:
    """Keep the audited, cleaned rows on disk: the training step (inline or every torchrun rank) reads these."""
    import shutil

    for name, part in (("train", train), ("eval", eval_rows)):
        target = Path(data_dir) / name
        shutil.rmtree(target, ignore_errors=True)
        if part is not None:
            part.save_to_disk(str(target))


def load_prepared(data_dir: str):
    """(train, eval or None) as saved by save_prepared."""
    import datasets

    train_dir, eval_dir = Path(data_dir) / "train", Path(data_dir) / "eval"
    if not train_dir.exists():
        raise FreetuneError(f"No prepared training data in {data_dir}: run the data audit cell first.")
    # keep_in_memory: the trainer's tokenising map then writes no cache files beside the data, so N ranks
    # never race on (or write) shared files.
    load = lambda folder: datasets.load_from_disk(str(folder), keep_in_memory=True)  # noqa: E731
    return load(train_dir), (load(eval_dir) if eval_dir.exists() else None)
