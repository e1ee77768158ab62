"""``torch.distributed.checkpoint`` through trainguard's tiers (``trainguard.dcp``).

A trainer written the torchtitan way (tests/helpers/userscripts/titan_shaped.py: FSDP2,
Statefuls, ``dcp.async_save`` on its own gloo group) runs under ``trainguard run``; rank 1 is
SIGKILLed mid-run; every rank restores the agreed step through ``trainguard.dcp.Reader``
from the memory tier, and the losses equal, step for step, those of a run with no fault. The
same script under plain torchrun resumes from the durable tier, which plain ``dcp.load``
reads as well. The save and load paths are exercised in one process too: a sync
``dcp.save``, an async one, a resharded load re-planned against the durable step, a corrupt
snapshot found while copying, and a missing step. In-process recovery (``trainguard.run``)
restores through the same reader."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from tests.conftest import FAST_CONFIG, ROOT, events, trainguard_cmd, wait_for, worker_pid
from trainguard.checkpoint.archive import Archive

SCRIPT = ROOT / "tests" / "helpers" / "userscripts" / "titan_shaped.py"
STEPS = 16


def _losses(text: str) -> dict[int, str]:
    """step → loss as printed (repr: bit for bit); a re-run step's last line counts."""
    return {int(s): x for s, x in re.findall(r"step (\d+) loss (\S+)", text)}


def _torchrun(cwd: Path, steps: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + [str(SCRIPT), str(steps), "2"],
        capture_output=True, text=True, timeout=240, cwd=cwd,
        env={**os.environ, "TRAINGUARD_SHM_DIR": str(cwd)},
    )  # fmt: skip


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[int, str]:
    d = tmp_path_factory.mktemp("titan_clean")
    out = _torchrun(d, STEPS)
    assert out.returncode == 0, out.stderr[-3000:]
    got = _losses(out.stdout)
    assert sorted(got) == list(range(1, STEPS + 1))
    return got


def _rank0_log(run: Path) -> str:
    return "".join(p.read_text() for p in sorted((run / "logs").glob("rank0.gen*.log")))


def test_kill_9_restores_through_dcp_from_memory_with_the_same_losses(
    tmp_path: Path, fault_free: dict[int, str]
) -> None:
    (tmp_path / "job.toml").write_text(FAST_CONFIG)
    run = tmp_path / "run"
    cmd = trainguard_cmd(
        "run", "--run-dir", run, "--config", tmp_path / "job.toml", "--nproc-per-node", "2",
        SCRIPT, str(STEPS), "2",
    )  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)  # fmt: skip
    try:
        pid = worker_pid(run, 1)
        wait_for(lambda: 7 in _losses(_rank0_log(run)), 120, "step 7")
        os.kill(pid, signal.SIGKILL)
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert _losses(_rank0_log(run)) == fault_free  # bit for bit, every step
    loads = [e for e in events(run) if e["kind"] == "ckpt_load_end"]
    assert {e["rank"] for e in loads} == {0, 1}, loads
    assert {e["tier"] for e in loads} == {"memory"}, loads  # ckptd kept the snapshots
    assert {e["step"] for e in loads} == {loads[0]["step"]} and loads[0]["step"] >= 6
    assert all(e.get("via") == "dcp" for e in loads)


