"""One node's share of a pre-flight stage: ``python -m trainguard.health.node TASK OUT``.

The agent starts it (and kills its process group past the task's deadline). TASK is the
task's JSON (see ``coordinator.Preflight.task_for``); OUT gets the result JSON, written
atomically, with the seconds each check took under ``times_s``. Stage ``node``: host checks
and GEMM. Stage ``net``: pair rounds of collectives, then the simulated training run.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def run_stage(task: dict[str, Any]) -> dict[str, Any]:
    node_id = str(task["node_id"])
    times: dict[str, float] = {}
    out: dict[str, Any] = {"stage": task["stage"], "node_id": node_id, "times_s": times}

    def timed(name: str, fn: Any) -> None:
        t0 = time.perf_counter()
        try:
            out[name] = fn()
        except Exception as e:  # noqa: BLE001 - a check that raises is a failed check
            out[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
            traceback.print_exc()
        times[name] = round(time.perf_counter() - t0, 3)

    if task["stage"] == "node":
        from trainguard.health import gemm, host

        timed(
            "host",
            lambda: host.measure(
                ckpt_dir=Path(task["ckpt_dir"]),
                shm_dir=Path(task["shm_dir"]),
                node_id=node_id,
                agent_pid=int(task["agent_pid"]),
                clock_skew_s=task.get("clock_skew_s"),
            ),
        )
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        timed(
            "gemm_correctness",
            lambda: gemm.known_answer(
                int(task["known_answer_n"]), device=device, corrupt="gemm-wrong" in task["inject"]
            ),
        )
        timed(
            "gemm",
            lambda: gemm.throughput(
                int(task["gemm_n"]),
                float(task["gemm_window_s"]),
                start_at=task.get("gemm_at"),
                device=device,
            ),
        )
    else:
        from trainguard.health import netcheck

        timed("pairs", lambda: netcheck.pair_rounds(task, node_id))
        timed("train", lambda: netcheck.sim_train(task, node_id))
    return out


def main(argv: list[str]) -> int:
    from trainguard.runtime.process import die_with_parent

    task = json.loads(Path(argv[0]).read_text())
    die_with_parent(int(task["agent_pid"]))  # the check dies with the agent that runs it
    result = run_stage(task)
    tmp = Path(f"{argv[1]}.tmp")
    tmp.write_text(json.dumps(result))
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
