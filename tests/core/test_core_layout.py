"""The core's layout: its subpackages import one way (scheduler -> model -> kernels; speculation
beside, used by the others and using none of them), with no cycle."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

CORE = REPO / "core"
ORDER = {"scheduler": 0, "model": 1, "kernels": 2}  # a package imports only those after it


def core_imports(path: Path) -> set[str]:
    """The core subpackages a module imports (relative or absolute)."""
    here = path.parent.name
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                target = here if node.module else None
            elif node.level == 2:
                target = (node.module or "").split(".")[0]
            elif node.module and node.module.startswith("specsuite.core."):
                target = node.module.split(".")[2]
            else:
                target = None
            if target:
                found.add(target)
    return found - {here}


def test_core_subpackages_import_one_way():
    packages = sorted(p.name for p in CORE.iterdir() if (p / "__init__.py").exists())
    assert packages == ["kernels", "model", "scheduler", "speculation"]
    assert not [p.name for p in CORE.glob("*.py") if p.name != "__init__.py"]  # every module in a subpackage
    wrong = []
    for package in packages:
        for module in (CORE / package).glob("*.py"):
            for target in core_imports(module):
                allowed = target == "speculation" or (
                    package in ORDER and target in ORDER and ORDER[target] > ORDER[package])
                if package == "speculation" or not allowed:
                    wrong.append(f"{package}/{module.name} imports {target}")
    assert not wrong, wrong
