"""Verdicts of a pre-flight run: which nodes pass, and why the others do not (pure functions).

Thresholds are relative to the pool (the median over the nodes checked together), because
what is normal depends on the hardware; a run of fewer than 3 nodes (re-checking a repaired
node) is compared with the reference saved from the last run of 3 or more. Each default
below says where it comes from.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import statistics
from typing import Any

from trainguard.health.host import MIN_FREE_DISK, MIN_FREE_MEMORY, MIN_FREE_SHM

LEVELS = ("quick", "full")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CheckConfig:
    """Pre-flight settings. Every field can be set in ``trainguard check --config FILE``."""

    level: str = "quick"
    # A node is slow when its GEMM rate is below this fraction of the pool median. Identical
    # nodes measure within a few percent of each other; simulated nodes sharing two cores
    # here differ by up to ~30%. 0.5 flags a node that would halve a synchronous job's pace
    # (the seed, section 六: the slowest rank sets every step's time).
    gemm_min_ratio: float = 0.5
    # A pair's collective bus bandwidth below this fraction of the pool's is slow; the same
    # reasoning as gemm_min_ratio.
    bandwidth_min_ratio: float = 0.5
    # A pair's small-message latency above max(ratio × pool, pool + slack) is slow. Loopback
    # latency here is 50–300 µs and jumps when cores are shared, hence a wide factor.
    latency_max_ratio: float = 4.0
    latency_slack_us: float = 2000.0
    # A node is abnormal for collectives only when slow with this many different partners:
    # a slow pair alone cannot say which end is at fault (issue 5; the seed's pairing rounds).
    slow_partners: int = 2
    # 1-minute load per logical CPU above this, and above twice the pool median, before any
    # job runs means something else is computing there (NHC's check_ps_loadavg idea).
    max_load_per_core: float = 1.0
    # Clock skew against the controller. NTP keeps servers within milliseconds; a second
    # skews every phase time and timeout the controller computes from agents' clocks.
    max_clock_skew_s: float = 1.0
    # GPUs (NVML): temperatures above 85 °C throttle data-center GPUs (NVIDIA's slowdown
    # thresholds are 87–90 °C); any volatile uncorrected ECC error means a bad memory page;
    # memory in use before the job is a leftover process.
    gpu_max_temp_c: int = 85
    gpu_max_memory_used: int = 1 << 30
    min_free_memory: int = MIN_FREE_MEMORY
    min_free_disk: int = MIN_FREE_DISK
    min_free_shm: int = MIN_FREE_SHM
    # Stage deadlines (a node that has not answered by then fails with that reason). The
    # node stage allows a throttled node to import torch; pairs wait this long for a partner.
    node_stage_timeout_s: float = 120.0
    pair_timeout_s: float = 30.0
    # An inconclusive run (the check's own machinery failed) is retried after this, doubling
    # each time (capped at 60 s): time for a passing load spike to pass.
    inconclusive_backoff_s: float = 5.0

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise ValueError(f"--level {self.level}: use quick or full")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "level" and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise ValueError(f"{f.name} = {v!r}: must be a number")
            if f.name != "level" and v < 0:
                raise ValueError(f"{f.name} = {v!r}: must be >= 0")

    def sizes(self) -> dict[str, Any]:
        """The work of each check at this level (what the node stage and net stage run)."""
        if self.level == "quick":
            return {
                "known_answer_n": 512,
                "gemm_n": 512,
                "gemm_window_s": 1.0,
                "pair_bytes": 8 << 20,
                "pair_budget_s": 0.5,
                "max_rounds": 3,
                "train_steps": 5,
            }
        return {
            "known_answer_n": 1024,
            "gemm_n": 1024,
            "gemm_window_s": 3.0,
            "pair_bytes": 64 << 20,
            "pair_budget_s": 2.0,
            "max_rounds": None,
            "train_steps": 30,
        }


def schedule(nodes: list[str], max_rounds: int | None) -> list[dict[str, str]]:
    """Pairing rounds by the circle method (a round-robin tournament): in each round every
    node meets one partner (one sits out when the count is odd) and no pair repeats.
    ``max_rounds`` caps them (quick level: 3 partners each, enough to tell a slow node —
    slow with two partners — from a slow partner). Returns per round ``{node: partner}``."""
    ids: list[str | None] = sorted(nodes)
    if len(ids) % 2:
        ids.append(None)
    n, rounds = len(ids), []
    for _ in range(n - 1):
        pairs: dict[str, str] = {}
        for i in range(n // 2):
            a, b = ids[i], ids[n - 1 - i]
            if a is not None and b is not None:
                pairs[a], pairs[b] = b, a
        rounds.append(pairs)
        ids = [ids[0], ids[-1], *ids[1:-1]]
    return rounds[:max_rounds] if max_rounds is not None else rounds


def _gib(x: Any) -> str:
    return f"{x / (1 << 30):.2f} GiB" if isinstance(x, int) else str(x)


def _majority(values: dict[str, str]) -> str | None:
    """The value most nodes agree on, or None without a strict majority."""
    if not values:
        return None
    value, count = collections.Counter(values.values()).most_common(1)[0]
    return value if count * 2 > len(values) else None


def judge_host(h: dict[str, Any], cfg: CheckConfig, median_load: float) -> list[str]:
    """Problems of one node's host measurements (``host.measure``)."""
    if "error" in h:
        return [f"host check failed: {h['error']}"]
    out = []
    if h["memory_available"] < cfg.min_free_memory:
        out.append(f"memory: {_gib(h['memory_available'])} available < {_gib(cfg.min_free_memory)}")
    for what, key, floor in (
        ("disk", "disk_free", cfg.min_free_disk),
        ("shm", "shm_free", cfg.min_free_shm),
    ):
        free, path = h[key], h[key.replace("free", "path")]
        if isinstance(free, str):
            out.append(f"{what}: {path}: {free}")
        elif free < floor:
            out.append(f"{what}: {_gib(free)} free at {path} < {_gib(floor)}")
    if h["leftovers"]:
        first = h["leftovers"][0]
        out.append(
            f"leftover processes of an earlier job: {len(h['leftovers'])} "
            f"(pid {first['pid']}: {first['cmd'][:80]}); kill them or reboot the node"
        )
    load = float(h["load_per_core"])
    if load > cfg.max_load_per_core and load > 2 * median_load:
        out.append(
            f"cpu: load {load:.2f} per core > {cfg.max_load_per_core} (pool median {median_load:.2f})"
        )
    skew = h.get("clock_skew_s")
    if skew is not None and abs(skew) > cfg.max_clock_skew_s:
        out.append(f"clock: {skew:+.2f} s from the controller's (max {cfg.max_clock_skew_s} s)")
    for g in h.get("gpus", []):
        tag = f"gpu{g['index']}"
        if g["ecc_uncorrected"]:
            out.append(f"{tag}: {g['ecc_uncorrected']} uncorrected ECC errors")
        if g["temperature_c"] > cfg.gpu_max_temp_c:
            out.append(f"{tag}: {g['temperature_c']} °C > {cfg.gpu_max_temp_c} °C")
        if g["throttle"]:
            out.append(f"{tag}: throttled ({', '.join(g['throttle'])})")
        if g["memory_used"] > cfg.gpu_max_memory_used:
            out.append(f"{tag}: {_gib(g['memory_used'])} memory in use before the job")
    return out


