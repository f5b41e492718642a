"""Where a collective was called from, and which callers are trusted to pass unchecked.

Trust is explicit: a ``with trusted():`` block, or a caller registered by module name
(:func:`register_trusted`). torch's own modules are registered (``broadcast_object_list`` calling
``broadcast``, DDP's join hooks), and so are lightning_sync's collectives (each public call is
checked once through its guard hook) and the portable SyncBatchNorm (symmetric by construction,
on the hot path).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterator
from typing import Any

from lightning_sync._compat.torch_api import LIGHTNING_RESULT_FILE

__all__ = ["CallSites", "is_trusted", "register_trusted", "trusted"]

_trusted_modules: set[str] = {"lightning_sync.collectives", "lightning_sync.batchnorm",
                              "lightning_sync._compat.torch_api"}
_trusted_prefixes: tuple[str, ...] = ("torch.",)
_local = threading.local()


def register_trusted(module: str, prefix: bool = False) -> None:
    """Collectives called from module ``module`` (``__name__``; with ``prefix``: and its submodules) pass unchecked.

    For code that issues collectives symmetric by construction on a hot path (e.g. a layer that
    all-reduces statistics on every rank in every forward).
    """
    global _trusted_prefixes
    if prefix:
        _trusted_prefixes = (*_trusted_prefixes, module.rstrip(".") + ".")
    _trusted_modules.add(module)


@contextlib.contextmanager
def trusted() -> Iterator[None]:
    """Collectives issued by this thread inside the block pass unchecked (they still end on a guard failure)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def is_trusted(frame: Any) -> bool:
    """True inside :func:`trusted` or when ``frame`` (the caller's) belongs to a registered module."""
    if getattr(_local, "depth", 0):
        return True
    name = frame.f_globals.get("__name__", "")
    return name in _trusted_modules or name.startswith(_trusted_prefixes)


def _library_dirs() -> tuple[str, ...]:
    """Directories whose frames are not the user's call site (the site is the first frame outside them)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    dirs = {here}
    for name in ("torch", "lightning", "lightning_fabric", "pytorch_lightning", "lightning_utilities",
                 "torchmetrics", "typing_extensions"):
        mod = sys.modules.get(name)
        path = getattr(mod, "__file__", None) if mod is not None else None
        if path:
            dirs.add(os.path.dirname(os.path.abspath(path)))
    dirs.update(_stdlib_dirs())
    return tuple(d + os.sep for d in sorted(dirs))


@functools.lru_cache(maxsize=1)
def _stdlib_dirs() -> tuple[str, ...]:
    """contextlib, functools, threading wrappers (sysconfig is slow to ask: once per process)."""
    paths = sysconfig.get_paths()
    return tuple(os.path.abspath(paths[key]) for key in ("stdlib", "platstdlib") if paths.get(key))


# The package's own training entry point is the user's code as far as call sites go: its ranks may
# start differently (rank 0 as the `lsync-train` console script, the others as `python -m`), so the
# frames outside it differ while its own lines are the same on every rank.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENTRY_POINTS = frozenset({os.path.join(_PACKAGE_DIR, "app", "train.py"),
                           os.path.join(_PACKAGE_DIR, "train.py")})  # (the main job's old module name)


_RESULT_SYNCS = frozenset({"compute", "update"})


class CallSites:
    """Finds ``file:line function`` of the innermost frame outside the libraries (cached per code object)."""

    def __init__(self, context: Callable[[], str | None] | None = None) -> None:
        self._lib_dirs = _library_dirs()
        self._is_lib: dict[int, bool] = {}
        self._codes: list[Any] = []
        self._text: dict[tuple[int, int], str] = {}
        self.context = context

    def find(self, frame: Any) -> str:
        lib = self._is_lib
        metric = None
        site = "?"
        while frame is not None:
            code = frame.f_code
            # keyed by id: hashing a code object hashes its contents (microseconds); the code objects
            # are kept alive in _codes so an id is never reused for another one
            is_lib = lib.get(id(code))
            if is_lib is None:
                self._codes.append(code)
                is_lib = lib[id(code)] = (code.co_filename.startswith(self._lib_dirs)
                                          and code.co_filename not in _ENTRY_POINTS)
            if not is_lib:
                key = (id(code), frame.f_lineno)
                site = self._text.get(key)  # type: ignore[assignment]
                if site is None:
                    filename = code.co_filename
                    if filename.startswith("<"):  # code rebuilt by cloudpickle (submitit): its module still knows
                        filename = str(frame.f_globals.get("__file__") or filename)
                    site = self._text[key] = f"{os.path.basename(filename)}:{frame.f_lineno} {code.co_name}"
                break
            if metric is None and code.co_name in _RESULT_SYNCS and code.co_filename.endswith(LIGHTNING_RESULT_FILE):
                # Lightning syncing a logged metric (per step in update, per epoch in compute): its name
                # tells two reductions apart, so ranks that sync different keys are a mismatch
                meta = getattr(frame.f_locals.get("self"), "meta", None)
                metric = getattr(meta, "name", None)
            frame = frame.f_back
        if metric:
            # No hook label: Lightning computes a metric wherever it is first read, and rank 0's progress
            # bar reads it in on_train_epoch_end while the other ranks' logger connector does after the
            # hooks; the metric's name is what identifies the reduction.
            return f"{site} (metric {metric!r})"
        hook = self.context() if self.context is not None else None
        if hook and not site.endswith(hook):
            site += f" [{hook}]"
        return site
