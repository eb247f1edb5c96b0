"""What a notebook shows (freetune.console): a FreetuneError as its message, no library progress bars, one
duration format; and one Hub reachability check in place of the libraries' retries (freetune.platform)."""

import os
import subprocess
import sys
import textwrap

import pytest

from freetune.console import duration


def python(code: str, **env) -> subprocess.CompletedProcess:
    """A fresh interpreter (the switches act when freetune is imported), with extra environment variables."""
    environ = {k: v for k, v in os.environ.items() if k not in env or env[k] is not None}
    environ.update({k: v for k, v in env.items() if v is not None})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=environ, timeout=300)


def test_durations_have_one_format():
    assert [duration(s) for s in (0.4, 42, 68, 600, 3599.6, 7620)] == [
        "0 s", "42 s", "1 min 08 s", "10 min 00 s", "1 h 00 min", "2 h 07 min"]


def test_a_freetune_error_shows_as_its_message_and_still_fails_the_cell():
    result = python("""
        from IPython.core.interactiveshell import InteractiveShell
        shell = InteractiveShell.instance()
        shell.run_cell("import freetune")
        outcome = shell.run_cell(
            "try:\\n    int('x')\\nexcept ValueError as exc:\\n"
            "    raise freetune.FreetuneError('Set `dataset` to a file that exists.') from exc")
        print("FAILED" if outcome.error_in_exec is not None else "PASSED")
        shell.run_cell("%tb")  # the whole chain, on request
    """)
    assert result.returncode == 0, result.stderr
    shown, _, on_request = result.stdout.partition("FAILED")
    assert "FreetuneError" in shown and "Set `dataset` to a file that exists." in shown
    assert "Traceback" not in shown and "ValueError" not in shown and "direct cause" not in shown
    assert "ValueError" in on_request and "direct cause" in on_request



def test_an_ipython_without_the_private_display_keeps_its_own_traceback_and_says_why():
    # An IPython release that renamed InteractiveShell._showtraceback (freetune.reach.ipython), emulated by removing it.
    result = python("""
        import warnings
        from IPython.core.interactiveshell import InteractiveShell
        del InteractiveShell._showtraceback
        shell = InteractiveShell.instance()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            shell.run_cell("import freetune")
        print("WARNED:", *[str(w.message) for w in caught])
        outcome = shell.run_cell("raise freetune.FreetuneError('Set `dataset` to a file that exists.')")
        print("FAILED" if outcome.error_in_exec is not None else "PASSED")
    """)
    assert result.returncode == 0, result.stderr
    assert "FreetuneError will show with its whole traceback" in result.stdout
    assert "no InteractiveShell._showtraceback" in result.stdout and "IPython 9.18" in result.stdout
    assert "FAILED" in result.stdout

def test_the_libraries_draw_no_progress_bars_once_freetune_is_imported():
    result = python("""
        import freetune, datasets, transformers
        print(datasets.is_progress_bar_enabled(), transformers.utils.logging.is_progress_bar_enabled())
    """, HF_DATASETS_DISABLE_PROGRESS_BARS=None, HF_HUB_DISABLE_PROGRESS_BARS=None)
    assert result.stdout.split() == ["False", "False"], result.stderr


@pytest.mark.parametrize("call", ["freetune.model.load_tokenizer('Qwen/Qwen3-8B')",
                                  "freetune.data.load_rows('tuxevil/Home-Assistant-Requests-V3')"])
def test_an_unreachable_hub_fails_at_once_saying_what_to_change(call):
    # A closed port: the connection is refused at once, as on a machine with its internet off.
    result = python(f"""
        import freetune
        try:
            {call}
        except freetune.FreetuneError as exc:
            print(exc)
    """, HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_OFFLINE=None, HF_DATASETS_OFFLINE=None)
    assert "Cannot reach the Hugging Face Hub (http://127.0.0.1:9" in result.stdout, result.stdout + result.stderr
    assert "Internet on" in result.stdout and ("`model_id`" in result.stdout or "`dataset`" in result.stdout)
    assert "Retry" not in result.stdout + result.stderr  # no retries: one check, one message


def what_is_logged(logger_name: str, *messages: str) -> list[str]:
    """The messages that reach a handler of `logger_name` once freetune is imported (its filters installed)."""
    import logging

    import freetune  # noqa: F401  (the filters are installed on import)

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger(logger_name)
    logger.addHandler(handler)
    try:
        for message in messages:
            logger.warning(message)
    finally:
        logger.removeHandler(handler)
    return seen


def test_bitsandbytes_optional_kernel_warning_is_dropped_and_nothing_else():
    # The call bitsandbytes 0.50 makes on AVX-512 bf16 CPUs without the `kernels` package, then another one.
    assert what_is_logged("bitsandbytes.backends.cpu.ops",
                          "Failed to load CPU gemm_4bit_forward from kernels-community: No module named 'kernels'. "
                          "Please make sure you already `pip install kernels` and the kernels >= 0.11.1",
                          "some other bitsandbytes warning") == ["some other bitsandbytes warning"]
    # And in a fresh process, as a recipe imports them (on a CPU without AVX-512 bf16 the line never comes).
    done = python("import freetune, bitsandbytes")
    assert done.returncode == 0 and "gemm_4bit_forward" not in done.stderr


def test_the_trainers_token_alignment_notice_is_dropped_and_nothing_else():
    assert what_is_logged("transformers.trainer_utils",
                          "The tokenizer has new PAD/BOS/EOS tokens that differ from the model config and generation "
                          "config. Updated tokens: {'bos_token_id': None}.",
                          "another warning") == ["another warning"]
