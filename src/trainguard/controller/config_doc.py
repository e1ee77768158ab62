"""``docs/config.md``, rendered from the config classes (``controller/config.py``): a
header with an example file, then one table per section (field, type, default, doc).
``tools/config_doc.py`` writes it; ``tests/unit/test_config_doc.py`` holds the file to it."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from trainguard.controller.config import (
    COMMAND_LINE_FIELDS,
    SECTIONS,
    JobConfig,
    flat_name,
)
from trainguard.faults.inject import InjectSpec

DOC_HEADER = """\
# Configuration

<!-- Generated from src/trainguard/controller/config.py by `python tools/config_doc.py`:
edit the field docs there, then run it. tests/unit/test_config_doc.py checks this file. -->

`trainguard run` and `trainguard controller` take a TOML file of these fields with
`--config FILE`. A field may be given in its section or flat, at the top of the file (each
name is unique): `[checkpoint]` `keep_checkpoints = 3` and `keep_checkpoints = 3` are the
same setting. The one flat name that differs is the pre-flight level: `preflight = "off"`
is `[preflight]` `level = "off"`; a file that gives the level flat gives the checks'
thresholds as `[checks]` (TOML cannot make `preflight` a string and a table at once). A flag
given on the command line beats the file.

```toml
nodes = 2
standby = 1

[timeouts]
heartbeat_s = 0.5

[checkpoint]
keep_checkpoints = 3

[preflight]
level = "quick"

[preflight.checks]   # the checks' thresholds (docs/preflight.md)
gemm_min_ratio = 0.5
```
"""


def render_doc() -> str:
    """``docs/config.md``: the header, then one table per section (field, type, default,
    doc) from the config classes."""
    parts = [DOC_HEADER]
    parts.append(_doc_table("The job", JobConfig, skip=frozenset(SECTIONS)))
    for name, cls in SECTIONS.items():
        parts.append(_doc_table(f"`[{name}]`", cls))
    return "\n".join(parts)


def _doc_table(title: str, cls: type, *, skip: frozenset[str] = frozenset()) -> str:
    hints = typing.get_type_hints(cls)
    about = " ".join(line.strip() for line in (cls.__doc__ or "").strip().splitlines())
    about = about.replace("``", "`")
    rows = [f"## {title}", "", about, "", "| field | type | default | what it sets |",
            "|---|---|---|---|"]  # fmt: skip
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        name = f"`{f.name}`" + (f" (flat: `{flat_name(f)}`)" if flat_name(f) != f.name else "")
        default = _doc_default(f)
        if f.name in COMMAND_LINE_FIELDS:
            default += " (command line only)"
        doc = f.metadata["doc"] + (f" (`{f.metadata['flag']}`)" if "flag" in f.metadata else "")
        cells = [name, _doc_type(hints[f.name]), default, doc]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"


def _doc_type(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_doc_type(a) for a in args if a is not type(None))
    if origin is typing.Literal:
        return " | ".join(f'`"{a}"`' for a in args)
    if origin in (tuple, list):
        inner = args[0] if args else Any
        return "list of " + ("drills" if inner is InjectSpec else _doc_type(inner) + "s")
    if origin is dict:
        return "table"
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _doc_default(f: dataclasses.Field[Any]) -> str:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return "required"
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple | list):
        return "`[]`"
    if isinstance(value, dict):
        return "`{}`"
    return f"`{value}`"
