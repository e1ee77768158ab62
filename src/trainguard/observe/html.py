"""The page that shows a job (``static/view.html``): served live by the controller at ``/``
(it polls ``/v1/view``), and written as one self-contained file by ``trainguard report
--html`` (the view and the chart script inlined: it opens offline, for a post-mortem).

The charts are ``static/charts.js``, this package's own SVG drawing (~10 KB): a report of a
10,000-step job of 8 ranks is 159 KB, where plotly.js alone was 4.8 MB in every report.
"""

from __future__ import annotations

import functools
import json
import math
from importlib import resources
from pathlib import Path
from typing import Any

CHARTS_PATH = "/static/charts.js"
SIGNIFICANT = 6  # digits a float keeps in an embedded view: charts draw 3, hovers show 3


@functools.cache
def charts_js() -> bytes:
    """The chart script (``static/charts.js``)."""
    return resources.files("trainguard.observe").joinpath("static/charts.js").read_bytes()


def _template() -> str:
    return resources.files("trainguard.observe").joinpath("static/view.html").read_text()


def _compact(x: Any) -> Any:
    """``x`` with every float rounded to SIGNIFICANT significant digits (wall-clock times,
    1.8e9 s, keep their milliseconds); non-finite floats become None (JSON has no NaN)."""
    if isinstance(x, float):
        if not math.isfinite(x):
            return None
        return float(f"{x:.{max(SIGNIFICANT, 13 if abs(x) > 1e8 else 0)}g}")
    if isinstance(x, dict):
        return {k: _compact(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_compact(v) for v in x]
    return x


def page(view: dict[str, Any] | None = None) -> str:
    """The live page (``view`` None: it fetches ``/v1/view`` and loads the chart script from
    the controller), or a self-contained one holding ``view`` and the chart script."""
    html = _template()
    if view is None:
        return html.replace("<!--CHARTS-->", f'<script src="{CHARTS_PATH}"></script>')
    data = json.dumps(_compact(view), default=str, separators=(",", ":"))
    data = data.replace("</", "<\\/")  # never closes the script tag
    js = charts_js().decode().replace("</", "<\\/")
    return html.replace("<!--CHARTS-->", f"<script>{js}</script>").replace("/*VIEW*/null", data)


class _Dashboard:
    """The live page as the controller serves it (``controller.http.Dashboard``; the CLI
    hands ``DASHBOARD`` to the ``Controller``, which never imports observe)."""

    script_path = CHARTS_PATH

    def page(self) -> str:
        return page()

    def script(self) -> bytes:
        return charts_js()

    def view(self, run_dir: Path) -> dict[str, Any]:
        from trainguard.observe.view import build_view

        return build_view(run_dir)


DASHBOARD = _Dashboard()


def write_report(run_dir: Path, out: Path) -> Path:
    """``trainguard report --html``: the run's view as one HTML file. Returns ``out``.
    Raises ValueError naming the fix for a directory or an unwritable path, FileNotFoundError
    for a run dir without a store."""
    from trainguard.observe.view import build_view

    if out.is_dir():
        raise ValueError(f"--html {out}: is a directory; give a file name, e.g. {out}/report.html")
    text = page(build_view(run_dir))
    tmp = out.with_name(out.name + ".tmp")
    try:
        tmp.write_text(text)
        tmp.replace(out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise ValueError(
            f"--html {out}: cannot write it ({e.strerror or e}); pick a writable path"
        ) from None
    return out
