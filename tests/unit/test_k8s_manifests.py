"""deploy/k8s/trainguard.yaml against the Kubernetes OpenAPI schema (kubernetes-validate's
copy of 1.37's, offline, strict: no unknown field), and against trainguard itself: every
command line (the preStop's too) parses with trainguard's own CLI, the job config is a valid
JobConfig, the store is on a ReadWriteOnce volume and the durable tier on the shared one, and
the pieces refer to each other by the right names. No cluster is available here: nothing is
applied."""

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


def _all() -> list[dict]:
    return list(yaml.safe_load_all(MANIFEST.read_text()))


def _docs() -> dict[str, dict]:
    """Each kind's resource (PodDisruptionBudget: the controller's)."""
    return {d["kind"]: d for d in reversed(_all())}


@pytest.mark.parametrize("doc", _all(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_each_resource_follows_the_kubernetes_schema(doc: dict) -> None:
    kubernetes_validate.validate(doc, K8S, strict=True)


def test_the_resources_fit_trainguard_and_each_other() -> None:
    d = _docs()
    assert set(d) == {"ConfigMap", "PersistentVolumeClaim", "Service", "StatefulSet",
                      "PodDisruptionBudget", "Job"}  # fmt: skip
    sts = d["StatefulSet"]["spec"]
    ctl = sts["template"]["spec"]
    agent = d["Job"]["spec"]["template"]["spec"]
    parser = _parser()
    c = ctl["containers"][0]
    a = agent["containers"][0]
    cargs = parser.parse_args([*c["command"][1:], *c["args"]])
    aargs = parser.parse_args([*a["command"][1:], *a["args"]])
    assert c["command"][0] == a["command"][0] == "trainguard"
    # One controller: a StatefulSet of one, its pod found through its (headless) Service,
    # which keeps it in DNS whatever its readiness.
    svc = d["Service"]
    assert sts["replicas"] == 1 and sts["serviceName"] == svc["metadata"]["name"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"]
    host, port = aargs.controller.rsplit(":", 1)
    assert host == svc["metadata"]["name"]
    assert int(port) == int(cargs.bind.rsplit(":", 1)[1])
    pod_labels = sts["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["port"] for p in svc["spec"]["ports"]} == {8470, 9400}
    # One agent per node and standby; both sides read the same token.
    assert d["Job"]["spec"]["completions"] == int(cargs.nodes) + cargs.standby
    assert cargs.token_file == aargs.token_file
    mounts = {m["name"]: m["mountPath"] for m in a["volumeMounts"]}
    assert str(aargs.token_file).startswith(mounts["token"])
    secrets = {
        v["secret"]["secretName"] for s in (ctl, agent) for v in s["volumes"] if "secret" in v
    }
    assert secrets == {"trainguard-token"}
    # The store on the controller's own ReadWriteOnce volume (SQLite's WAL needs a local
    # filesystem); the durable tier and the agents' run dir (logs) on the shared volume.
    (store,) = sts["volumeClaimTemplates"]
    assert store["spec"]["accessModes"] == ["ReadWriteOnce"]
    cmounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert str(cargs.run_dir) == cmounts[store["metadata"]["name"]]
    shared = d["PersistentVolumeClaim"]
    assert shared["spec"]["accessModes"] == ["ReadWriteMany"]
    claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for s in (ctl, agent)
              for v in s["volumes"] if "persistentVolumeClaim" in v}  # fmt: skip
    assert set(claims.values()) == {shared["metadata"]["name"]}
    toml = tomllib.loads(d["ConfigMap"]["data"]["job.toml"])
    fields = group_fields(toml, skip=COMMAND_LINE_FIELDS, check_types=True)
    cfg = JobConfig.from_fields(script="train.py", run_dir=str(cargs.run_dir), **fields)
    for mount in (cmounts["shared"], mounts["shared"]):
        assert cfg.ckpt_dir.startswith(mount + "/") and str(aargs.run_dir).startswith(mount + "/")
    # Probes on the health endpoint (no token); a preStop that is trainguard's planned stop,
    # waited for within the grace period; pods outlive a stop's save.
    for probe in ("readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "api"}
    stop = c["lifecycle"]["preStop"]["exec"]["command"]
    sargs = parser.parse_args(stop[1:])
    assert stop[0] == "trainguard" and sargs.cmd == "stop"
    assert sargs.controller.endswith(f":{port}") and sargs.token_file == cargs.token_file
    assert cfg.timeouts.stop_persist_timeout_s < sargs.wait < ctl["terminationGracePeriodSeconds"]
    for spec in (ctl, agent):
        assert spec["terminationGracePeriodSeconds"] > max(
            cfg.timeouts.stop_grace_s, cfg.timeouts.stop_persist_timeout_s
        )
        assert all("requests" in k["resources"] for k in spec["containers"])
    # Disruption budgets: the controller is never evicted by a drain; one agent at a time.
    pdbs = {p["metadata"]["name"]: p["spec"] for p in _all() if p["kind"] == "PodDisruptionBudget"}
    assert pdbs["trainguard-controller"]["maxUnavailable"] == 0
    assert pdbs["trainguard-controller"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pdbs["trainguard-agents"]["maxUnavailable"] <= cargs.standby
    agent_labels = d["Job"]["spec"]["template"]["metadata"]["labels"]
    assert pdbs["trainguard-agents"]["selector"]["matchLabels"].items() <= agent_labels.items()
    assert cfg.metrics.metrics_bind and cfg.metrics.metrics_bind.endswith(":9400")
    assert any(m["mountPath"] == "/dev/shm" for m in a["volumeMounts"])