@pytest.mark.slow  # two jobs (~1 min here)
def test_a_dcp_trainer_resumes_from_the_cold_tier_on_an_empty_disk_with_the_same_losses(
    tmp_path: Path, fault_free: dict[int, str]
) -> None:
    """The cold tier behind ``dcp.load``: the torchtitan-shaped trainer archives every durable
    step to a ``file://`` target while it trains 8 steps; its disk tier is then wiped (a new
    machine) and the job run again to 16 steps: the controller rebuilds the archived step 8 in
    the disk tier before the first generation, every rank reads it through
    ``trainguard.dcp.Reader``, and the losses equal the fault-free run's, bit for bit."""
    url = f"file://{tmp_path}/archive"
    (tmp_path / "job.toml").write_text(FAST_CONFIG + f'archive_url = "{url}"\narchive_every = 0\n')
    run = tmp_path / "run"

    def job(steps: int) -> str:
        """Rank 0's lines of this run (a re-run's generations follow the first run's)."""
        before = set((run / "logs").glob("rank0.gen*.log"))
        res = subprocess.run(
            trainguard_cmd("run", "--run-dir", run, "--config", tmp_path / "job.toml",
                           "--nproc-per-node", "2", SCRIPT, str(steps), "2"),
            capture_output=True, text=True, timeout=300, cwd=tmp_path,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        logs = sorted(set((run / "logs").glob("rank0.gen*.log")) - before)
        return "".join(p.read_text() for p in logs)

    first = _losses(job(8))
    assert Archive(url).list_steps()[-1] == 8
    shutil.rmtree(run / "checkpoints")
    second = _losses(job(16))
    assert {**first, **second} == fault_free and min(second) == 9, sorted(second)
    evs = events(run)
    assert [e["step"] for e in evs if e["kind"] == "archive_restored"] == [8]
    loads = [e for e in evs if e["kind"] == "ckpt_load_end"]
    assert {(e["rank"], e["step"], e["tier"], e.get("via")) for e in loads} == {
        (0, 8, "durable", "dcp"), (1, 8, "durable", "dcp"),
    }, loads  # fmt: skip


INPROCESS_DCP = ROOT / "tests" / "helpers" / "userscripts" / "inprocess_dcp.py"


@pytest.mark.slow  # two jobs, three recoveries (~60 s here)
def test_in_process_recoveries_restore_through_dcp_from_memory_with_the_same_losses(
    tmp_path: Path,
) -> None:
    """``trainguard.run`` with FSDP2 and ``dcp.async_save`` on a group of the script's own
    (inprocess_dcp.py): rank 1 is killed three times at a step's end, before its save, so
    that rank 0's upload of the step it has just staged waits on its dead peer (the abort
    breaks it); each time rank 0 keeps its process and
    both ranks restore the agreed step through ``trainguard.dcp.Reader`` from memory, and
    the losses equal a fault-free run's."""
    from tests.conftest import report

    cfg = tmp_path / "c.toml"
    cfg.write_text(FAST_CONFIG + "hang_timeout_min_s = 2.0\ninprocess_abort_s = 3.0\n")

    def job(run: Path, *inject: str) -> dict[int, float]:
        injects = [a for k in inject for a in ("--inject", k)]
        res = subprocess.run(
            trainguard_cmd("run", "--run-dir", run, "--config", cfg, "--nproc-per-node", "2",
                           *injects, INPROCESS_DCP, "--steps", "30"),
            capture_output=True, text=True, timeout=400,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr[-3000:]
        lines = (run / "metrics.jsonl").read_text().splitlines()
        return {int(d["step"]): d["loss"] for d in map(__import__("json").loads, lines)}

    reference = job(tmp_path / "ref")
    run = tmp_path / "run"
    got = job(run, "kill:rank=1:step=8", "kill:rank=1:step=17", "kill:rank=1:step=25")
    assert got == reference and sorted(got) == list(range(1, 31))
    recs = report(run)["recoveries"]
    pid0 = {e["pid"] for e in events(run) if e["kind"] == "worker_started" and e["rank"] == 0}
    assert len(recs) == 3 and all(r["mode"] == "inprocess" for r in recs), recs
    assert len(pid0) == 1 and all(r["kept"] == {"0": min(pid0)} for r in recs), recs
    loads = [e for e in events(run) if e["kind"] == "ckpt_load_end"]
    assert len(loads) == 6 and {e.get("tier") for e in loads} == {"memory"}, loads
    assert {e.get("via") for e in loads} == {"dcp"}


def test_plain_torchrun_resumes_from_the_durable_step_that_plain_dcp_reads(
    tmp_path: Path, fault_free: dict[int, str]
) -> None:
    first = _torchrun(tmp_path, 8)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _torchrun(tmp_path, STEPS)  # resumes from step 8, the newest verified
    assert second.returncode == 0, second.stderr[-3000:]
    assert "rank 1 restored step 8 from checkpoints (DCP)" in second.stderr
    assert {**_losses(first.stdout), **_losses(second.stdout)} == fault_free
    md = dcp.FileSystemReader(str(tmp_path / "checkpoints" / "step_16")).read_metadata()
    assert md.state_dict_metadata["model.tok_embeddings.weight"].size == torch.Size([64, 32])
    assert {"dataloader.dp_rank_0", "dataloader.dp_rank_1"} <= set(md.state_dict_metadata)


# ------------------------------------------------------------------ one process


def _one_process(tmp_path: Path, body: str) -> str:
    code = (
        "import os, warnings, torch, torch.distributed.checkpoint as dcp, trainguard.dcp as tgd\n"
        "warnings.filterwarnings('ignore')\n"
        "from trainguard.checkpoint.checkpointer import Checkpointer\n"
        f"ck = Checkpointer({str(tmp_path / 'ck')!r})\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Linear(16, 4))\n"
        "state = {'model': m.state_dict(), 'extra': {'epoch': 3, 'tag': 'x'}}\n"
        "def fresh():\n"
        "    return {'model': {k: torch.zeros_like(v) for k, v in m.state_dict().items()},\n"
        "            'extra': {'epoch': 0, 'tag': ''}}\n"
        "def same(a):\n"
        "    return all(torch.equal(a['model'][k], v) for k, v in m.state_dict().items()) \\\n"
        "        and a['extra'] == {'epoch': 3, 'tag': 'x'}\n" + body + "ck.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TRAINGUARD_SHM_DIR": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_sync_and_async_saves_restore_from_memory_and_durable(tmp_path: Path) -> None:
    out = _one_process(
        tmp_path,
        "dcp.save(state, storage_writer=tgd.Writer(checkpointer=ck), checkpoint_id='run/step-5')\n"
        "dcp.async_save(state, storage_writer=tgd.Writer(7, checkpointer=ck)).result()\n"
        "for step in (5, 7):\n"
        "    got = fresh(); r = tgd.Reader(step, checkpointer=ck)\n"
        "    dcp.load(got, storage_reader=r); print(step, r.tier, same(got))\n"
        "ck.wait()\n"
        "got = fresh(); dcp.load(got, checkpoint_id=str(ck.root / 'step_7'))\n"
        "print('plain', same(got))\n",
    )
    assert out.split("\n")[:3] == ["5 memory True", "7 memory True", "plain True"], out


RESHARD = """
import sys, warnings, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import trainguard.dcp as tgd
from trainguard.checkpoint.checkpointer import Checkpointer
warnings.filterwarnings("ignore")
dist.init_process_group("gloo")
rank = dist.get_rank()
ck = Checkpointer(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
dcp.save({"model": get_model_state_dict(model)}, storage_writer=tgd.Writer(1, checkpointer=ck))
ck.wait()
want = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
with torch.no_grad():
    for p in model.parameters():
        p.zero_()
r = tgd.Reader(1, checkpointer=ck)
dcp.load({"model": get_model_state_dict(model)}, storage_reader=r)  # the same shards
got = {k: v.full_tensor() for k, v in get_model_state_dict(model).items()}
print(f"rank {rank} same-shards {r.tier} {all(torch.equal(got[k], want[k]) for k in want)}")
plain = {k: torch.zeros_like(v) for k, v in want.items()}  # every rank wants all of it
r = tgd.Reader(1, checkpointer=ck)
dcp.load({"model": plain}, storage_reader=r)
print(f"rank {rank} whole {r.tier} {all(torch.equal(plain[k], want[k]) for k in want)}")
ck.close()
dist.destroy_process_group()
"""


def test_a_resharded_load_is_replanned_against_the_durable_step(tmp_path: Path) -> None:
    """Each rank's snapshot holds its FSDP shards (rows 0-1 or 2-3): the same shards come
    from memory; a live state that wants whole tensors reads from the durable step (the
    complement boxes of the snapshot's metadata send its reads there), never half of them."""
    script = tmp_path / "reshard.py"
    script.write_text(RESHARD)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script), str(tmp_path / "ck")],
        capture_output=True, text=True, timeout=180, cwd=tmp_path,
        env={**os.environ, "TRAINGUARD_SHM_DIR": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    for rank in (0, 1):
        assert f"rank {rank} same-shards memory True" in out.stdout, out.stdout
        assert f"rank {rank} whole durable True" in out.stdout, out.stdout
    assert "ckpt_memory_mismatch" not in out.stderr  # an event, not a warning on stderr


def test_a_corrupt_snapshot_is_read_from_the_durable_tier(tmp_path: Path) -> None:
    out = _one_process(
        tmp_path,
        "dcp.save(state, storage_writer=tgd.Writer(3, checkpointer=ck))\n"
        "ck.wait(); ck.wait_persisted()\n"
        "from trainguard.checkpoint import snapshot\n"
        "for s in ck._pool.slots:\n"
        "    h = snapshot.peek_header(s.path)\n"
        "    if h and h['step'] == 3:\n"
        "        e = h['layout']['tensors'][0]\n"
        "        with open(s.path, 'r+b') as f:\n"
        "            f.seek(e['offset']); b = f.read(1); f.seek(e['offset'])\n"
        "            f.write(bytes([b[0] ^ 0x10]))\n"
        "got = fresh(); r = tgd.Reader(3, checkpointer=ck); dcp.load(got, storage_reader=r)\n"
        "print(r.tier, same(got))\n",
    )
    assert out.startswith("durable True"), out


def test_a_standbys_prefetched_copy_serves_and_a_corrupt_one_falls_to_the_durable_root(
    tmp_path: Path,
) -> None:
    """With no memory snapshot to use (``TRAINGUARD_RESTORE_MEMORY=0``, as after a world
    change) and this node's prefetched copy of the step (``TRAINGUARD_PREFETCH_DIR``, a
    standby's), the reader serves from it; a byte flipped in its largest data file is found
    while read, and the same load finishes from the durable root, exact."""
    out = _one_process(
        tmp_path,
        "dcp.save(state, storage_writer=tgd.Writer(3, checkpointer=ck)); ck.wait()\n"
        "from pathlib import Path\n"
        "from trainguard.checkpoint import prefetch\n"
        "pre = Path('prefetched'); pre.mkdir(); prefetch.copy_step(ck.root, pre, 3)\n"
        "os.environ.update(TRAINGUARD_PREFETCH_DIR=str(pre), TRAINGUARD_RESTORE_MEMORY='0')\n"
        "got = fresh(); r = tgd.Reader(3, checkpointer=ck); dcp.load(got, storage_reader=r)\n"
        "print(r.tier, same(got))\n"
        "f = max((x for x in (pre / 'step_3').rglob('*') if x.is_file()),\n"
        "        key=lambda x: x.stat().st_size)\n"
        "b = bytearray(f.read_bytes()); b[len(b) // 2] ^= 1; f.write_bytes(bytes(b))\n"
        "got = fresh(); r = tgd.Reader(3, checkpointer=ck); dcp.load(got, storage_reader=r)\n"
        "print(r.tier, same(got))\n",
    )
    assert out.split("\n")[:2] == ["prefetched True", "durable True"], out


def test_no_step_to_restore_says_what_to_do(tmp_path: Path) -> None:
    out = _one_process(
        tmp_path,
        "print(tgd.resume_step())\n"
        "try:\n"
        "    dcp.load(fresh(), storage_reader=tgd.Reader(checkpointer=ck))\n"
        "except BaseException as e:\n"
        "    print('raised', 'resume_step()' in str(e))\n"
        "try:\n"
        "    dcp.save(state, storage_writer=tgd.Writer(checkpointer=ck))\n"
        "except BaseException as e:\n"
        "    print('raised', 'Writer(step=N)' in str(e))\n",
    )
    assert out.split("\n")[:3] == ["None", "raised True", "raised True"], out


def test_a_reused_writer_a_resaved_step_and_a_cast_on_load(tmp_path: Path) -> None:
    """Found by trying to break it: a writer reused across saves takes each save's step from
    its checkpoint_id; a step saved twice is refused (its first save stands in every tier);
    a live tensor of another dtype is read from the durable step, cast as DCP casts."""
    out = _one_process(
        tmp_path,
        "w = tgd.Writer(checkpointer=ck)\n"
        "for s in (1, 2, 3):\n"
        "    dcp.save({'w': torch.full((4,), float(s))}, storage_writer=w,\n"
        "             checkpoint_id=f'x/step_{s}')\n"
        "try:\n"
        "    dcp.save({'w': torch.full((4,), 9.0)}, storage_writer=tgd.Writer(3, checkpointer=ck))\n"
        "except BaseException as e:\n"
        "    print('resave refused', 'saved already' in str(e))\n"
        "ck.wait()\n"
        "print(sorted(p.name for p in ck.root.iterdir() if p.name.startswith('step_')))\n"
        "for s in (3,):\n"
        "    t = {'w': torch.zeros(4)}; r = tgd.Reader(s, checkpointer=ck)\n"
        "    dcp.load(t, storage_reader=r); print(r.tier, t['w'].tolist())\n"
        "    t = {'w': torch.zeros(4)}; dcp.load(t, checkpoint_id=str(ck.root / f'step_{s}'))\n"
        "    print('durable', t['w'].tolist())\n"
        "t = {'w': torch.zeros(4, dtype=torch.bfloat16)}; r = tgd.Reader(2, checkpointer=ck)\n"
        "dcp.load(t, storage_reader=r); print(r.tier, t['w'].dtype, t['w'].tolist())\n",
    )
    assert out.split("\n")[:5] == [
        "resave refused True",
        "['step_2', 'step_3']",  # keep=2
        "memory [3.0, 3.0, 3.0, 3.0]",
        "durable [3.0, 3.0, 3.0, 3.0]",
        "durable torch.bfloat16 [2.0, 2.0, 2.0, 2.0]",
    ], out


def test_the_docs_snippet_without_close_commits_every_durable_step_at_exit(
    tmp_path: Path,
) -> None:
    """The process's checkpointer is closed at exit: a script that never calls close() still
    ends with every step durable (its persister's threads would otherwise die mid-write)."""
    code = (
        "import os, torch, torch.distributed.checkpoint as dcp, trainguard.dcp\n"
        "for step in range(1, 4):\n"
        "    dcp.save({'w': torch.full((2_000_000,), float(step))},\n"
        "             storage_writer=trainguard.dcp.Writer(step))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
        env={**os.environ, "TRAINGUARD_SHM_DIR": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    steps = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert steps == ["step_2", "step_3"], steps  # keep=2: the newest two, committed
    assert not list(tmp_path.glob("trainguard-*"))  # its slots released
    t = {"w": torch.zeros(2_000_000)}
    dcp.load(t, checkpoint_id=str(tmp_path / "checkpoints" / "step_3"))
    assert torch.equal(t["w"], torch.full((2_000_000,), 3.0))


def test_wrong_argument_types_are_refused_naming_the_argument() -> None:
    import trainguard.dcp as tgd

    for bad in ("8", 9.5, True):
        with pytest.raises(TypeError, match=r"Writer\(step=.*a step is an int"):
            tgd.Writer(bad)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match=r"Reader\(step=.*a step is an int"):
            tgd.Reader(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="give a trainguard Checkpointer"):
        tgd.Writer(1, checkpointer="dir")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps are >= 0"):
        tgd.Writer(-1)
