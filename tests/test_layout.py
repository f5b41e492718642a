"""The library does not depend on the app (issue 42): no module outside ``lightning_sync/app/`` imports it.

Read from the sources (``ast``), not by importing: an import inside a function counts as much as one at the
top. The old module names of the app (``lightning_sync.train``, ``.config``, ``.schema``, ``.data``,
``.models``) are aliases of the app's modules and the only exception; each is checked to be nothing else.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_sync"
ALIASES = {"train", "config", "schema", "data", "models"}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_the_library_imports_nothing_from_the_app() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "app" or (len(rel.parts) == 1 and rel.stem in ALIASES):
            continue
        app = sorted(n for n in _imports(path) if n == "lightning_sync.app" or n.startswith("lightning_sync.app."))
        old = sorted(n for n in _imports(path) if n in {f"lightning_sync.{a}" for a in ALIASES})
        if app or old:
            offenders.append(f"lightning_sync/{rel}: {', '.join(app + old)}")
    assert not offenders, "library modules importing the app:\n" + "\n".join(offenders)


def test_the_old_module_names_are_the_app_modules_and_nothing_else() -> None:
    for name in sorted(ALIASES):
        source = (PACKAGE / f"{name}.py").read_text()
        assert _imports(PACKAGE / f"{name}.py") <= {"sys", "lightning_sync.app", f"lightning_sync.app.{name}"}, name
        assert "def " not in source and "class " not in source, name
    code = ("import importlib, lightning_sync.app as app\n"
            "for n in ('train', 'config', 'schema', 'data', 'models'):\n"
            "    assert importlib.import_module('lightning_sync.' + n) is importlib.import_module('lightning_sync.app.' + n), n\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
