"""Every reach into another library's internals outside FreetuneTrainer (freetune/trainer.py), one module per library:
transformers, trl, peft_bnb (peft and bitsandbytes), torch, ipython. Each reach is a small named function or constant
whose docstring names the release it was written against; each module's WRITTEN_AGAINST lists those releases.

Why gathered here: what freetune changes below a library's public API can break on a new release without an error
(a renamed private attribute is simply never read again), so this package and trainer.py are what to re-read when a
library is upgraded, and `.ci/newest` runs the tests that lean on them against the newest releases PyPI has.
tests/test_reach.py fails on a private reach anywhere else in freetune/.

versions.py checks the installed releases against pyproject.toml's pins once per process: the transformers, trl and
peft_bnb modules import it, so the check runs before any of their reaches is used. torch's and IPython's reaches do
not (their versions are the platform's, and freetune.console imports ipython.py when freetune is imported); where
one of their attributes is missing, the feature that needs it steps aside and says why (can_show_error_output,
freetune.speed.attention's probe of the attention kernels).

This package imports no submodule: `import freetune` stays cheap, and the version check runs only where a reach is.
"""
