"""Try it: at a terminal (a real pseudo-terminal here) typed prompts get the adapter's answer streamed; with nobody
to type (papermill's kernels, CI) the held-out prompts are answered instead and nothing waits for input."""

import os
import subprocess
import sys
import time

import pytest

SCRIPT = """
import sys
from freetune.chat import interactive, try_it
print("interactive:", interactive(), flush=True)
answers = try_it(sys.argv[1], sys.argv[2], None, system_prompt="You draw SVG.", max_new_tokens=12)
print("ANSWERS", len(answers), repr(answers), flush=True)
"""


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir, tmp_path_factory):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    out = tmp_path_factory.mktemp("chat") / "adapter"
    model.save_pretrained(str(out))
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(str(out))
    return out


def test_typed_prompts_get_the_adapters_answer_streamed(tiny_model_dir, adapter_dir):
    """At a terminal (input() writes its prompt to stderr there, as on a real one), two prompts: a question, then an
    empty line that ends the chat."""
    import pty
    import select

    master, slave = pty.openpty()
    child = subprocess.Popen([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(adapter_dir)],
                             stdin=slave, stdout=slave, stderr=slave, close_fds=True)
    os.close(slave)
    shown, typed, deadline = b"", 0, time.time() + 240
    try:
        while child.poll() is None and time.time() < deadline:
            if not select.select([master], [], [], 1)[0]:
                continue
            try:
                shown += os.read(master, 4096)
            except OSError:  # the child closed the terminal
                break
            if shown.count(b"you: ") > typed:  # it asks: the question first, then an empty line
                os.write(master, b"Draw a red circle.\n" if typed == 0 else b"\n")
                typed += 1
        child.wait(timeout=60)
    finally:
        os.close(master)
    text = shown.decode(errors="replace").replace("\r\n", "\n")
    assert "interactive: True" in text and "an empty prompt ends" in text, text
    assert typed == 2 and "ANSWERS 1 " in text, text
    answer = eval(text.split("ANSWERS 1 ", 1)[1].strip().splitlines()[0])[0]  # the returned list's repr
    assert answer.strip(), "the adapter said nothing"
    # The streamer printed the answer after the prompt as it was generated (nothing else prints it).
    streamed = text.split("Draw a red circle.\n", 1)[1].split("\nyou: ", 1)[0]
    assert streamed.startswith("adapter: ") and streamed[len("adapter: "):].strip() == answer.strip(), text


def test_headless_without_held_out_rows_says_so_instead_of_waiting(tiny_model_dir, adapter_dir):
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir), str(adapter_dir)],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "interactive: False" in done.stdout and "ANSWERS 0" in done.stdout
    assert "no held-out rows to answer (eval_rows is 0)" in done.stdout
