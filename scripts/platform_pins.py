"""Do the notebooks' pins resolve on Colab and Kaggle, and what do they change there?

    python -m scripts.platform_pins               # both platforms; exit 1 on a failure (CI runs it: .ci/platforms)
    python -m scripts.platform_pins colab-gpu     # one: a file name under platforms/, without .txt

For each platform file under platforms/ (the packages the platform has preinstalled, with where they came from and
the date in its header), pip resolves what the install cell installs (build_notebooks.pinned_requirements(), plus
the logging extra, which a notebook installs when report_to asks for it) for the platform's Python, from wheels
only (`pip install --dry-run --ignore-installed --only-binary=:all: --python-version ...`). That fails when a pin
has no wheel for the platform's Python (3.13 on Colab, 3.12 on Kaggle), or when the pins cannot resolve together.

torch is the platform's and never reinstalled (the install cell leaves it out): it enters the resolve as a stub
wheel of the platform's exact build (torch 2.11.0+cu128 on Colab) with no requirements of its own, so pip neither
picks another torch nor pulls CUDA packages the platform already has.

Then each preinstalled package the resolve picked another release of is sorted, as pip itself would treat it
(it keeps an installed package whose version meets every requirement on it):
- pinned: freetune pins it (transformers 5.15 -> 5.17 on Colab): the tested release, intended;
- kept: the preinstalled release meets every requirement on it: pip leaves it;
- changed: a requirement excludes the preinstalled release (pyarrow for datasets 5.2): pip upgrades it under the
  platform's other packages. Each such change must be listed in ACCEPTED with the reason it is accepted; a new one
  fails the check, naming the requirement that forces it: change that pin, or accept it here.
What it cannot see: a preinstalled package that requires the old release of one it changes (pip prints "pip's
dependency resolver does not currently take into account all the packages that are installed" there); finding
those would need the metadata of every preinstalled package.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import build_notebooks  # noqa: E402  (the install cell's pins, read from pyproject.toml)

PLATFORMS = ROOT / "platforms"
# Left to the platform: torch is never reinstalled, and what it brought (CUDA libraries, Triton) stays with it.
FIXED = ("torch",)
FIXED_PREFIXES = ("nvidia-", "cuda-", "triton", "torch")
# Glibc 2.35 (Ubuntu 22.04, both platforms' base) runs wheels for every older manylinux.
MANYLINUX = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 4, -1)] + [
    "manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]

# The Pythons every pin must have a wheel for: Kaggle's and Colab's.
WHEELS_FOR = ("3.12", "3.13")
# Changes to a preinstalled package that the install cell is allowed to make, per platform, and why.
_HF_FAMILY = ("comes with the pinned transformers 5.17 / datasets 5.2: Hugging Face's libraries move together, and "
              "the ones the platform preinstalled that use them (transformers, peft, accelerate, datasets) are pinned "
              "too")
_PYARROW = ("trl 1.16 (>= 21) and datasets 5.2 (>= 24) both need it, so no other pin of either avoids it; freetune "
            "imports pyarrow only through datasets, which is pinned. Preinstalled packages that cap pyarrow (RAPIDS' "
            "cudf) may stop importing in that runtime; freetune uses none of them (docs/platforms.md)")
ACCEPTED = {
    "colab-gpu": {"huggingface-hub": _HF_FAMILY, "tokenizers": _HF_FAMILY, "pyarrow": _PYARROW},
    "kaggle-gpu": {"huggingface-hub": _HF_FAMILY, "tokenizers": _HF_FAMILY, "safetensors": _HF_FAMILY,
                   "hf-xet": _HF_FAMILY, "click": _HF_FAMILY + " (huggingface_hub's command line needs click >= 8.4.2)",
                   "pyarrow": _PYARROW},
}


def read_platform(path: Path) -> tuple[str, dict[str, str]]:
    """(python version, {canonical name: version}) of a platform file: `# python: 3.13` and `name==version` lines."""
    python, packages = None, {}
    for line in path.read_text().splitlines():
        if line.startswith("# python:"):
            python = line.split(":", 1)[1].strip()
        elif line and not line.startswith("#"):
            name, version = line.split("==", 1)
            packages[canonicalize_name(name)] = version.strip()
    if python is None:
        raise SystemExit(f"{path}: no '# python: X.Y' line in its header")
    return python, packages


def install_cell_requirements() -> list[str]:
    """What a notebook's install cell installs (rendered from pyproject by build_notebooks)."""
    return build_notebooks.pinned_requirements()


