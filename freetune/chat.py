"""Try it: type a prompt, watch the adapter answer token by token (transformers' TextStreamer).

In a notebook the cell asks for prompts until an empty one. Run headless (papermill, CI, a script without a terminal)
nobody can type, so it answers a few held-out prompts instead of waiting for input that never comes. On Kaggle the
cell runs in the notebook's own kernel, after torchrun's processes have ended, on one GPU.

The adapter is loaded on the base model as the evaluation loads it (freetune.evaluate.load_for_comparison), with the
tokenizer training saved (its chat template), and answers with the Ollama Modelfile's sampling defaults, so what
you see here is what `ollama run` will give.
"""

from __future__ import annotations

import sys

from freetune.data import prompt_messages
from freetune.reach.ipython import kernel_allows_stdin
from freetune.resources import release_memory

# The Modelfile's defaults too (freetune.export.write_modelfile).
SAMPLING = {"temperature": 0.7, "top_p": 0.8, "repetition_penalty": 1.05}


def interactive() -> bool:
    """True when someone can answer input(): a notebook front end that allows input (papermill's does not), or a
    terminal."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
    except ImportError:
        shell = None
    kernel = getattr(shell, "kernel", None)
    if kernel is not None:
        return kernel_allows_stdin(kernel)
    return sys.stdin is not None and sys.stdin.isatty()


def _system_of(rows) -> str | None:
    """The system turn the held-out rows share (Home Assistant's lists the home's devices), if any."""
    for row in rows or ():
        turns = prompt_messages(dict(row))
        if turns and turns[0]["role"] == "system":
            return turns[0]["content"]
    return None


def _streamer(tokenizer):
    """Shows the answer as it is written, as ONE output: a notebook output updated in place (a saved notebook then
    holds one output per answer, not one per word), or plain prints in a terminal."""
    from transformers import TextStreamer

    try:
        from IPython import get_ipython
        from IPython.display import display
        in_kernel = getattr(get_ipython(), "kernel", None) is not None
    except ImportError:
        in_kernel = False

    class OneOutputStreamer(TextStreamer):
        def __init__(self):
            super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
            self.text = ""
            self.handle = display({"text/plain": "adapter: "}, raw=True, display_id=True) if in_kernel else None
            if self.handle is None:
                print("adapter: ", end="", flush=True)

        def on_finalized_text(self, text: str, stream_end: bool = False):
            self.text += text
            if self.handle is not None:
                self.handle.update({"text/plain": f"adapter: {self.text}"}, raw=True)
            else:
                print(text, end="\n" if stream_end else "", flush=True)

    return OneOutputStreamer()


def answer(model, tokenizer, messages: list[dict], *, max_new_tokens: int = 256, seed: int = 0,
           stream: bool = True) -> str:
    """Generate the assistant's reply to `messages`; returns the text. stream: show it as it comes (see _streamer);
    else nothing is shown (the caller prints the whole answer once)."""
    import torch

    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False).to(model.device)
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**inputs, streamer=_streamer(tokenizer) if stream else None, do_sample=True,
                             max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                             eos_token_id=tokenizer.eos_token_id, **SAMPLING)
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def try_it(base_model: str, adapter_dir: str, held_out=None, *, system_prompt: str | None = None,
           max_new_tokens: int = 256, rows: int = 3, plan=None) -> list[str]:
    """Chat with the trained adapter (see the module docstring); returns the answers given.

    held_out: the held-out rows; headless, `rows` of their prompts are answered (their own system turns kept).
    system_prompt: the system turn of typed prompts (default: the held-out rows' own, else none)."""
    from freetune.evaluate import load_for_comparison, pick_rows

    model, tokenizer = load_for_comparison(base_model, adapter_dir, plan=plan)
    model.eval()
    answers = []
    try:
        if interactive():
            system = system_prompt or _system_of(held_out)
            print("Type a prompt and press Enter; an empty prompt ends.", flush=True)
            while prompt := input("you: ").strip():
                messages = ([{"role": "system", "content": system}] if system else []) + [
                    {"role": "user", "content": prompt}]
                answers.append(answer(model, tokenizer, messages, max_new_tokens=max_new_tokens))
            return answers
        if not held_out:
            print("Nobody can type here (a headless run) and there are no held-out rows to answer (eval_rows is 0): "
                  "run this cell in a notebook to chat with the adapter.")
            return answers
        print(f"A headless run: nobody can type here, so the adapter answers {min(rows, len(held_out))} held-out "
              f"prompts (in a notebook this cell asks for yours).", flush=True)
        for row in pick_rows(held_out, rows):
            messages = prompt_messages(row)
            # Nobody watches a headless run write: one print per answer, so the saved notebook holds one output each.
            answers.append(answer(model, tokenizer, messages, max_new_tokens=max_new_tokens, stream=False))
            print(f"\nyou: {messages[-1]['content']}\nadapter: {answers[-1]}", flush=True)
        return answers
    finally:
        del model
        release_memory()
