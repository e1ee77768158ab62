"""Terminal output of every CLI command: text from outside is printed as text.

Exception messages, tracebacks, node ids and paths may hold ``[...]`` (gloo's
``[/…/pair.cc:152]``), which rich would read as markup and either restyle or reject with
``MarkupError``. Every console is made here with markup, highlighting and emoji codes off;
styles are given as ``Text`` spans (``styled``), never written into strings. The width is
the terminal's (``$COLUMNS``, 80 when not a terminal): tables wrap, never forced wider.
"""

from __future__ import annotations

from rich.console import Console
from rich.text import Text


def console(*, stderr: bool = False) -> Console:
    return Console(markup=False, highlight=False, emoji=False, stderr=stderr)


def styled(*parts: str | tuple[str, str]) -> Text:
    """``Text`` from plain strings and ``(text, style)`` pairs, none of it parsed."""
    return Text.assemble(*parts)


def plural(n: int, one: str, many: str | None = None) -> str:
    """``n`` and the word: "1 recovery", "2 recoveries" (``many``: one + "s" if not given)."""
    return f"{n} {one if n == 1 else many or one + 's'}"