def every_pin() -> list[str]:
    """Every `name==version` requirement of every extra but torch (the platform's)."""
    extras = build_notebooks.project_meta()["optional-dependencies"]
    return [req for reqs in extras.values() for req in reqs
            if "==" in req and canonicalize_name(Requirement(req).name) not in FIXED]


def stub_wheel(folder: Path, name: str, version: str) -> None:
    """A wheel of `name` `version` with no requirements and no files: the platform's preinstalled build, held fixed."""
    dist = f"{name}-{version}"
    with zipfile.ZipFile(folder / f"{dist}-py3-none-any.whl", "w") as wheel:
        wheel.writestr(f"{dist}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        wheel.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: freetune\nRoot-Is-Purelib: true\n"
                                                  "Tag: py3-none-any\n")
        wheel.writestr(f"{dist}.dist-info/RECORD", "")


def resolve(requirements: list[str], python: str, fixed: dict[str, str] | None = None,
            held: dict[str, str] | None = None, deps: bool = True) -> list[dict]:
    """pip's resolution (its --report "install" list) of `requirements` for `python` on x86-64 Linux, wheels only:
    the `fixed` packages as stub wheels of the platform's builds, the `held` ones at the given versions."""
    fixed, held = fixed or {}, held or {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, version in fixed.items():
            stub_wheel(tmp, name, version)
        constraints = fixed | held
        (tmp / "constraints.txt").write_text("".join(f"{name}=={version}\n" for name, version in constraints.items()))
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                   "--only-binary=:all:", "--python-version", python, "--report", str(tmp / "report.json"),
                   "--find-links", str(tmp), "-c", str(tmp / "constraints.txt"), *fixed, *requirements]
        command += [] if deps else ["--no-deps"]
        for platform in MANYLINUX:
            command += ["--platform", platform]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode:
            errors = [line for line in done.stderr.splitlines() if not line.startswith("WARNING: Location")]
            raise ResolveError("\n".join(errors[-15:]))
        return json.loads((tmp / "report.json").read_text())["install"]


class ResolveError(Exception):
    """pip could not resolve the pins for a platform (no wheel for its Python, or conflicting requirements)."""


def requirements_on(installs: list[dict], python: str, pins: list[str]) -> dict[str, list[tuple[str, Requirement]]]:
    """{canonical name: [(who requires it, the requirement)]}: our pins and every resolved package's requirements
    whose markers hold on the platform (its Python, Linux x86-64, the extras pip installed them with)."""
    environment = default_environment() | {"python_version": python, "python_full_version": f"{python}.0",
                                           "sys_platform": "linux", "platform_system": "Linux",
                                           "platform_machine": "x86_64", "os_name": "posix"}
    found: dict[str, list] = {}
    for pin in pins:
        requirement = Requirement(pin)
        found.setdefault(canonicalize_name(requirement.name), []).append(("freetune's pin", requirement))
    for item in installs:
        meta = item["metadata"]
        extras = [""] + list(item.get("requested_extras") or [])
        for text in meta.get("requires_dist") or []:
            requirement = Requirement(text)
            if requirement.marker is None or any(requirement.marker.evaluate(environment | {"extra": extra})
                                                 for extra in extras):
                who = f"{meta['name']} {meta['version']}"
                found.setdefault(canonicalize_name(requirement.name), []).append((who, requirement))
    return found


