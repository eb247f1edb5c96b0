"""IPython's and ipykernel's internals freetune reaches into: showing an error as a cell's error output, and whether
the kernel's front end can answer input(). Written against the releases in WRITTEN_AGAINST (ipykernel is pinned in
pyproject.toml; IPython is the notebook platform's). Imports neither library: freetune.console imports this module
when freetune is imported, and `import freetune` stays cheap."""

from __future__ import annotations

WRITTEN_AGAINST = {"ipython": "9.18", "ipykernel": "7.4"}


def can_show_error_output(shell) -> str:
    """'' when show_error_output works on this IPython shell, else why not (the feature then steps aside)."""
    if callable(getattr(shell, "_showtraceback", None)):
        return ""
    # Not freetune.reach.versions.gone: importing that module checks the pinned releases, which `import freetune`
    # must not do (it runs here, from freetune.console).
    return (f"this IPython ({type(shell).__module__}) has no InteractiveShell._showtraceback; freetune's reach was "
            f"written against IPython {WRITTEN_AGAINST['ipython']}")


def show_error_output(shell, etype, value, lines: list[str]) -> None:
    """IPython 9.18: shell._showtraceback(etype, value, lines): `lines` shown as the cell's error output (the cell
    fails as with any exception), without the traceback IPython would format itself."""
    shell._showtraceback(etype, value, lines)


def kernel_allows_stdin(kernel) -> bool:
    """ipykernel 7.4: kernel._allow_stdin, whether the front end that sent this cell can answer input() (papermill's
    cannot)."""
    return bool(getattr(kernel, "_allow_stdin", False))
