"""deploy/k8s/trainguard.yaml against the Kubernetes OpenAPI schema (kubernetes-validate's
copy of 1.37's, strict: no unknown field), and against trainguard itself: every command line
parses with trainguard's own CLI, the job config is a valid JobConfig, and the pieces refer to
each other by the right names. No cluster is available here: nothing is applied."""

from __future__ import annotations

import tomllib
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from trainguard.cli.main import _parser
from trainguard.controller.config import COMMAND_LINE_FIELDS, JobConfig, group_fields

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "trainguard.yaml"
K8S = "1.37.0"


def _docs() -> dict[str, dict]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


@pytest.mark.parametrize(
    "kind", ["ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "Job"]
)
def test_each_resource_follows_the_kubernetes_schema(kind: str) -> None:
    kubernetes_validate.validate(_docs()[kind], K8S, strict=True)


def test_the_resources_fit_trainguard_and_each_other() -> None:
    d = _docs()
    ctl = d["Deployment"]["spec"]["template"]["spec"]
    agent = d["Job"]["spec"]["template"]["spec"]
    parser = _parser()
    c = ctl["containers"][0]
    a = agent["containers"][0]
    cargs = parser.parse_args([*c["command"][1:], *c["args"]])
    aargs = parser.parse_args([*a["command"][1:], *a["args"]])
    assert c["command"][0] == a["command"][0] == "trainguard"
    # The agents reach the controller through the Service, on the port it binds.
    svc = d["Service"]
    host, port = aargs.controller.rsplit(":", 1)
    assert host == svc["metadata"]["name"]
    assert int(port) == int(cargs.bind.rsplit(":", 1)[1])
    pod_labels = d["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["port"] for p in svc["spec"]["ports"]} == {8470, 9400}
    # One agent per node and standby; both sides read the same token and run dir.
    assert d["Job"]["spec"]["completions"] == int(cargs.nodes) + cargs.standby
    assert cargs.token_file == aargs.token_file and cargs.run_dir == aargs.run_dir
    mounts = {m["name"]: m["mountPath"] for m in a["volumeMounts"]}
    assert str(aargs.token_file).startswith(mounts["token"]) and str(aargs.run_dir) == mounts["run"]
    secrets = {
        v["secret"]["secretName"] for s in (ctl, agent) for v in s["volumes"] if "secret" in v
    }
    assert secrets == {"trainguard-token"}
    claims = {v["persistentVolumeClaim"]["claimName"] for s in (ctl, agent)
              for v in s["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    assert claims == {d["PersistentVolumeClaim"]["metadata"]["name"]}
    # The job config is one trainguard accepts, and pods outlive a stop's save.
    toml = tomllib.loads(d["ConfigMap"]["data"]["job.toml"])
    fields = group_fields(toml, skip=COMMAND_LINE_FIELDS, check_types=True)
    cfg = JobConfig.from_fields(script="train.py", run_dir="/run/trainguard", **fields)
    for spec in (ctl, agent):
        assert spec["terminationGracePeriodSeconds"] > max(
            cfg.timeouts.stop_grace_s, cfg.timeouts.stop_persist_timeout_s
        )
    assert cfg.metrics.metrics_bind and cfg.metrics.metrics_bind.endswith(":9400")
    assert any(m["mountPath"] == "/dev/shm" for m in a["volumeMounts"])
