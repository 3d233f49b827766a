"""``constraints.txt`` (the versions ``make`` installs) agrees with ``pyproject.toml``: every
requirement of the package and of its test extra is pinned, for every Python the project
supports, to a version its range admits. A dependency added to ``pyproject.toml`` without
``make constraints`` would otherwise install unpinned, and a range tightened past a pin would
make ``make``'s install fail."""
from __future__ import annotations

import pathlib
import tomllib

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHONS = ("3.11.7", "3.12.1", "3.13.0")  # the supported range's lines (requires-python)


def _project():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _pins() -> list[tuple[str, Version, Marker | None]]:
    pins = []
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, _, marker = line.partition(";")
        name, sep, version = spec.strip().partition("==")
        assert sep, f"constraints.txt: {line!r} pins no exact version"
        pins.append((canonicalize_name(name), Version(version.strip()),
                     Marker(marker) if marker.strip() else None))
    return pins


def _linux(python: str) -> dict:
    return {"python_version": ".".join(python.split(".")[:2]), "python_full_version": python,
            "sys_platform": "linux", "platform_system": "Linux"}


def test_every_line_is_an_exact_pin():
    assert len(_pins()) > 10


@pytest.mark.parametrize("python", PYTHONS)
def test_each_requirement_is_pinned_once_to_a_version_its_range_admits(python):
    project = _project()
    assert project["requires-python"] == ">=3.11"
    env = _linux(python)
    pins: dict = {}
    for name, version, marker in _pins():
        if marker is None or marker.evaluate(env):
            assert name not in pins, f"{name} pinned twice for Python {python}"
            pins[name] = version
    for text in project["dependencies"] + project["optional-dependencies"]["test"]:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is not in constraints.txt (run `make constraints`)"
        assert req.specifier.contains(pins[name]), \
            f"constraints.txt pins {req.name}=={pins[name]}, outside pyproject's {req.specifier}"


def test_make_installs_with_the_constraints():
    # both installers, uv and the pip fallback, take the file
    recipe = (ROOT / "Makefile").read_text()
    assert recipe.count("-c constraints.txt") == 2
