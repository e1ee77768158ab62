"""Straggler and anomaly detection on the per-step records the ranks report (pure logic:
records in, events out; the controller's executor feeds it and records the events).

Straggler (seed, section 六: one slow GPU drags the whole job). In a synchronous job every
rank's step takes as long as the slowest one's, so step times cannot name the culprit. What
differs is each rank's *own work*: the time from the end of its previous collective to the
start of its next one (``gap``, sent by the runtime; the waiting is inside the collectives,
so it is excluded). The culprit's own work is longer; its victims' is not, and they wait
instead. Per step, a rank's score is its gap minus the median gap over the ranks; per window
of ``window_steps`` (20) steps, the median of that. (Fallbacks, for scripts that time fewer
collectives: arrival time at the step's first collective against the median rank, then
step time minus time in collectives.) A window flags a rank when both

- the seed's rule holds: its score exceeds the mean by ``sigma`` (2) standard deviations,
  mean and deviation taken over the *other* ranks (with the suspect included, one outlier
  among n ranks can never exceed (n−1)/√n deviations — 2.47 for 8 — so the plain rule
  masks the very straggler it looks for), and
- it is at least ``min_late`` (15%) of the median step time above the median rank: a robust,
  scale-free floor that keeps the rule quiet when all ranks are equally fast,

and an alert needs ``persist_windows`` (3) flagged windows in a row (persistence, so a
one-off hiccup — a GC pause, a checkpoint flush — is not a straggler). The alert clears
after as many clean windows in a row; only then can the rank alert again. Chosen on runs
here (8 ranks sharing 2 cores, steps of 40–150 ms): rank 0 works a little longer than the
others in this example (0 to +0.2 of a step per window). With 10-step windows it crossed a
5% floor three times in 600 clean steps; with 20-step windows, three times in 1000 steps,
and an 8% floor once when other work loaded the machine. A 10% floor was quiet in three
clean runs (2600 steps) but not in a fourth (rank 0 at +0.13 of a 40 ms step, three
windows in a row, in 1000 steps), so the floor is 15%: ranks slowed to 1.25× or more
(excess ≥ 0.18 of a step) or CPU-throttled are still named, three to four windows after
their slowdown began. For scale: Megatron Bridge's NVIDIA-resiliency straggler config
flags a rank whose performance relative to the fastest rank falls below
``gpu_relative_perf_threshold = 0.7`` (its default), i.e. about 43% slower.

Anomalies on rank 0's series (the example reports the mean loss over ranks):

- non-finite loss (NaN/Inf): at once;
- loss spike: modified z-score M = 0.6745 (x − median) / MAD over the previous
  ``loss_window`` finite losses (Iglewicz & Hoaglin, "How to Detect and Handle Outliers",
  1993), alert when M > ``loss_z``. Their 3.5 is for roughly normal data; small-batch
  training losses are heavy-tailed, so the default is 8;
- gradient-norm spike (silent data corruption before the all-reduce: a corrupt local
  gradient is averaged into every replica alike, so their fingerprints agree): the step's
  total gradient norm (``grad_norm`` of ``step_end``) is non-finite while its loss is finite,
  or above ``grad_ratio`` (1000) times the median of the previous ``loss_window`` norms. A
  flip in a float32 exponent's top bits scales an element by 2**16 and more; real training
  moves the norm by factors of a few between steps (a loss spike from garbage data here:
  under 10×), so 1000× is three orders of magnitude away from both. Flips of the low exponent
  or mantissa bits of one element change the norm less than training does: no signal sees
  them (they are also the least harmful). Needs 5 norms before it judges;
- throughput drop: tokens/s, median of the last ``tp_recent`` steps against the median of
  the ``tp_baseline`` steps before them (a two-window test for a shift in the median, the
  robust form of the change detectors in Basseville & Nikiforov, "Detection of Abrupt
  Changes", 1993); alert when it fell by more than ``tp_drop`` (40%: with 8 ranks sharing
  2 cores here, clean runs swing by up to 35% between 10-step windows), re-armed when back
  within half that.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
import statistics
from typing import Any

from trainguard.protocol import StepRecord

Event = tuple[str, dict[str, Any]]
WAITING_SHOWN = 16  # ranks a straggler event lists as waiting for it, longest first


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class DetectConfig:
    window_steps: int = 20
    persist_windows: int = 3
    sigma: float = 2.0
    min_late: float = 0.15
    loss_window: int = 50
    loss_z: float = 8.0
    grad_ratio: float = 1000.0  # 0: no gradient-norm check
    tp_recent: int = 20
    tp_baseline: int = 100
    tp_drop: float = 0.4


class StragglerDetector:
    """Windows of per-rank lateness for one generation at a time."""

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.generation = -1
        self.world = 0
        self._first: dict[int, int] = {}  # rank → its first step in this generation (skipped)
        self._newest: dict[int, int] = {}  # rank → newest step reported
        # step → rank → (own work or arrival time or None, duration, communication, which)
        self._steps: dict[int, dict[int, tuple[float | None, float, float, str]]] = {}
        self._next_window: int | None = None
        self.streak: dict[int, int] = collections.defaultdict(int)
        self.clean: dict[int, int] = collections.defaultdict(int)  # clean windows in a row
        self.alerted: set[int] = set()
        self.scores: dict[int, float] = {}  # rank → excess own work / step time, newest window
        self.windows = 0  # windows judged: ``scores`` changed when this grew
        # Ranks whose newest step is below the next window's last (all seen: the window is
        # complete). Kept as ranks report, so a report costs O(its items), not O(world).
        self._behind = 0

    def add(self, generation: int, world: int, rank: int, items: list[StepRecord]) -> list[Event]:
        """Take one rank's step records; returns the events of every window now complete."""
        if generation != self.generation:
            if generation < self.generation:
                return []
            self.__init__(self.cfg)  # type: ignore[misc]
            self.generation = generation
        self.world = world
        w = self.cfg.window_steps
        for it in items:
            step = it.step
            first = self._first.setdefault(rank, step)
            old = self._newest.get(rank)
            self._newest[rank] = max(old if old is not None else step, step)
            if self._next_window is not None:
                hi = (self._next_window + 1) * w
                if old is not None and old < hi <= step:
                    self._behind -= 1
            if step == first:
                continue  # includes process start and restore
            comm = it.sections.get("communication", 0.0)
            own = it.gap if it.gap is not None else it.t_coll
            kind = "gap" if it.gap is not None else "tc"
            row = self._steps.setdefault(step, {})
            row[rank] = (float(own) if own is not None else None, it.duration_s, comm, kind)
        return self._evaluate()

    def _evaluate(self) -> list[Event]:
        out: list[Event] = []
        w = self.cfg.window_steps
        if len(self._newest) < self.world or self.world < 3:
            return out  # mean + 2σ of the others needs at least 3 ranks
        if self._next_window is None:
            self._next_window = max(self._first.values()) // w + 1
            self._count_behind()
        while True:
            k = self._next_window
            lo, hi = k * w + 1, (k + 1) * w
            if self._behind > 0:
                return out
            late: dict[int, list[float]] = collections.defaultdict(list)
            comm: dict[int, list[float]] = collections.defaultdict(list)
            durs: list[float] = []
            for step in range(lo, hi + 1):
                row = self._steps.pop(step, {})
                if len(row) < 3:
                    continue
                kinds = {k for v, _, _, k in row.values() if v is not None}
                if len(kinds) == 1 and all(v is not None for v, _, _, _ in row.values()):
                    vals = {r: float(v) for r, (v, _, _, _) in row.items()}  # type: ignore[arg-type]
                else:  # no collective timing: compute = step minus time in collectives
                    vals = {r: max(0.0, d - c) for r, (_, d, c, _) in row.items()}
                mid = statistics.median(vals.values())
                for r, v in vals.items():
                    late[r].append(v - mid)
                    comm[r].append(row[r][2])
                durs += [d for _, d, _, _ in row.values()]
            for old in [s for s in self._steps if s < lo]:
                del self._steps[old]
            if late and durs:
                out += self._judge(
                    {r: statistics.median(v) for r, v in late.items()},
                    {r: statistics.median(v) for r, v in comm.items()},
                    statistics.median(durs),
                    lo,
                    hi,
                )
            self._next_window = k + 1
            self._count_behind()

    def _count_behind(self) -> None:
        """Ranks short of the next window's last step (once a window: O(world))."""
        assert self._next_window is not None
        hi = (self._next_window + 1) * self.cfg.window_steps
        self._behind = sum(1 for s in self._newest.values() if s < hi)

    def _judge(
        self, late: dict[int, float], comm: dict[int, float], step_s: float, lo: int, hi: int
    ) -> list[Event]:
        if len(late) < 3 or step_s <= 0:
            return []
        out: list[Event] = []
        self.windows += 1
        for r, x, mean, sd in _leave_one_out(late):
            z = (x - mean) / sd if sd > 0 else (math.inf if x > mean else 0.0)
            frac = x / step_s
            self.scores[r] = round(frac, 3)
            if frac >= self.cfg.min_late and z > self.cfg.sigma:
                self.streak[r] += 1
                self.clean[r] = 0
            else:
                self.streak[r] = 0
                self.clean[r] += 1
                if self.clean[r] >= self.cfg.persist_windows:
                    self.alerted.discard(r)
            if self.streak[r] >= self.cfg.persist_windows and r not in self.alerted:
                self.alerted.add(r)
                # the ranks that waited longest for it (the top WAITING_SHOWN: an event, not
                # a table of the world)
                waiting = heapq.nlargest(WAITING_SHOWN, (q for q in comm if q != r),
                                         key=comm.__getitem__)  # fmt: skip
                out.append(
                    (
                        "straggler",
                        {
                            "generation": self.generation,
                            "rank": r,
                            "score": round(frac, 3),
                            "late_s": round(x, 5),
                            "step_s": round(step_s, 5),
                            "z": round(z, 2) if math.isfinite(z) else None,
                            "windows": self.streak[r],
                            "steps": [lo - (self.streak[r] - 1) * self.cfg.window_steps, hi],
                            "waiting_s": {q: round(comm[q], 5) for q in waiting},
                            "own_wait_s": round(comm.get(r, 0.0), 5),
                        },
                    )
                )
        return out


