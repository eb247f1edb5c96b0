"""The repository's commands (benchmarks, GPU checks, headless runs), run from the repository root as
`python -m scripts.NAME`; those that import no other script also run as `python scripts/NAME.py`."""
