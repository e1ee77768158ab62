"""Render ``docs/config.md`` from the config classes (``trainguard.controller.config``).

``python tools/config_doc.py`` writes the file; ``--check`` exits 1 when the committed file
differs from what the classes render (``tests/unit/test_config_doc.py`` checks the same).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "config.md"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only say whether the file is current")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT / "src"))  # this tree's classes, not an installed copy's
    from trainguard.controller.config_doc import render_doc

    text = render_doc()
    if args.check:
        current = DOC.read_text() if DOC.exists() else ""
        if current != text:
            print(f"{DOC.relative_to(ROOT)} is stale: run python tools/config_doc.py")
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
