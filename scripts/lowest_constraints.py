"""Print pip constraints pinning each runtime dependency to the lowest version pyproject.toml
admits (``name>=X`` becomes ``name==X``), for scripts/test-lowest.sh.

pip has no "lowest" resolution of its own (uv's ``--resolution lowest-direct`` does this),
so the bounds are read here, from the one place they are written. A runtime dependency
without a lower bound is an error: every one must say what it was tested from.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?\s*(.*)$")


def lowest(pyproject: Path) -> list[str]:
    pins = []
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        name, spec = _REQUIREMENT.match(requirement).groups()  # type: ignore[union-attr]
        bound = re.search(r">=\s*([0-9][^,;\s]*)", spec)
        if bound is None:
            raise SystemExit(f"{requirement!r} has no lower bound (>=) in {pyproject}")
        pins.append(f"{name}=={bound.group(1)}")
    return pins


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    print("\n".join(lowest(root / "pyproject.toml")))
