"""One source, two Lightning namespaces: ``lightning_sync.pl``, the build for ``pytorch_lightning``.

``pytorch_lightning`` (the standalone package) ships Lightning's code under other module names
(``pytorch_lightning``, ``lightning_fabric``), and its ``Trainer`` accepts only strategies and
callbacks that subclass its own classes. So every module of lightning_sync that imports Lightning,
directly or through another such module, is loaded a second time as ``lightning_sync.pl.<name>``,
from the same file, with its imports rewritten in the syntax tree before it is compiled:

* ``lightning`` / ``lightning.pytorch[.x]`` -> ``pytorch_lightning[.x]``, ``lightning.fabric[.x]`` ->
  ``lightning_fabric[.x]``;
* a Lightning-dependent ``lightning_sync.<name>`` -> ``lightning_sync.pl.<name>``.

Modules that import no Lightning (``collectives``, ``errors``, ``guard``, ``batchnorm``, ``seeding``,
...) are not copied: both builds share them, so there is one collective guard and one set of
trusted callers per process. Nothing is generated on disk and no second copy of the code exists to
keep in step; tracebacks point at the real files.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

__all__ = ["PL_PACKAGE", "install", "lightning_dependent", "register_lazily"]

PACKAGE = "lightning_sync"
PL_PACKAGE = "lightning_sync.pl"
_ROOT = Path(__file__).parent


@cache
def _module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    files: dict[str, Path] = {}
    for path in sorted(_ROOT.rglob("*.py")):
        parts = path.relative_to(_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        files[".".join((PACKAGE, *parts))] = path
    return files


def _is_lightning(name: str) -> bool:
    return name == "lightning" or name.startswith("lightning.")


def _imported(tree: ast.AST, modules: dict[str, Path]) -> set[str]:
    """The absolute module names a module imports, anywhere in it (function-level imports too)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import submodule` binds the submodule: it depends on that, not on pkg's __init__
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in modules else node.module)
    return names


@cache
def lightning_dependent() -> frozenset[str]:
    """The modules of lightning_sync that import Lightning, directly or through another of its modules."""
    modules = _module_files()
    imports = {name: _imported(ast.parse(path.read_text()), modules) for name, path in modules.items()}
    dependent = {name for name, used in imports.items() if any(_is_lightning(u) for u in used)}
    while True:
        more = {name for name, used in imports.items() if name not in dependent and used & dependent}
        if not more:
            return frozenset(dependent)
        dependent |= more


def _target(name: str) -> str:
    """Where an import of ``name`` goes in the pytorch_lightning build."""
    if name == "lightning" or name == "lightning.pytorch":
        return "pytorch_lightning"
    if name.startswith("lightning.pytorch."):
        return "pytorch_lightning." + name.removeprefix("lightning.pytorch.")
    if name == "lightning.fabric" or name.startswith("lightning.fabric."):
        return "lightning_fabric" + name.removeprefix("lightning.fabric")
    if name in lightning_dependent():
        return PL_PACKAGE + name.removeprefix(PACKAGE)
    return name


class _Rewrite(ast.NodeTransformer):
    def visit_Import(self, node: ast.Import) -> ast.AST:
        aliases = []
        for alias in node.names:
            target = _target(alias.name)
            if target == alias.name:
                aliases.append(alias)
            elif alias.asname is not None or "." not in alias.name:
                # `import lightning` binds `lightning`: keep that name for the module it now is
                aliases.append(ast.alias(target, alias.asname or alias.name))
            else:
                raise ImportError(f"{PL_PACKAGE}: cannot rewrite `import {alias.name}` without `as` (line "
                                  f"{node.lineno}); import it under a name")
        return ast.copy_location(ast.Import(aliases), node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> ast.AST | list[ast.stmt]:
        if node.level or not node.module:
            return node
        if node.module != PACKAGE:
            return ast.copy_location(ast.ImportFrom(_target(node.module), node.names, 0), node)
        # `from lightning_sync import collectives, strategy`: each submodule where it lives in this build
        moved = [a for a in node.names if f"{PACKAGE}.{a.name}" in lightning_dependent()]
        kept = [a for a in node.names if a not in moved]
        out: list[ast.stmt] = []
        if kept:
            out.append(ast.copy_location(ast.ImportFrom(PACKAGE, kept, 0), node))
        if moved:
            out.append(ast.copy_location(ast.ImportFrom(PL_PACKAGE, moved, 0), node))
        return out


class _Loader(importlib.abc.Loader):
    """Runs ``source`` with its imports rewritten; ``source=None``: an empty package that only holds
    Lightning-dependent submodules (``lightning_sync.pl._compat`` for ``_compat.lightning_api``)."""

    def __init__(self, source: Path | None) -> None:
        self.source = source

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None

    def exec_module(self, module: ModuleType) -> None:
        if self.source is None:
            return
        tree = _Rewrite().visit(ast.parse(self.source.read_text(), str(self.source)))
        code = compile(ast.fix_missing_locations(tree), str(self.source), "exec")
        module.__file__ = str(self.source)
        exec(code, module.__dict__)  # noqa: S102 - the package's own file, imports rewritten


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != PL_PACKAGE and not fullname.startswith(PL_PACKAGE + "."):
            return None
        original = PACKAGE + fullname.removeprefix(PL_PACKAGE)
        source = _module_files().get(original)
        if source is None:
            return None
        package = source.name == "__init__.py"
        if original not in lightning_dependent():
            if not (package and any(m.startswith(original + ".") for m in lightning_dependent())):
                return None
            source = None  # only a parent of rewritten modules
        spec = importlib.util.spec_from_loader(fullname, _Loader(source), origin=str(source) if source else None,
                                               is_package=package)
        if spec is not None and package:
            spec.submodule_search_locations = []  # submodules come from this finder
        return spec


_FINDER = _Finder()

#: The strategy names ``pytorch_lightning``'s registry gets: (name, class in ``lightning_sync.pl``, init
#: parameters, description); the same entries ``strategy.register`` and ``model_parallel.register`` make.
_PL_NAMES: tuple[tuple[str, str, dict[str, object], str], ...] = (
    ("ddp_sync", "SyncDDPStrategy", {"start_method": "popen"},
     "DDP with seed broadcast, exact gather support and clean teardown"),
    ("ddp_sync_spawn", "SyncDDPStrategy", {"start_method": "spawn"}, "ddp_sync started with torch.multiprocessing.spawn"),
    ("ddp_sync_notebook", "SyncDDPStrategy", {"start_method": "fork"},
     "ddp_sync for Jupyter notebooks (ranks forked, like ddp_notebook)"),
    ("model_parallel_sync", "SyncModelParallelStrategy", {},
     "ModelParallelStrategy (FSDP2) with lightning_sync's parts"),
    ("ddp_sync_ft", "FaultTolerantDDPStrategy", {"start_method": "popen"},
     "ddp_sync in each replica group, torchft across groups (lsync-ft-run)"),
    ("model_parallel_sync_ft", "FaultTolerantModelParallelStrategy", {},
     "model_parallel_sync (FSDP2) in each replica group, torchft across groups (lsync-ft-run)"),
)


def _pl_strategy(class_name: str) -> Callable[..., object]:
    def build(**init_params: object) -> object:
        import lightning_sync.pl as lpl  # built at the first Trainer that asks (~0.4 s), not at import

        return getattr(lpl, class_name)(**init_params)

    build.__name__ = build.__qualname__ = class_name
    return build


def register_lazily(registry: object) -> None:
    """Register the strategy names in ``pytorch_lightning``'s ``registry`` without building ``lightning_sync.pl``
    yet: each entry builds it when a ``Trainer`` asks for the name (idempotent)."""
    for name, class_name, init_params, description in _PL_NAMES:
        if name not in registry:  # type: ignore[operator]
            registry.register(name, _pl_strategy(class_name), description=description,  # type: ignore[attr-defined]
                              **init_params)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """When ``pytorch_lightning.strategies`` is imported after ``lightning_sync``, register the names in its
    registry as it is made (a ``pytorch_lightning.Trainer(strategy="ddp_sync")`` works in either import order)."""

    module = "pytorch_lightning.strategies"

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.module:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            registry = getattr(module, "StrategyRegistry", None)
            if registry is not None:
                register_lazily(registry)

        loader.exec_module = exec_module  # type: ignore[method-assign]  # (this spec's own loader instance)
        return spec


def install() -> None:
    """Make ``import lightning_sync.pl`` (and its submodules) work, and ``pytorch_lightning``'s registry know the
    strategy names whenever it is imported (idempotent)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _FINDER)
    if "pytorch_lightning.strategies" in sys.modules:
        register_lazily(sys.modules["pytorch_lightning.strategies"].StrategyRegistry)
    elif not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
