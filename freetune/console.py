"""What the person at the notebook sees: freetune's own lines, not the libraries' noise.

- A FreetuneError shows as its message, without the chain of library exceptions that led to it (IPython's
  custom exception handler). The cell still fails, so "Run all" and papermill stop there. `%tb` shows the
  whole traceback; FREETUNE_TRACEBACK=1 (set before `import freetune`) keeps IPython's own display.
- No library progress bars: datasets' map/save bars, transformers' "Loading weights" and the Hub's download bars
  turn into a line per update in papermill output and torchrun logs (and into pink stderr blocks in a notebook).
  The switches are environment variables, so torchrun's ranks inherit them. freetune prints one line where a
  phase takes a while (loading the model, preparing the rows) instead.
- Durations in one format (`duration`), wherever a time is printed.
"""

from __future__ import annotations

import os
import sys
import warnings

from freetune.errors import FreetuneError
from freetune.reach import ipython as ipython_reach

# Read by datasets and huggingface_hub when they are imported (transformers follows the Hub's switch).
PROGRESS_BAR_SWITCHES = ("HF_DATASETS_DISABLE_PROGRESS_BARS", "HF_HUB_DISABLE_PROGRESS_BARS")


def progress_bars_off() -> None:
    """Switch the libraries' progress bars off, in this process and in the processes it starts."""
    for name in PROGRESS_BAR_SWITCHES:
        os.environ.setdefault(name, "1")
    # tqdm.auto warns on import in a kernel without ipywidgets (headless runs); no bar is drawn anyway.
    warnings.filterwarnings("ignore", message="IProgress not found")
    # A library imported before freetune has read its switch already.
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    if "huggingface_hub" in sys.modules:
        sys.modules["huggingface_hub"].utils.disable_progress_bars()
    if "transformers" in sys.modules:
        sys.modules["transformers"].utils.logging.disable_progress_bar()


def show_freetune_errors_as_messages() -> bool:
    """In an IPython kernel: display a FreetuneError as its message alone. Returns whether it was installed."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or os.environ.get("FREETUNE_TRACEBACK") == "1":
        return False
    why_not = ipython_reach.can_show_error_output(shell)
    if why_not:  # IPython's own display stays: the whole traceback, the message at its end
        warnings.warn(f"FreetuneError will show with its whole traceback: {why_not}", stacklevel=2)
        return False
    shell.set_custom_exc((FreetuneError,), _show_message)
    return True


def _show_message(shell, etype, value, tb, tb_offset=None):
    # What %tb and post-mortem debugging read: the whole traceback stays available on request.
    sys.last_type, sys.last_value, sys.last_traceback = etype, value, tb
    if sys.version_info >= (3, 12):
        sys.last_exc = value
    stb = [f"\x1b[1;31m{etype.__name__}\x1b[0m: {value}",
           "\x1b[2m(freetune stopped here; %tb shows where it was raised)\x1b[0m"]
    ipython_reach.show_error_output(shell, etype, value, stb)  # the cell fails as with any exception
    return stb


def duration(seconds: float) -> str:
    """42 s, 4 min 05 s, 2 h 07 min: the one format for every time freetune prints."""
    seconds = max(int(round(seconds)), 0)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"