def compare(installs: list[dict], preinstalled: dict[str, str], required: dict, pinned: set[str]) -> dict:
    """{"pinned"|"kept"|"changed"|"new": [(name, preinstalled, resolved, why)]} (the module's docstring says how)."""
    sorted_out = {"pinned": [], "kept": [], "changed": [], "new": []}
    for item in installs:
        name = canonicalize_name(item["metadata"]["name"])
        resolved = item["metadata"]["version"]
        have = preinstalled.get(name)
        if name.startswith(FIXED_PREFIXES):
            continue
        if have is None:
            sorted_out["new"].append((name, None, resolved, ""))
            continue
        if Version(have) == Version(resolved):
            continue
        if name in pinned:
            sorted_out["pinned"].append((name, have, resolved, "freetune's pin"))
            continue
        refusing = [f"{who} requires {req.name}{req.specifier}" for who, req in required.get(name, [])
                    if not req.specifier.contains(have, prereleases=True)]
        key = "changed" if refusing else "kept"
        sorted_out[key].append((name, have, resolved, "; ".join(refusing)))
    return sorted_out


def check(platform_file: Path) -> tuple[list[str], list[str]]:
    """Resolve the install cell for one platform: (what it prints, the failures).

    Two resolves: the first lets every package float; each preinstalled one that the first moved although its own
    release met every requirement on it ("kept": pip would leave it) is then held at that release, and the second
    resolve says what must change (a kept package's own requirements can differ from its newest release's)."""
    platform = platform_file.stem
    python, preinstalled = read_platform(platform_file)
    pins = install_cell_requirements()
    pinned = {canonicalize_name(Requirement(pin).name) for pin in pins if "==" in pin}
    fixed = {name: preinstalled[name] for name in FIXED if name in preinstalled}
    lines = [f"{platform}: Python {python}, " + ", ".join(f"{n} {v}" for n, v in fixed.items()) + " (fixed)"]
    try:
        first = resolve(pins, python, fixed)
        kept = compare(first, preinstalled, requirements_on(first, python, pins), pinned)["kept"]
        held = {name: have for name, have, _, _ in kept}
        installs = resolve(pins, python, fixed, held)
    except ResolveError as error:
        return lines, [f"{platform}: the install cell's pins do not resolve for Python {python} from wheels:\n{error}"]
    result = compare(installs, preinstalled, requirements_on(installs, python, pins), pinned)
    accepted = ACCEPTED.get(platform, {})
    failures = []
    for name, have, resolved, why in result["pinned"]:
        lines.append(f"  pinned   {name} {have} -> {resolved} (the tested release)")
    for name, have, resolved, why in result["changed"]:
        note = accepted.get(name)
        lines.append(f"  changed  {name} {have} -> {resolved}: {why}" + ("  (accepted)" if note else ""))
        if not note:
            failures.append(f"{platform}: the install cell upgrades the preinstalled {name} {have} -> {resolved} "
                            f"({why}). Change that pin, or accept the change in scripts/platform_pins.py's "
                            f"ACCEPTED with the reason.")
    lines.append(f"  kept     {len(held)} preinstalled packages at their release, though newer ones exist")
    lines.append("  new      " + ", ".join(f"{name} {resolved}" for name, _, resolved, _ in result["new"]))
    for name in accepted.keys() - {name for name, *_ in result["changed"]}:
        failures.append(f"{platform}: ACCEPTED lists {name}, which the install cell no longer changes: drop it.")
    return lines, failures


def check_wheels(python: str) -> tuple[list[str], list[str]]:
    """Every pin of every extra has a wheel for `python` on x86-64 Linux: (what it prints, the failures)."""
    pins = every_pin()
    try:
        resolve(pins, python, deps=False)
    except ResolveError as error:
        return [], [f"a pin has no wheel for Python {python} on x86-64 Linux:\n{error}"]
    return [f"wheels: all {len(pins)} pins have one for Python {python}"], []


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("platforms", nargs="*", help="platform file names under platforms/ (default: all)")
    args = parser.parse_args(argv)
    files = [PLATFORMS / f"{name}.txt" for name in args.platforms] or sorted(PLATFORMS.glob("*.txt"))
    pythons = sorted({read_platform(path)[0] for path in files} | set(WHEELS_FOR))
    # pip spends its time waiting on the index: the checks run side by side.
    with concurrent.futures.ThreadPoolExecutor() as pool:
        jobs = [pool.submit(check, path) for path in files] + [pool.submit(check_wheels, py) for py in pythons]
        results = [job.result() for job in jobs]
    for lines, _ in results:
        print("\n".join(lines))
    failures = [failure for _, found in results for failure in found]
    sys.stdout.flush()
    for failure in failures:
        print("FAILED " + failure, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
