"""pyproject.toml's ranges, constraints.txt's pins and constraints-lowest.txt's floors agree with each other."""

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
# The extras a user installs; `dev` and `docs` are this repository's tools, pinned in constraints.txt only.
USER_EXTRAS = ("torch", "cli", "checkpoint")
# torch's floor cannot run in CI: the only torch wheel on its disk is this CPU build.
LOCAL_TORCH = "2.13.0"


def pins_of(name: str) -> dict[str, str]:
    """The exact pins of a constraints file at the repository root, by normalised package name."""
    out = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            package, version = line.split("==")
            out[_norm(package)] = version
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(groups: tuple[str, ...]) -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    for group in groups:
        reqs += [Requirement(r) for r in PROJECT["optional-dependencies"][group]]
    return [r for r in reqs if _norm(r.name) != "functional-state"]


def _floor(req: Requirement) -> str:
    floors = [s.version for s in req.specifier if s.operator == ">="]
    assert len(floors) == 1, f"{req}: declare one `>=` floor, so the lowest-versions run can install it"
    return floors[0]


def test_constraints_lowest_is_exactly_the_floors_of_the_ranges():
    expected = {_norm(r.name): _floor(r) for r in _requirements(USER_EXTRAS)}
    expected["torch"] = LOCAL_TORCH
    lowest = pins_of("constraints-lowest.txt")
    assert {k: Version(v) for k, v in lowest.items()} == {k: Version(v) for k, v in expected.items()}


def test_every_floor_is_allowed_by_its_range_and_every_pin_by_its_range():
    pins = pins_of("constraints.txt")
    for req in _requirements(USER_EXTRAS + ("dev", "docs")):
        assert _norm(req.name) in pins, f"{req.name} is required by pyproject.toml but not pinned in constraints.txt"
        assert req.specifier.contains(pins[_norm(req.name)]), f"constraints.txt pins {req.name} outside {req}"
    for name, version in pins_of("constraints-lowest.txt").items():
        (req,) = [r for r in _requirements(USER_EXTRAS) if _norm(r.name) == name]
        assert req.specifier.contains(version), f"constraints-lowest.txt: {name}=={version} outside {req}"


def test_the_measured_floors_stay_raised():
    # Measured: jax < 0.7.1 counts CPU arrays as unpinned_host and park fails; orbax < 0.11.26 lacks
    # use_compression. Lowering a floor again needs a new measurement (make test-lowest).
    floors = {_norm(r.name): _floor(r) for r in _requirements(USER_EXTRAS)}
    assert floors["jax"] == floors["jaxlib"] == "0.7.1"
    assert floors["orbax-checkpoint"] == "0.11.26"