def judge_node_stage(
    results: dict[str, dict[str, Any] | None],
    cfg: CheckConfig,
    reference: dict[str, Any],
) -> tuple[dict[str, list[str]], dict[str, Any]]:
    """Problems per node from the node stage (host, GEMM), and the pool's medians (what a
    later small run is compared with). A node without a result did not finish in time."""
    got = {n: r for n, r in results.items() if r is not None}
    loads = [
        r["host"]["load_per_core"] for r in got.values() if "load_per_core" in r.get("host", {})
    ]
    rates = {n: r["gemm"]["gflops"] for n, r in got.items() if "gflops" in r.get("gemm", {})}
    sums = {
        n: r["gemm_correctness"]["checksum"]
        for n, r in got.items()
        if "checksum" in r.get("gemm_correctness", {})
    }
    pool = {
        "gemm_gflops": statistics.median(rates.values()) if len(rates) >= 3 else None,
        "checksum": _majority(sums) if len(sums) >= 3 else None,
    }
    ref_rate = pool["gemm_gflops"] or reference.get("gemm_gflops")
    ref_sum = pool["checksum"] or reference.get("checksum")
    median_load = statistics.median(loads) if loads else 0.0
    problems: dict[str, list[str]] = {}
    for n, r in results.items():
        if r is None:
            problems[n] = [f"node checks did not finish within {cfg.node_stage_timeout_s:.0f} s"]
            continue
        if "error" in r:  # the check process died, timed out, or the node was lost
            problems[n] = [f"node checks failed: {r['error']}"]
            continue
        p = judge_host(r.get("host", {"error": "no result"}), cfg, median_load)
        k = r.get("gemm_correctness", {"error": "no result"})
        if "error" in k:
            p.append(f"GEMM known-answer check failed: {k['error']}")
        elif k["mismatches"]:
            p.append(
                f"GEMM wrong: {k['mismatches']} element(s) of C = A·B differ from the known "
                f"answer (first at {k['first_bad']}); silent data corruption"
            )
        elif ref_sum is not None and k["checksum"] != ref_sum:
            p.append(f"GEMM checksum {k['checksum']} differs from the pool's {ref_sum}")
        g = r.get("gemm", {"error": "no result"})
        if "error" in g:
            p.append(f"GEMM throughput check failed: {g['error']}")
        elif ref_rate and g["gflops"] < cfg.gemm_min_ratio * ref_rate:
            p.append(
                f"GEMM slow: {g['gflops']:.1f} GFLOP/s < {cfg.gemm_min_ratio} × pool median "
                f"{ref_rate:.1f}"
            )
        problems[n] = p
    return problems, pool


