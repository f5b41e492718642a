"""mkdocs hook (mkdocs.yml ``hooks:``): the docstrings' Sphinx roles (``:class:`~pkg.Name```) shown as code.

The package's docstrings are written for Python's ``help()`` and docs/api.md as well as for the site: they
use Sphinx's cross-reference roles, which mkdocstrings leaves as text (``:class: <code>~x.Name</code>``).
This turns each into the code span alone (``~`` keeps the last name, as Sphinx shows it).
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|func|meth|attr|mod|exc|data|obj):\s*<code>(~?)([\w.]+)(\(\))?</code>")


def _shown(match: re.Match[str]) -> str:
    tilde, name, call = match.group(1), match.group(2), match.group(3) or ""
    return f"<code>{name.rsplit('.', 1)[-1] if tilde else name}{call}</code>"


def on_page_content(html: str, **kwargs: Any) -> str:
    return _ROLE.sub(_shown, html)
