"""freetune.overrides and freetune.trainer: the library internals freetune changes, checked against what is installed.

The tested releases are pyproject.toml's pins; another release of the same major version is a warning that names
the difference and the fix, another major version an error before anything loads, and an override whose method
the installed library no longer has an error too (it would never run).
"""

import re
import tomllib
import warnings

import pytest

from conftest import REPO
from freetune import overrides
from freetune.errors import FreetuneError


def test_the_tested_versions_are_the_pins_in_pyproject_and_this_environment_has_them():
    train = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["train"]
    pins = dict(re.fullmatch(r"([\w.-]+)==(\S+)", req).groups() for req in train if "==" in req)
    tested = overrides.tested_versions()
    assert tested == {name: pins[name] for name in overrides.WATCHED}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CI installs the pins: no warning here
        assert overrides.check_versions() == []


def test_a_newer_minor_release_warns_naming_it_the_tested_one_and_the_fix():
    with pytest.warns(overrides.VersionWarning) as caught:
        differ = overrides.check_versions(installed={"transformers": "5.24.0", "trl": "1.16.0"},
                                          tested={"transformers": "5.17.0", "trl": "1.16.0"})
    assert differ == ["transformers 5.24.0 is installed, freetune is tested with 5.17.0"]
    message = str(caught[0].message)
    assert "pyproject.toml" in message and "pip install 'transformers==5.17.0'" in message
    assert "trl" not in message  # only what differs


def test_an_older_patch_release_warns_too():
    with pytest.warns(overrides.VersionWarning, match="peft 0.21.1 is installed"):
        overrides.check_versions(installed={"peft": "0.21.1"}, tested={"peft": "0.21.2"})


def test_another_major_version_stops_before_anything_loads():
    with pytest.raises(FreetuneError) as refused:
        overrides.check_versions(installed={"transformers": "6.0.0", "peft": "0.22.0"},
                                 tested={"transformers": "5.17.0", "peft": "0.21.2"})
    message = str(refused.value)
    assert "another major version of transformers" in message
    assert "pip install 'transformers==5.17.0' 'peft==0.21.2'" in message


def test_every_trainer_override_is_tagged_and_exists_in_the_installed_libraries():
    from trl import SFTTrainer

    from freetune.trainer import FreetuneTrainer

    tagged = overrides.check_overridden(FreetuneTrainer)
    # Every method FreetuneTrainer defines over one of its bases carries the release it was written against.
    overriding = sorted(name for name, value in vars(FreetuneTrainer).items() if callable(value)
                        and name != "__init__" and any(name in vars(base) for base in SFTTrainer.__mro__))
    assert tagged == overriding and "compute_loss" in tagged and "_save_checkpoint" in tagged

    class Drifted(SFTTrainer):
        @overrides.written_against("transformers 5.17")
        def _a_hook_no_release_has(self):
            pass

    with pytest.raises(FreetuneError, match="_a_hook_no_release_has .transformers 5.17.*would never run"):
        overrides.check_overridden(Drifted)