def _pairs(results: dict[str, dict[str, Any] | None]) -> dict[tuple[str, str], dict[str, Any]]:
    """Both ends' records of each pair merged: the slower end's numbers count (a collective
    is as fast as its slower participant); an error on either end is the pair's."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for n, r in results.items():
        for rec in (r or {}).get("pairs", []) if isinstance((r or {}).get("pairs"), list) else []:
            key = tuple(sorted((n, rec["partner"])))
            m = merged.setdefault(key, {})  # type: ignore[arg-type]
            if "error" in rec:
                m["error"] = rec["error"]
                continue
            for k in ("allreduce_busbw_gbps", "allgather_busbw_gbps"):
                m[k] = min(m.get(k, float("inf")), rec[k])
            m["latency_us"] = max(m.get("latency_us", 0.0), rec["latency_us"])
    return merged  # type: ignore[return-value]


def judge_net_stage(
    results: dict[str, dict[str, Any] | None],
    cfg: CheckConfig,
    reference: dict[str, Any],
) -> tuple[dict[str, list[str]], dict[str, Any], dict[str, dict[str, Any]]]:
    """Problems per node from the pair rounds and the simulated training; the pool's medians;
    and per node its median pair numbers (for the table).

    Pool value of a metric: the median over nodes of each node's median over its pairs, so
    that one bad node (slow in all its pairs) does not drag the reference down."""
    pairs = _pairs(results)
    per_node: dict[str, dict[str, list[float]]] = {}
    for (a, b), m in pairs.items():
        if "error" in m:
            continue
        for n in (a, b):
            d = per_node.setdefault(n, collections.defaultdict(list))
            for k in ("allreduce_busbw_gbps", "allgather_busbw_gbps", "latency_us"):
                d[k].append(m[k])
    node_med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in per_node.items()}
    pool: dict[str, Any] = {}
    for k in ("allreduce_busbw_gbps", "allgather_busbw_gbps", "latency_us"):
        vals = [d[k] for d in node_med.values() if k in d]
        pool[k] = statistics.median(vals) if len(vals) >= 3 else None
    ref = {k: pool[k] or reference.get(k) for k in pool}

    def slow(m: dict[str, Any]) -> str | None:
        if "error" in m:
            return f"failed ({m['error'][:120]})"
        for k, what in (
            ("allreduce_busbw_gbps", "all-reduce"),
            ("allgather_busbw_gbps", "all-gather"),
        ):
            if ref[k] and m[k] < cfg.bandwidth_min_ratio * ref[k]:
                return (
                    f"{what} busbw {m[k]:.3f} GB/s < {cfg.bandwidth_min_ratio} × pool {ref[k]:.3f}"
                )
        lat = ref["latency_us"]
        if lat and m["latency_us"] > max(cfg.latency_max_ratio * lat, lat + cfg.latency_slack_us):
            return f"latency {m['latency_us']:.0f} µs vs pool {lat:.0f} µs"
        return None

    bad: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for (a, b), m in pairs.items():
        why = slow(m)
        if why:
            bad[a][b] = bad[b][a] = why
    problems: dict[str, list[str]] = {n: [] for n in results}
    for n, partners in bad.items():
        if n in problems and len(partners) >= cfg.slow_partners:
            first = next(iter(partners.values()))
            problems[n].append(
                f"collectives slow with {len(partners)} partners ({', '.join(sorted(partners))}): "
                f"{first}"
            )
    lost = {n: r["error"] for n, r in results.items() if r is not None and "error" in r}
    lost.update({n: "did not finish in time" for n, r in results.items() if r is None})
    for n, why in lost.items():
        problems[n].append(f"collective and training checks failed: {why}")
    trains = {n: (r or {}).get("train") for n, r in results.items() if n not in lost}
    prints = {n: t["fingerprint"] for n, t in trains.items() if t and "fingerprint" in t}
    agreed = _majority(prints)
    for n, t in trains.items():
        if t is None:
            problems[n].append("simulated training did not finish in time")
        elif "error" in t and lost:
            continue  # a victim: the training lost a node that is already blamed
        elif "error" in t:
            problems[n].append(f"simulated training failed: {t['error'][:200]}")
        elif not t["finite"]:
            problems[n].append("simulated training: loss or parameters not finite")
        elif agreed is not None and t["fingerprint"] != agreed:
            problems[n].append(
                f"simulated training: parameters after {t['steps']} steps differ from the "
                f"other replicas ({t['fingerprint']} vs {agreed}); silent data corruption"
            )
    return problems, pool, node_med


# Errors of the check's own machinery (its rendezvous store, its deadlines, gloo's connection
# set-up) rather than measurements of the node: on a loaded machine these come from the load,
# not from the node (issue 12: 3 of 4 simulated nodes failed on store time-outs).
_MACHINERY = re.compile(
    r"DistStoreError|wait timeout|timed? ?out|timeout|connectFullMesh|Connection (reset|refused|"
    r"closed)|rendezvous|did not finish|no result within|Broken pipe|Socket Timeout",
    re.IGNORECASE,
)
# Measurements that stand on their own, whatever the rest of the pool shows.
_ABSOLUTE = re.compile(r"GEMM wrong|silent data corruption|free|not finite|°C|ECC|clock", re.I)


def inconclusive(problems: dict[str, list[str]]) -> dict[str, list[str]]:
    """The nodes of one run whose failure says more about the check than about the node, with
    their problems: every problem an error of the check's machinery (time-out, rendezvous,
    connection set-up); or, when the run failed most of its nodes (3 or more checked), every
    problem but the absolute measurements (a wrong GEMM answer, low free memory/disk, heat):
    a check that condemns most of the pool is more likely broken than the pool."""
    failed = {n: p for n, p in problems.items() if p}
    majority = len(problems) >= 3 and len(failed) > len(problems) / 2
    out = {}
    for n, p in failed.items():
        if all(_MACHINERY.search(x) for x in p) or (
            majority and not any(_ABSOLUTE.search(x) for x in p)
        ):
            out[n] = p
    return out
