"""The releases freetune's reaches were written against, and the check, once per process, that the installed ones
are those (freetune.reach's other modules import this one, so the check runs before any reach is used).

The tested releases are the pins in pyproject.toml. check_versions() compares the installed ones when this module is
first imported (freetune.model imports a reach before a model or tokenizer is loaded):
- the same release: nothing;
- another release of the same major version, newer or older: a warning naming each difference, the tested version
  and the pip command that installs it. Patch and minor releases rarely touch what is reached into, and a user
  on a newer Colab image should still be able to train; the warning says where to look when something goes wrong;
- another major version (transformers 6, peft 1, ...): FreetuneError, before any model loads. Major releases rework
  the internals freetune relies on, and a run would fail hours in, or train wrongly without failing.
check_overridden() checks FreetuneTrainer against the installed classes when freetune.trainer is imported: a method
the library no longer has would never be called, so that is an error too.
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

from freetune.errors import FreetuneError

# The libraries whose internals freetune reaches into (torch's are tagged too, but its version is the platform's).
WATCHED = ("transformers", "trl", "peft", "bitsandbytes", "accelerate")
PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


class VersionWarning(UserWarning):
    """An installed library is another release than the one freetune is tested with."""


def tested_versions() -> dict[str, str]:
    """{library: version} as pyproject.toml pins them: read from freetune's installed metadata, or from the file in a
    source checkout that is not installed; empty when neither is there."""
    from importlib import metadata

    try:
        requirements = metadata.requires("freetune") or []
    except metadata.PackageNotFoundError:
        requirements = re.findall(r'"([^"]+)"', PYPROJECT.read_text()) if PYPROJECT.is_file() else []
    pins = {}
    for requirement in requirements:
        match = re.match(r"\s*([A-Za-z0-9_.-]+)\s*==\s*([^\s;,]+)", requirement)
        if match and match.group(1).lower() in WATCHED:
            pins[match.group(1).lower()] = match.group(2)
    return pins


def installed_versions(names) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in names:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass  # not installed: the import that needs it says so
    return found


def check_versions(installed: dict[str, str] | None = None, tested: dict[str, str] | None = None) -> list[str]:
    """Compare the installed releases of WATCHED with the tested ones (pyproject.toml): warn once, naming each
    difference within a major version; raise FreetuneError for another major version. Returns the differences."""
    tested = tested_versions() if tested is None else tested
    installed = installed_versions(tested) if installed is None else installed
    differ = {name: have for name, have in installed.items() if name in tested and have != tested[name]}
    if not differ:
        return []
    lines = [f"{name} {have} is installed, freetune is tested with {tested[name]}" for name, have in differ.items()]
    install = "pip install " + " ".join(f"'{name}=={tested[name]}'" for name in differ)
    where = ("freetune changes parts of these libraries' internals (freetune/reach/, freetune/trainer.py), "
             "which another release may have changed; the tested versions are the pins in freetune's pyproject.toml")
    majors = [name for name, have in differ.items() if have.split(".")[0] != tested[name].split(".")[0]]
    if majors:
        raise FreetuneError(f"{'; '.join(lines)}: another major version of {', '.join(majors)}. {where}. Install the "
                            f"tested versions before training: {install}")
    if os.environ.get("RANK", "0") == "0":  # once per job, not once per rank
        warnings.warn(f"{'; '.join(lines)}. {where}. If training fails or looks wrong, install them: {install}",
                      VersionWarning, stacklevel=2)
    return lines


def written_against(release: str):
    """Tag a method that overrides a library's with the release it was written against ("transformers 5.17");
    check_overridden() finds the overrides by their tag."""
    def tag(method):
        method.written_against = release
        return method
    return tag


def check_overridden(cls: type) -> list[str]:
    """The tagged methods of `cls`; raises FreetuneError when no base class has one any more (the library would never
    call the override)."""
    tagged = {name: fn.written_against for name, fn in vars(cls).items() if hasattr(fn, "written_against")}
    missing = [f"{name} ({release})" for name, release in tagged.items()
               if not any(name in vars(base) for base in cls.__mro__[1:])]
    if missing:
        versions = ", ".join(f"{name} {version}" for name, version in installed_versions(WATCHED).items())
        raise FreetuneError(f"{cls.__name__} overrides {', '.join(missing)}, which the installed libraries ({versions}) "
                            f"no longer have: the override would never run. Install the versions pinned in freetune's "
                            f"pyproject.toml.")
    return sorted(tagged)


def gone(what: str, written_against: str) -> str:
    """Why a feature steps aside when a reach is not in the installed library: what is missing, and the release the
    reach was written against (its module's WRITTEN_AGAINST)."""
    versions = ", ".join(f"{name} {version}" for name, version in installed_versions(WATCHED + ("torch",)).items())
    return (f"{what} is not in the installed libraries ({versions}); freetune's reach was written against "
            f"{written_against}")


check_versions()