def _leave_one_out(values: dict[int, float]) -> list[tuple[int, float, float, float]]:
    """(key, value, mean, population standard deviation of the *other* values) for each entry
    of ``values`` (at least 2), in O(n): from the sums of the values and of their squares,
    shifted by the overall mean first (so the squares do not cancel). A deviation under 1 ns
    (the values are seconds) is taken as 0: rounding, not spread."""
    n = len(values)
    mu = math.fsum(values.values()) / n
    s1 = math.fsum(v - mu for v in values.values())
    s2 = math.fsum((v - mu) ** 2 for v in values.values())
    out = []
    for r, x in values.items():
        y = x - mu
        m = (s1 - y) / (n - 1)
        var = (s2 - y * y) / (n - 1) - m * m
        out.append((r, x, mu + m, math.sqrt(var) if var > 1e-18 else 0.0))
    return out


class AnomalyDetector:
    """Loss spikes, non-finite losses and throughput drops on one rank's series."""

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.losses: collections.deque[float] = collections.deque(maxlen=cfg.loss_window)
        self.norms: collections.deque[float] = collections.deque(maxlen=cfg.loss_window)
        self.tps: collections.deque[float] = collections.deque(
            maxlen=cfg.tp_recent + cfg.tp_baseline
        )
        self.dropped = False
        self.generation = -1

    def add(self, generation: int, items: list[StepRecord]) -> list[Event]:
        out: list[Event] = []
        if generation != self.generation:
            self.generation = generation
            self.tps.clear()  # a restart's first steps are slower: a new baseline
            first = True
        else:
            first = False
        for it in items:
            step, loss = it.step, it.loss
            if loss is not None and not math.isfinite(float(loss)):
                out.append(
                    ("loss_nonfinite", {"generation": generation, "step": step, "loss": str(loss)})
                )
            elif loss is not None:
                out += self._spike(generation, step, float(loss))
                if it.grad_norm is not None:
                    out += self._grad(generation, step, float(it.grad_norm))
            if not first and it.tokens and it.duration_s > 0:
                self.tps.append(float(it.tokens) / it.duration_s)
                out += self._throughput(generation, step)
            first = False
        return out

    def _spike(self, generation: int, step: int, loss: float) -> list[Event]:
        hist = self.losses
        if len(hist) >= 20:
            med = statistics.median(hist)
            mad = statistics.median(abs(x - med) for x in hist)
            m = 0.6745 * (loss - med) / mad if mad > 0 else 0.0
            if m > self.cfg.loss_z:
                return [("loss_spike", {"generation": generation, "step": step, "loss": round(loss, 5),
                                        "median": round(med, 5), "mad": round(mad, 5), "z": round(m, 1)})]  # fmt: skip
        hist.append(loss)
        return []

    def _grad(self, generation: int, step: int, norm: float) -> list[Event]:
        hist, ratio = self.norms, self.cfg.grad_ratio
        if ratio <= 0:
            return []
        if math.isfinite(norm) and len(hist) < 5:
            hist.append(norm)
            return []
        med = statistics.median(hist) if hist else 0.0
        if not math.isfinite(norm) or (med > 0 and norm > ratio * med):
            return [("grad_norm_spike", {"generation": generation, "step": step,
                                         "grad_norm": norm if math.isfinite(norm) else str(norm),
                                         "median": med, "ratio": round(norm / med, 1) if med > 0 and math.isfinite(norm) else None})]  # fmt: skip
        hist.append(norm)
        return []

    def _throughput(self, generation: int, step: int) -> list[Event]:
        c = self.cfg
        if len(self.tps) < c.tp_recent + c.tp_baseline // 2:
            return []
        series = list(self.tps)
        recent = statistics.median(series[-c.tp_recent :])
        base = statistics.median(series[: -c.tp_recent])
        if not self.dropped and recent < (1 - c.tp_drop) * base:
            self.dropped = True
            return [("throughput_drop", {"generation": generation, "step": step,
                                         "tokens_per_s": round(recent, 1), "baseline": round(base, 1),
                                         "drop": round(1 - recent / base, 3)})]  # fmt: skip
        if self.dropped and recent >= (1 - c.tp_drop / 2) * base:
            self.dropped = False
        return []


