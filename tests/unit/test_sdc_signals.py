"""Silent corruption that fingerprints cannot see (issue 15): the drills (a corrupt gradient
before the all-reduce, optimizer state, a node whose GEMMs go wrong), the in-job GEMM probe
with its real probe process, the gradient-norm check, and what ``decide`` does with each
sign: quarantine a probed node, roll back past agreeing fingerprints, recompute a spike once."""

from __future__ import annotations

import os
import time

import pytest
import torch

from tests.unit.test_sdc import cfg, running
from trainguard.agent.probe import GemmProbe
from trainguard.checkpoint.sdc_drill import (
    GEMM_ERROR,
    GradFlip,
    WrongGemm,
    flip_bit,
    state_pointers,
)
from trainguard.controller.analysis import AnomalyDetector, DetectConfig
from trainguard.controller.api import Phase, Pool
from trainguard.controller.decide import decide
from trainguard.controller.jobstate import Inputs, Suspicion, known_good, suspect
from trainguard.controller.restore import restore_point
from trainguard.faults.inject import parse_inject
from trainguard.health.probe import KnownAnswer
from trainguard.protocol import StepRecord


def test_drill_specs_name_their_target_and_when_a_node_goes_wrong() -> None:
    spec = parse_inject("sdc:rank=1:step=20:target=grad:bit=30", 0)
    assert (spec.target, spec.bit, spec.step) == ("grad", 30, 20)
    assert spec.describe() == "sdc:rank=1:step=20:target=grad:bit=30"
    assert parse_inject("sdc:rank=1:step=20", 0).target == "param"
    with pytest.raises(ValueError, match="target must be one of param, grad, optimizer"):
        parse_inject("sdc:rank=1:step=20:target=loss", 0)
    with pytest.raises(ValueError, match="kill takes"):
        parse_inject("kill:rank=1:step=20:target=grad", 0)
    wrong = parse_inject("gemm-wrong:node=2:step=40", 0)
    assert (wrong.node, wrong.step, wrong.describe()) == (2, 40, "gemm-wrong:node=2:step=40")
    assert parse_inject("gemm-wrong:node=2", 0).step is None


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()  # the moments now exist (lazily created state)
    return model, optim


def test_an_optimizer_target_flips_a_moment_not_a_parameter() -> None:
    model, optim = _model_and_optim()
    state = {"model": model.state_dict(), "optim": optim.state_dict()}
    params = [p.detach().clone() for p in model.parameters()]
    moments = [t.clone() for st in optim.state.values() for t in st.values() if t.numel() > 1]
    got = flip_bit(state, 0, 22, among=state_pointers([optim], "optimizer"))
    assert "exp_avg" in got["key"], got
    assert all(torch.equal(a, b) for a, b in zip(params, model.parameters(), strict=True))
    now = [t for st in optim.state.values() for t in st.values() if t.numel() > 1]
    changed = [
        i for i, (a, b) in enumerate(zip(moments, now, strict=True)) if not torch.equal(a, b)
    ]
    assert len(changed) == 1 and now[changed[0]].view(-1)[0].item() == got["after"], got
    got = flip_bit(state, 0, 22, among=state_pointers([optim], "param"))
    assert got["key"].startswith("model."), got
    assert not torch.equal(params[0], next(model.parameters()))


def test_a_gradient_flip_fires_once_in_its_step_before_accumulation() -> None:
    model, _ = _model_and_optim()
    first = next(model.parameters())
    step = {"now": 1}
    fired: list[dict] = []
    GradFlip(first, 3, 30, lambda: step["now"], fired.append)
    x = torch.randn(2, 4)

    def grad_at(s: int) -> torch.Tensor:
        step["now"] = s
        model.zero_grad(set_to_none=True)
        model(x).sum().backward()
        assert first.grad is not None
        return first.grad.clone()

    clean = grad_at(2)
    bad = grad_at(3)
    assert len(fired) == 1 and fired[0]["target"] == "grad" and fired[0]["bit"] == 30
    assert bad.view(-1)[0] != clean.view(-1)[0] and torch.equal(
        bad.view(-1)[1:], clean.view(-1)[1:]
    )
    assert abs(bad.view(-1)[0].item()) > 1e30  # an exponent bit: the norm check's business
    assert torch.equal(grad_at(3), clean) and len(fired) == 1  # one-shot: the hook is gone


