"""The controller's report endpoint against bad input (issue 14): a malformed, oversized,
unauthenticated or too-new report is refused with a clear status, and the controller goes
on serving (a real ``trainguard controller`` process, real HTTP)."""

from __future__ import annotations

import http.client
import json
import signal
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import GPT, ROOT, trainguard_cmd, wait_for
from trainguard.protocol import MAX_REPORT_BYTES, PROTOCOL_VERSION


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, str]]:
    run = tmp_path_factory.mktemp("protocol") / "run"
    proc = subprocess.Popen(
        trainguard_cmd("controller", "--bind", "127.0.0.1:0", "--run-dir", run, "--nodes", "1",
                       GPT, "--steps", "1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip

    def addr() -> str | None:
        try:
            return str(json.loads((run / "controller.json").read_text())["addr"])
        except (OSError, ValueError, KeyError):
            return None

    try:
        host, port = str(wait_for(addr, 60, "the controller to listen")).rsplit(":", 1)
        yield host, int(port), (run / "token").read_text().strip()
        assert proc.poll() is None, "the controller died"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _post(c: tuple[str, int, str], body: bytes, *, token: bool = True) -> tuple[int, str]:
    host, port, tok = c
    conn = http.client.HTTPConnection(host, port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {tok}"
    try:
        conn.request("POST", "/v1/report", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode(errors="replace")
    except (ConnectionResetError, BrokenPipeError):  # the server may close mid-upload (413)
        return 413, "connection closed"
    finally:
        conn.close()


GOOD = {
    "v": PROTOCOL_VERSION,
    "node_id": "node0",
    "addr": "127.0.0.2",
    "incarnation": "abc",
    "generation": None,
    "workers": [],
    "events": [],
    "steps": [],
    "memory": {},
}


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b"{not json", 400, "malformed report"),
        (b"[1, 2]", 400, "a report is a JSON object"),
        (json.dumps({**GOOD, "node_id": ""}).encode(), 400, "node_id"),
        (json.dumps({k: v for k, v in GOOD.items() if k != "addr"}).encode(), 400, "addr"),
        (
            json.dumps({**GOOD, "workers": [{"rank": 0, "state": "dancing"}]}).encode(),
            400,
            "workers[].state",
        ),
        (json.dumps({**GOOD, "memory": {"0": [[1]]}}).encode(), 400, "memory[0]"),
        (json.dumps({**GOOD, "v": PROTOCOL_VERSION + 1}).encode(), 400, "protocol version"),
    ],
)
def test_a_malformed_report_gets_400_with_the_reason_and_the_controller_goes_on(
    controller: tuple[str, int, str], body: bytes, status: int, says: str
) -> None:
    got, text = _post(controller, body)
    assert got == status and says in text, (got, text)
    assert _post(controller, json.dumps(GOOD).encode())[0] == 200  # still serving


def test_an_oversized_or_unauthenticated_report_is_refused(
    controller: tuple[str, int, str],
) -> None:
    assert _post(controller, json.dumps(GOOD).encode(), token=False)[0] == 401
    huge = json.dumps({**GOOD, "events": [{"kind": "x" * 1000}] * (MAX_REPORT_BYTES // 1000)})
    assert _post(controller, huge.encode())[0] == 413
    got, text = _post(controller, json.dumps(GOOD).encode())
    assert got == 200 and "desired" in json.loads(text)


def test_the_health_probe_answers_without_a_token_and_says_nothing_of_the_job(
    controller: tuple[str, int, str],
) -> None:
    """``GET /healthz`` (Kubernetes' liveness and readiness probes, deploy/k8s): 200 with the
    phase and the decision loop's tick age while it ticks, no token needed; the job's data
    still needs one. A process frozen (SIGSTOP) does not answer at all: the probe times out,
    which is the liveness signal (tests/unit/test_k8s_manifests.py checks the probes)."""
    host, port, _ = controller
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request("GET", "/healthz")
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert resp.status == 200 and body["ok"] is True, body
        assert body["phase"] == "PENDING" and 0 <= body["tick_age_s"] < 5, body
        assert set(body) == {"ok", "phase", "tick_age_s"}
        conn.request("GET", "/v1/status")
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 401
    finally:
        conn.close()
