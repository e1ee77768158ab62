"""The page that shows a job (``static/view.html``): served live by the controller at ``/``
(it polls ``/v1/view``), and written as one self-contained file by ``trainguard report
--html`` (the view and plotly.js inlined: it opens offline, for a post-mortem).

Charts are plotly.js, shipped inside the ``plotly`` Python package (MIT): no CDN.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path
from typing import Any

PLOTLY_PATH = "/static/plotly.min.js"


@functools.cache
def plotly_js() -> bytes:
    """plotly.min.js from the plotly package. Raises ValueError naming the fix if absent."""
    try:
        from plotly.offline import get_plotlyjs
    except ImportError:
        raise ValueError(
            "the dashboard and --html need the plotly package: pip install plotly"
        ) from None
    return get_plotlyjs().encode()


def _template() -> str:
    return resources.files("trainguard.observe").joinpath("static/view.html").read_text()


def page(view: dict[str, Any] | None = None) -> str:
    """The live page (``view`` None: it fetches ``/v1/view`` and loads plotly from the
    controller), or a self-contained one holding ``view`` and plotly.js."""
    html = _template()
    if view is None:
        return html.replace("<!--PLOTLY-->", f'<script src="{PLOTLY_PATH}"></script>')
    data = json.dumps(view, default=str).replace("</", "<\\/")  # never closes the script tag
    js = plotly_js().decode()
    return html.replace("<!--PLOTLY-->", f"<script>{js}</script>").replace("/*VIEW*/null", data)


class _Dashboard:
    """The live page as the controller serves it (``controller.http.Dashboard``; the CLI
    hands ``DASHBOARD`` to the ``Controller``, which never imports observe)."""

    script_path = PLOTLY_PATH

    def page(self) -> str:
        return page()

    def script(self) -> bytes:
        return plotly_js()

    def view(self, run_dir: Path) -> dict[str, Any]:
        from trainguard.observe.view import build_view

        return build_view(run_dir)


DASHBOARD = _Dashboard()


def write_report(run_dir: Path, out: Path) -> Path:
    """``trainguard report --html``: the run's view as one HTML file. Returns ``out``."""
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
