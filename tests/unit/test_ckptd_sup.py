"""The agent's ckptd supervisor on a node's leftover shared memory."""

from __future__ import annotations

from pathlib import Path

from trainguard.agent.ckptd_sup import clear_memory
from trainguard.checkpoint.prefetch import prefetch_root


def test_a_restarted_agent_clears_leftover_segments_and_keeps_the_prefetched_step(
    tmp_path: Path,
) -> None:
    """A SIGKILLed agent's successor finds its slots and its prefetched step (a directory):
    the slots go, the directory stays (it raised IsADirectoryError at every start: the chaos
    run's lost node never came back)."""
    slot = tmp_path / "trainguard-job1-node1-r0-s0"
    slot.write_bytes(b"x")
    (tmp_path / "trainguard-job1-node1-r0-s0.sum").write_text("{}")
    pre = prefetch_root(tmp_path, "job1", "node1")
    (pre / "step_5").mkdir(parents=True)
    clear_memory(sorted(tmp_path.glob("trainguard-job1-node1-*")))
    assert sorted(p.name for p in tmp_path.iterdir()) == [pre.name]
    assert (pre / "step_5").is_dir()
