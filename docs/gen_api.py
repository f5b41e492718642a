"""Write docs/api.md from the docstrings of lightning_sync's public names (``lightning_sync.__all__``).

    python docs/gen_api.py            # regenerate docs/api.md
    python docs/gen_api.py --check    # exit 1 if docs/api.md is out of date (tests/test_docs.py runs this)

A public module (``lightning_sync.collectives``) is documented through its own ``__all__``; a class
with its constructor signature and the public methods and properties it defines itself.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
import types
from pathlib import Path
from typing import Any

import lightning_sync

OUT = Path(__file__).resolve().parent / "api.md"
HEADER = """# API reference

Generated from the docstrings of `lightning_sync.__all__` by `python docs/gen_api.py`; do not edit
by hand (`tests/test_docs.py` fails when this file is out of date).
"""


class _Raw:
    """An annotation shown as written (``from __future__ import annotations`` makes them strings)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _unquote(annotation: Any) -> Any:
    return _Raw(annotation) if isinstance(annotation, str) else annotation


def _signature(obj: Any) -> str:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    sig = sig.replace(parameters=[p.replace(annotation=_unquote(p.annotation)) for p in sig.parameters.values()],
                      return_annotation=_unquote(sig.return_annotation))
    return re.sub(r" at 0x[0-9a-f]+", "", str(sig))  # default values must not leak memory addresses


def _block(text: str) -> str:
    """A ```text block long enough to hold any backticks inside ``text``."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text.rstrip()}\n{fence}\n"


def _doc(obj: Any) -> str:
    return inspect.getdoc(obj) or "(no docstring)"


def _members(cls: type) -> list[tuple[str, Any]]:
    """Public methods and properties defined by ``cls`` itself, or by a private base of this package it is built
    from (``_FaultTolerance``), that carry their own docstring."""
    found = []
    own = [base for base in reversed(cls.__mro__[1:]) if base.__name__.startswith("_")
           and base.__module__.startswith("lightning_sync")]
    members: dict[str, Any] = {}
    for source in (*own, cls):
        members.update(vars(source))
    for name, member in members.items():
        if name.startswith("_"):
            continue
        target = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
        if (inspect.isfunction(target) or isinstance(member, property)) and getattr(target, "__doc__", None):
            found.append((name, member))
    return found


def _entry(qualname: str, obj: Any, level: int = 2) -> str:
    head = "#" * level
    if inspect.isclass(obj):
        signature = _signature(obj).removesuffix(" -> None")  # a class call returns an instance
        parts = [f"{head} `{qualname}`\n", _block(f"class {obj.__name__}{signature}\n\n{_doc(obj)}")]
        for name, member in _members(obj):
            if isinstance(member, property):
                parts.append(_block(f"property {obj.__name__}.{name}\n\n{_doc(member)}"))
            else:
                fn = member.__func__ if isinstance(member, (classmethod, staticmethod)) else member
                parts.append(_block(f"{obj.__name__}.{name}{_signature(fn)}\n\n{_doc(fn)}"))
        return "\n".join(parts)
    if callable(obj):
        return f"{head} `{qualname}`\n\n" + _block(f"{obj.__name__}{_signature(obj)}\n\n{_doc(obj)}")
    return f"{head} `{qualname}`\n\n" + _block(f"{qualname} = {obj!r}")


def render() -> str:
    sections = [HEADER]
    for name in sorted(lightning_sync.__all__, key=str.lower):
        obj = getattr(lightning_sync, name)
        if isinstance(obj, types.ModuleType):
            sections.append(f"## `lightning_sync.{name}`\n\n" + _block(_doc(obj)))
            for sub in getattr(obj, "__all__", []):
                sections.append(_entry(f"lightning_sync.{name}.{sub}", getattr(obj, sub), level=3))
        else:
            sections.append(_entry(f"lightning_sync.{name}", obj))
    return "\n".join(sections)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with docs/api.md instead of writing it")
    args = p.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is out of date with the docstrings: run `python docs/gen_api.py`.", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