def test_wrong_gemm_moves_one_element_of_every_product_and_keeps_autograd() -> None:
    a, b = torch.randn(5, 6), torch.randn(6, 7)
    lin = torch.nn.Linear(6, 7)
    exact, y0 = a @ b, lin(a)
    mode = WrongGemm()
    with mode:
        wrong, y1 = torch.matmul(a, b), lin(a)
        y1.sum().backward()
    for got, want in ((wrong, exact), (y1.detach(), y0.detach())):
        diff = (got - want).abs()
        assert (diff > 0).sum() == 1 and diff.view(-1)[0] > 0
        assert diff.view(-1)[0] <= want.view(-1)[0].abs().clamp_min(1.0) * GEMM_ERROR * 1.01
    assert lin.weight.grad is not None
    assert torch.equal(a @ b, exact)  # outside the mode: right again


def test_the_probe_process_answers_and_names_a_wrong_product() -> None:
    k = KnownAnswer(64, "cpu")
    assert k.run(wrong=False)["mismatches"] == 0
    assert k.run(wrong=True)["first_bad"] == [0, 0]
    ctx = {"v": (0, 7, False)}
    probe = GemmProbe(lambda: ctx["v"], dict(os.environ))
    try:
        probe.set_period(0.2)
        deadline = time.monotonic() + 60
        while (probe.latest or {}).get("ok") is not True and time.monotonic() < deadline:
            time.sleep(0.1)
        first = probe.latest
        assert first is not None and first["ok"] is True and first["last_ok"] == [0, 7], first
        pid = probe.pid
        assert pid is not None
        ctx["v"] = (0, 12, True)  # the drill fired: this node's GEMMs are wrong now
        while (probe.latest or {}).get("ok") is not False and time.monotonic() < deadline:
            time.sleep(0.1)
        bad = probe.latest
        assert bad is not None and bad["ok"] is False and bad["step"] == 12, bad
        assert bad["last_ok"] == [0, 7] and bad["results"][0]["mismatches"] == 1
    finally:
        probe.close()
    assert probe.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _steps(norms: list[float], loss: float = 2.0) -> list[StepRecord]:
    return recs([{"step": i + 1, "loss": loss, "dur": 0.1, "gn": g} for i, g in enumerate(norms)])


def recs(items: list[dict]) -> list[StepRecord]:
    """Step records from their wire form (``t_end`` 0 where the test does not need one)."""
    return [StepRecord.from_json({"t_end": 0.0, **d}) for d in items]


def test_a_gradient_norm_far_out_of_line_is_flagged_and_ordinary_swings_are_not() -> None:
    det = AnomalyDetector(DetectConfig())
    calm = [1.0, 1.4, 0.7, 2.5, 0.9, 8.0, 1.1, 0.6]  # 8x swings: training, not corruption
    assert det.add(0, _steps(calm)) == []
    (kind, data), *_ = det.add(0, recs([{"step": 9, "loss": 2.0, "dur": 0.1, "gn": 3e4}]))
    assert kind == "grad_norm_spike" and data["step"] == 9 and data["ratio"] > 1000
    (kind, data), *_ = det.add(0, recs([{"step": 10, "loss": 2.0, "dur": 0.1, "gn": float("inf")}]))
    assert kind == "grad_norm_spike" and data["grad_norm"] == "inf"
    # A NaN loss is the loss's event (the script skips the step), not a gradient corruption.
    evs = det.add(0, recs([{"step": 11, "loss": float("nan"), "dur": 0.1, "gn": float("nan")}]))
    assert [k for k, _ in evs] == ["loss_nonfinite"]
    assert AnomalyDetector(DetectConfig(grad_ratio=0)).add(0, _steps([1.0] * 6 + [1e9])) == []