def localize_hang(
    workers: list[tuple[str, Any]], stale_s: float
) -> tuple[str, Any, str, dict[int, int]]:
    """Which rank holds a hung job: ``workers`` are (node, WorkerObs) of the generation.

    0. A rank whose process is stopped (``proc_state`` "stopped": SIGSTOP, a debugger).
    1. A rank whose heartbeat stopped (``heartbeat_age_s`` > ``stale_s``): its process froze.
    2. Collective sequence numbers (``coll`` = [issued, done], from the runtime): the ranks
       that issued collective #k and wait for it are victims; a rank that has not issued #k
       (issued < k) holds them. If all issued the same count, a rank that is not waiting
       (done == issued) while others are.
    3. Else the rank furthest behind in steps.

    Returns (node, worker, how, waiting) with ``waiting`` = rank → the collective number
    it waits in, for every rank with an outstanding collective. A rank that exited is never
    the culprit (its heartbeat stopped because it finished or failed, which is seen on its own).
    """
    workers = [(n, w) for n, w in workers if getattr(w, "state", "running") == "running"] or workers
    waiting = {
        w.rank: int(w.coll[0]) for _, w in workers if w.coll is not None and w.coll[0] > w.coll[1]
    }
    frozen = [(n, w) for n, w in workers if getattr(w, "proc_state", None) == "stopped"]
    if frozen:
        n, w = min(frozen, key=lambda nw: nw[1].rank)
        return n, w, "is a stopped process (SIGSTOP or a debugger)", waiting
    stale = [(n, w) for n, w in workers if (w.heartbeat_age_s or 0) > stale_s]
    if stale:
        n, w = min(stale, key=lambda nw: nw[1].rank)
        return n, w, "its heartbeat stopped", waiting
    counted = [(n, w) for n, w in workers if w.coll is not None]
    if counted and waiting:
        top = max(int(w.coll[0]) for _, w in counted)
        behind = [(n, w) for n, w in counted if int(w.coll[0]) < top]
        idle = [(n, w) for n, w in counted if w.rank not in waiting]
        pick = behind or idle
        if pick:
            n, w = min(pick, key=lambda nw: (int(nw[1].coll[0]), nw[1].rank))
            how = (
                f"did not issue collective #{top} that ranks {sorted(waiting)} wait in"
                if behind
                else f"is not in the collective ranks {sorted(waiting)} wait in"
            )
            return n, w, how, waiting
    n, w = min(
        workers,
        key=lambda nw: (
            nw[1].step if nw[1].step is not None else -1,
            -(nw[1].progress_age_s or 0),
        ),
    )
    if all(x.step is None for _, x in workers):  # no runtime: CPU time is all that was seen
        return n, w, "used no CPU (the script reports no steps)", waiting
    return n, w, "furthest behind", waiting
