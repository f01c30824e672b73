"""pyproject's package list names every package directory: the editable install finds any of them, a
wheel or a non-editable install only the listed ones (trace_kernels.attention and .cpu_native were
missing once and nothing noticed)."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_directory_is_listed():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg.get("package-dir", {})
    listed = set(cfg["packages"])
    found = set()
    for top in {p.split(".")[0] for p in listed}:
        root = ROOT / dirs.get(top, top)
        for init in root.rglob("__init__.py"):
            rel = init.parent.relative_to(root)
            found.add(".".join((top, *rel.parts)))
    assert found - listed == set(), f"package directories missing from pyproject's packages: {sorted(found - listed)}"
    assert listed - found == set(), f"listed packages with no directory: {sorted(listed - found)}"