def _probe_sign(step: int, after: int | None, gen: int = 0) -> Inputs:
    return Inputs(suspected=[Suspicion(signal="gemm_probe", generation=0, step=step,
                                       node="node1", after=after, after_generation=gen,
                                       detail="its known-answer GEMM probe came out wrong")])  # fmt: skip


def test_a_failed_probe_quarantines_its_node_and_distrusts_agreeing_points_after_its_last_pass() -> (
    None
):
    s, obs = running(1000.0)
    for p in ((20, 0), (25, 0), (30, 0)):
        known_good(s, p)  # the replicas agreed: the corruption reached all of them alike
    new, events = decide(s, obs, 1000.0, cfg(), [], _probe_sign(32, 22))
    assert new.phase == Phase.STOPPING and new.recovery is not None
    fault = new.recovery.fault
    assert (fault.cause, fault.node_id, fault.step) == ("sdc", "node1", 32)
    assert new.pools["node1"] == Pool.FAULTY
    (det,) = [d for k, d in events if k == "sdc_detected"]
    assert (
        det["signal"] == "gemm_probe" and det["nodes"] == ["node1"] and det["suspect_after"] == 22
    )
    assert not suspect(new, (20, 0)) and suspect(new, (25, 0)) and suspect(new, (30, 0))
    durable = [(10, 0), (20, 0), (25, 0), (30, 0)]
    assert restore_point(new, obs, cfg(), durable, memory=False)[0] == (20, 0)


def test_a_probe_that_last_passed_in_an_older_generation_distrusts_this_ones_start() -> None:
    s, obs = running(1000.0)
    s.restore_step, s.restore_gen = 40, 0  # generation 0 restarted from its step 40 (below)
    new, _ = decide(s, obs, 1000.0, cfg(), [], _probe_sign(45, 50, gen=-1))
    assert new.suspect == [[40, 0]]  # min(last pass 50, this generation's start 40)
    new, _ = decide(s, obs, 1000.0, cfg(), [], _probe_sign(45, None))
    assert new.suspect == [[-1, 0]]  # never passed: nothing it computed is trusted


def test_a_gradient_spike_is_recomputed_once_and_believed_when_it_comes_back() -> None:
    s, obs = running(1000.0)
    sign = Inputs(suspected=[Suspicion(signal="grad_norm", generation=0, step=33, node=None,
                                       after=32, detail="gradient norm 3e+36")])  # fmt: skip
    new, events = decide(s, obs, 1000.0, cfg(), [], sign)
    assert new.recovery is not None and new.recovery.fault.cause == "sdc"
    assert new.recovery.fault.node_id is None and new.pools["node1"] == Pool.RUNNING
    assert new.suspect == [[32, 0]] and new.recomputed == [33]
    assert [k for k, _ in events if k.startswith("sdc")] == ["sdc_detected"]
    # The recomputed step spikes again: the data's, not a corruption; the job goes on.
    again, _ = running(1000.0)
    again.recomputed = [33]
    sign2 = Inputs(suspected=[Suspicion(signal="grad_norm", generation=0, step=33, node=None,
                                        after=32, detail="gradient norm 3e+36")])  # fmt: skip
    new, events = decide(again, obs, 1000.0, cfg(), [], sign2)
    assert new.phase == Phase.RUNNING and new.recovery is None and new.suspect == []
    (ruled,) = [d for k, d in events if k == "sdc_ruled_out"]
    assert ruled["step"] == 33 and "the data's" in ruled["reason"]
    # Off: no check, no fault; another generation's sign: stale.
    assert decide(s, obs, 1000.0, cfg(sdc_check=False), [], sign)[0].recovery is None
    stale = Inputs(suspected=[Suspicion(signal="grad_norm", generation=-1, step=33, node=None,
                                        after=32, detail="x")])  # fmt: skip
    assert decide(s, obs, 1000.0, cfg(), [], stale)[0].recovery is None
