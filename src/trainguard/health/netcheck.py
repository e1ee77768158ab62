"""Collective checks between node pairs, and a short simulated data-parallel training run.

Both rendezvous through the controller's TCPStore (one prefix per pair and round), then
talk directly over gloo on the node's own interface (GLOO_SOCKET_IFNAME, set by the agent).

Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md): all-reduce busbw = algbw × 2(n−1)/n,
all-gather busbw = algbw × (n−1)/n, with algbw = bytes / time and, for all-gather, bytes the
gathered total. With pairs (n = 2) the all-reduce factor is 1.
"""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Any

import crc32c


def _store(host: str, port: int, timeout_s: float) -> Any:
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))


def _group(store: Any, prefix: str, rank: int, size: int, timeout_s: float) -> Any:
    import torch.distributed as dist

    return dist.ProcessGroupGloo(
        dist.PrefixStore(prefix, store), rank, size, datetime.timedelta(seconds=timeout_s)
    )


def _timed(pg: Any, op: str, t: Any, out: Any = None) -> float:
    t0 = time.perf_counter()
    if op == "allreduce":
        pg.allreduce([t]).wait()
    else:
        pg.allgather([out], [t]).wait()
    return time.perf_counter() - t0


def pair_bench(pg: Any, size_bytes: int, budget_s: float) -> dict[str, Any]:
    """All-reduce and all-gather of ``size_bytes`` (float32) between two ranks, and the
    latency of a one-element all-reduce (median of 20). Each repeated until ``budget_s`` or 10
    times (at least twice); the median time counts. Bandwidths in GB/s (1e9 bytes/s), latency
    in microseconds."""
    import torch

    n = size_bytes // 4
    t = torch.ones(n)
    out = [torch.empty(n), torch.empty(n)]
    res: dict[str, Any] = {"bytes": size_bytes}
    for op in ("allreduce", "allgather"):
        _timed(pg, op, t, out)  # warm-up: connection buffers
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < 2 or (len(times) < 10 and time.perf_counter() - start < budget_s):
            times.append(_timed(pg, op, t, out))
        med = statistics.median(times)
        if op == "allreduce":
            res["allreduce_busbw_gbps"] = round(size_bytes / med / 1e9 * 2 * (2 - 1) / 2, 4)
        else:
            res["allgather_busbw_gbps"] = round(2 * size_bytes / med / 1e9 * (2 - 1) / 2, 4)
    one = torch.ones(1)
    _timed(pg, "allreduce", one)
    lat = [_timed(pg, "allreduce", one) for _ in range(20)]
    res["latency_us"] = round(statistics.median(lat) * 1e6, 1)
    return res


def pair_rounds(task: dict[str, Any], node_id: str) -> list[dict[str, Any]]:
    """Run this node's pair checks, round after round: ``task["rounds"]`` is a list of
    ``partner node id or None`` (None = sits this round out). A round's failure (partner
    absent past ``pair_timeout_s``, connection lost) is recorded in ``error`` and the next
    round goes on."""
    store = _store(task["store_host"], int(task["store_port"]), float(task["pair_timeout_s"]))
    out = []
    for r, partner in enumerate(task["rounds"]):
        if partner is None:
            continue
        a, b = sorted((node_id, partner))
        rec: dict[str, Any] = {"round": r, "partner": partner}
        t0 = time.perf_counter()
        try:
            pg = _group(
                store,
                f"{task['run']}/r{r}/{a}/{b}/",
                0 if node_id == a else 1,
                2,
                float(task["pair_timeout_s"]),
            )
            rec.update(pair_bench(pg, int(task["pair_bytes"]), float(task["pair_budget_s"])))
            del pg
        except Exception as e:  # noqa: BLE001 - any failure of a round is its result
            rec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        out.append(rec)
    return out


def sim_train(task: dict[str, Any], node_id: str) -> dict[str, Any]:
    """A few data-parallel SGD steps of a small MLP (256→512→256, float32) across the
    ``task["train_nodes"]`` (one rank each): gradients averaged by all-reduce. Every replica
    must end with the same parameters; ``fingerprint`` is the CRC-32C of their bytes.
    Returns ``{"world", "steps", "losses", "step_s"`` (median), ``"fingerprint"}``."""
    import torch

    nodes = list(task["train_nodes"])
    rank, world = nodes.index(node_id), len(nodes)
    torch.manual_seed(0)  # the same initial parameters on every replica
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1000 + rank)  # each rank its own data shard
    pg = None
    if world > 1:
        store = _store(task["store_host"], int(task["store_port"]), float(task["pair_timeout_s"]))
        pg = _group(store, f"{task['run']}/train/", rank, world, float(task["pair_timeout_s"]))
    losses, times = [], []
    for _ in range(int(task["train_steps"])):
        t0 = time.perf_counter()
        x = torch.randn(64, 256, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
        if pg is not None:
            pg.allreduce([flat]).wait()
            flat /= world
        i = 0
        for p in model.parameters():
            p.grad.copy_(flat[i : i + p.numel()].view_as(p))  # type: ignore[union-attr]
            i += p.numel()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(round(float(loss), 6))
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {
        "world": world,
        "steps": len(losses),
        "losses": losses,
        "step_s": round(statistics.median(times), 4),
        "fingerprint": f"{crc32c.crc32c(params.numpy().tobytes()):08x}",
        "finite": bool(torch.isfinite(params).all()) and all(x == x for x in losses),
    }
