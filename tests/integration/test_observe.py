"""Seeing a job (issue 17): Prometheus metrics scraped and parsed with prometheus_client's own
parser, the live dashboard and the HTML report rendered by a real headless Chromium (Debian's
``chromium``), all on one real job with a worker SIGKILLed mid-run."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import FAST_CONFIG, ROOT, TINY, events, finish_job, start_job, wait_for
from tests.helpers.browser import chromium, dom, screenshot
from tests.helpers.rundir import html_report, synthetic_run
from tests.helpers.s3server import free_port

ARTIFACTS = Path(os.environ.get("TRAINGUARD_ARTIFACTS", "/tmp/trainguard-artifacts"))
SCREENSHOTS = ROOT / "docs"  # the README's pictures, refreshed by this test


def _scrape(port: int, token: str | None = None) -> dict[str, list[tuple[dict[str, str], float]]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        out.setdefault("#families", []).append(
            ({"name": fam.name + ("_total" if fam.type == "counter" else "")}, 0.0)
        )
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def _body(html: str) -> dict[str, str]:
    tag = re.search(r"<body([^>]*)>", html)
    assert tag is not None, html[:500]
    return dict(re.findall(r'data-([a-z-]+)="([^"]*)"', tag.group(1)))


@pytest.mark.slow  # one real job, a headless browser (CI's slow run)
@pytest.mark.timeout(900)
@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_metrics_dashboard_and_html_report_show_a_recovery(tmp_path: Path) -> None:
    port = free_port()
    config = FAST_CONFIG + f'metrics_bind = "127.0.0.1:{port}"\nmetrics_open = true\n'
    run = tmp_path / "run"
    args = [*TINY, "--steps", "100000", "--durable-every", "10"]
    job = start_job(
        run, ["--nodes", "2", "--nproc-per-node", "2", "--inject", "kill:rank=1:step=20"], args,
        config=config,
    )  # fmt: skip
    try:
        wait_for(
            lambda: any(e["kind"] == "recovery_completed" for e in events(run)), 180, "a recovery"
        )
        wait_for(lambda: _scrape(port).get("trainguard_straggler_score"), 300, "straggler scores")
        m = _scrape(port)  # no token: metrics_open on the metrics address
        value = {name: samples[0][1] for name, samples in m.items() if len(samples) == 1}
        assert value["trainguard_restarts_total"] >= 1
        assert {lab["cause"] for lab, _ in m["trainguard_faults_total"]} == {"worker_crash"}
        phases = {lab["phase"]: v for lab, v in m["trainguard_recovery_phase_seconds_count"]}
        assert phases.get("total", 0) >= 1 and phases.get("detect", 0) >= 1, phases
        assert 0 < value["trainguard_goodput_ratio"] <= 1
        assert value["trainguard_steps_per_second"] > 0
        assert value["trainguard_checkpoint_save_stall_seconds"] >= 0
        assert value["trainguard_checkpoint_save_stalled_seconds_total"] > 0
        assert 0 <= value["trainguard_checkpoint_durable_lag_steps"] <= 40
        tiers = {lab["tier"]: v for lab, v in m["trainguard_checkpoint_bytes"]}
        assert tiers.get("durable", 0) > 10_000, tiers
        assert len(m["trainguard_straggler_score"]) == 4
        pools = {lab["pool"]: v for lab, v in m["trainguard_nodes"]}
        assert pools["running"] == 2
        # The Grafana dashboard in the repo asks only for metrics the controller exports.
        grafana = json.loads((ROOT / "deploy" / "grafana" / "trainguard.json").read_text())
        asked = {
            name
            for p in grafana["panels"]
            for t in p["targets"]
            for name in re.findall(r"\b(trainguard_[a-z_]+)", t["expr"])
        }
        exported = {lab["name"] for lab, _ in m["#families"]} | set(m)
        assert asked and asked <= exported, asked - exported
        # The job's API still wants its token for /metrics; the view token reads, never writes.
        addr = json.loads((run / "controller.json").read_text())["addr"]
        api = int(addr.rsplit(":", 1)[1])
        with pytest.raises(urllib.error.HTTPError, match="401"):
            _scrape(api)
        view_token = (run / "view-token").read_text().strip()
        assert _scrape(api, view_token)["trainguard_restarts_total"]
        stop = urllib.request.Request(f"http://{addr}/v1/stop", method="POST", data=b"{}")
        stop.add_header("Authorization", f"Bearer {view_token}")
        with pytest.raises(urllib.error.HTTPError, match="401"):
            urllib.request.urlopen(stop, timeout=10)
        # The live dashboard, logged in through the URL fragment (never sent to the server).
        url = f"http://{addr}/#token={view_token}"
        html, log = dom(url)
        body = _body(html)
        assert body["errors"] == "0" and "Uncaught" not in log, log[-2000:]
        assert int(body["loss-points"]) > 0 and int(body["recoveries"]) >= 1, body
        assert html.count('class="pool-running"') == 2, html[-3000:]
        assert "all 2 · normal 2 · abnormal 0 · standby 0 · running 2" in html
        assert body["charts"] == "5" and html.count('<svg class="tg-chart"') == 5  # charts drawn
        shot = screenshot(url, ARTIFACTS / "dashboard.png")
        assert view_token not in (run / "events.jsonl").read_text()
    finally:
        if job.poll() is None:
            job.send_signal(signal.SIGTERM)
        code, err = finish_job(job, timeout=120)
    assert code == 128 + signal.SIGTERM, err[-2000:]
    # The post-mortem: one self-contained file, opened from disk with no server.
    report = tmp_path / "report.html"
    text = html_report(run, report, timeout=120)
    assert "<script src=" not in text and "<link" not in text  # nothing fetched: works offline
    html, log = dom(report.as_uri())
    body = _body(html)
    assert body["errors"] == "0" and int(body["loss-points"]) > 0, (body, log[-2000:])
    assert int(body["recoveries"]) >= 1 and html.count('<svg class="tg-chart"') == 5
    report_shot = screenshot(report.as_uri(), ARTIFACTS / "report.png")
    if os.environ.get("TRAINGUARD_UPDATE_SCREENSHOTS"):
        SCREENSHOTS.mkdir(exist_ok=True)
        (SCREENSHOTS / "dashboard.png").write_bytes(shot.read_bytes())
        (SCREENSHOTS / "report.png").write_bytes(report_shot.read_bytes())


@pytest.mark.slow  # a headless browser (CI's slow run)
@pytest.mark.timeout(600)
@pytest.mark.skipif(chromium() is None, reason="needs Debian's chromium (apt-get install chromium)")
def test_the_html_report_of_a_10000_step_job_renders_offline(tmp_path: Path) -> None:
    """Issue 32: the report of a 10,000-step job (tests/helpers/rundir.py; its size:
    tests/unit/test_html_report.py), opened from disk by Chromium: every chart drawn, the
    loss thinned to 2,001 points, the recovery on its timeline, no script error."""
    run = synthetic_run(tmp_path / "run", steps=10_000)
    report = tmp_path / "report.html"
    html_report(run, report)
    html, log = dom(report.as_uri())
    body = _body(html)
    assert body["errors"] == "0" and "Uncaught" not in log, log[-2000:]
    assert body["charts"] == "5" and html.count('<svg class="tg-chart"') == 5, body
    assert body["loss-points"] == "2001" and body["recoveries"] == "1", body
    assert "#1 worker_crash rank 1 (node0): restart" in html  # the timeline's row
    screenshot(report.as_uri(), ARTIFACTS / "report-10000-steps.png")


@pytest.mark.slow  # the README's main job with its pre-flight (CI's slow run)
@pytest.mark.timeout(900)
def test_the_readme_main_job_shows_a_live_status_line_and_rank0_output_on_a_terminal(
    tmp_path: Path,
) -> None:
    """The README's main job, its ``trainguard run`` taken literally, on a pseudo-terminal:
    the status line is redrawn in place (each redraw clears the line first), rank 0's output
    streams with its prefix, and the job recovers from its injected kill and exits 0."""
    import fcntl
    import pty
    import select
    import shlex
    import struct
    import termios

    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if "&& trainguard run " in x)
    argv = shlex.split(line.split("&& trainguard run ", 1)[1])
    run = tmp_path / "run"
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # 160 columns
    cmd = [sys.executable, "-m", "trainguard", "run", "--run-dir", str(run), *argv]
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT)
    os.close(slave)
    out = b""
    deadline = time.monotonic() + 400
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 1.0)
            if ready:
                try:
                    data = os.read(master, 1 << 16)
                except OSError:  # the terminal closed: every writer exited
                    break
                if not data:
                    break
                out += data
            elif proc.poll() is not None:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=60)
        os.close(master)
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    redraws = [s for s in text.split("\r\x1b[2K") if s.startswith("trainguard │")]
    assert len(redraws) >= 5, text[-3000:]
    assert any(" step " in s and "steps/s" in s and "loss" in s for s in redraws), redraws[-5:]
    assert any("restarts 1" in s for s in redraws), redraws[-5:]
    assert "[rank0]:" in text and "[rank1]:" not in text  # rank 0's output only, by default


def test_a_metrics_address_in_use_and_an_html_path_that_is_a_directory_are_one_line_errors(
    tmp_path: Path,
) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cfg = tmp_path / "job.toml"
        cfg.write_text(FAST_CONFIG + f'metrics_bind = "127.0.0.1:{port}"\n')
        res = subprocess.run(
            [sys.executable, "-m", "trainguard", "run", "--run-dir", str(tmp_path / "run"),
             "--config", str(cfg), str(ROOT / "examples" / "gpt" / "train.py")],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert res.returncode == 2, res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert "cannot listen there" in last and "Traceback" not in res.stderr, res.stderr[-2000:]
    res = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", "--run-dir", str(tmp_path / "run"),
         "--html", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert res.returncode == 2 and "is a directory" in res.stderr.strip().splitlines()[-1]
    assert not list(tmp_path.glob("*.tmp"))
