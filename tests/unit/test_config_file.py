"""The ``--config`` TOML file: fields flat or in their sections, one-line errors that name the
key and the fix, and flags that beat the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.cli.main import _parser
from trainguard.cli.run import build_config
from trainguard.controller.config import JobConfig, TimeoutsConfig


def _build(tmp_path: Path, toml: str, *flags: str) -> JobConfig:
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    cfg = tmp_path / "job.toml"
    cfg.write_text(toml)
    argv = ["run", "--run-dir", str(tmp_path / "run"), "--config", str(cfg), *flags, str(script)]
    return build_config(_parser().parse_args(argv))


def test_a_sectioned_file(tmp_path: Path) -> None:
    job = _build(
        tmp_path,
        """
nodes = 2
[checkpoint]
keep_checkpoints = 3
memory_tier = false
[timeouts]
heartbeat_s = 0.2
node_timeout_s = 3.0
[preflight]
level = "off"
[preflight.checks]
gemm_min_ratio = 0.25
[straggler]
straggler_action = "replace"
""",
    )
    assert job.nodes == 2
    assert (job.checkpoint.keep_checkpoints, job.checkpoint.memory_tier) == (3, False)
    assert (job.timeouts.heartbeat_s, job.timeouts.node_timeout_s) == (0.2, 3.0)
    assert job.preflight.level == "off" and job.preflight.checks == {"gemm_min_ratio": 0.25}
    assert job.straggler.straggler_action == "replace"


def test_a_flat_file_as_before(tmp_path: Path) -> None:
    """The flat form every existing file uses: each key lands in its section, ``preflight``
    (a string) is the level, ``[checks]`` the pre-flight settings."""
    job = _build(
        tmp_path,
        'preflight = "off"\nmax_restarts = 10\nkeep_checkpoints = 4\nheartbeat_s = 0.2\n'
        'node_timeout_s = 3.0\nrecheck_s = 1.0\nprobe_every_s = 0\n[checks]\npair_timeout_s = 5.0\n',
    )  # fmt: skip
    assert job.preflight.level == "off" and job.restart.max_restarts == 10
    assert job.checkpoint.keep_checkpoints == 4 and job.pool.recheck_s == 1.0
    assert job.timeouts.heartbeat_s == 0.2 and job.sdc.probe_every_s == 0
    assert job.preflight.checks == {"pair_timeout_s": 5.0}
    assert job.to_flat()["preflight"] == "off" and job.to_flat()["max_restarts"] == 10


def test_flags_beat_the_file_and_timing_scales(tmp_path: Path) -> None:
    job = _build(
        tmp_path,
        '[restart]\nmax_restarts = 10\n[preflight]\nlevel = "full"\n',
        "--max-restarts", "2", "--preflight", "off", "--hang-timeout", "7",
    )  # fmt: skip
    assert job.restart.max_restarts == 2 and job.preflight.level == "off"
    assert job.timeouts.hang_timeout_s == 7.0
    assert (job.timeouts.heartbeat_s, job.timeouts.node_timeout_s) == (0.5, 10.0)


@pytest.mark.parametrize(
    ("toml", "needle"),
    [
        ("[checkpoint]\nkeep_checkpointz = 3\n",
         "unknown field(s) [checkpoint] keep_checkpointz (did you mean [checkpoint] "
         "keep_checkpoints?); known in [checkpoint]: memory_tier, "),
        ("keep_checkpointz = 3\n",
         "unknown field(s) keep_checkpointz (did you mean keep_checkpoints?); known: "),
        ("[timeout]\nheartbeat_s = 1.0\n",
         "unknown field(s) [timeout] (did you mean [timeouts]?); sections: [timeouts], "),
        ("x = = 1\n", "Invalid value (at line 1, column 5); give a readable TOML file"),
        ("max_restarts = true\n", "max_restarts = true is a boolean; max_restarts takes an integer"),
        ("[preflight.checks]\ngemm_min_ratoi = 0.5\n",
         "[preflight.checks] unknown field(s) gemm_min_ratoi (did you mean gemm_min_ratio?); "
         "known: gemm_min_ratio, "),
        ("[timeouts]\nheartbeat_s = \"fast\"\n",
         '[timeouts] heartbeat_s = "fast" is a string; heartbeat_s takes a number'),
        ('heartbeat_s = "fast"\n', 'heartbeat_s = "fast" is a string; heartbeat_s takes a number'),
        ("preflight = 3\n", "preflight = 3 is an integer; preflight takes one of 'off', 'quick', 'full'"),
        ('[preflight]\nlevel = "fast"\n', "preflight='fast': use quick, full or off"),
        ("timeouts = 3\n", "timeouts = 3 is an integer; timeouts takes a table ([timeouts]"),
        ("heartbeat_s = 0.2\n[timeouts]\nheartbeat_s = 0.3\n",
         "[timeouts] heartbeat_s is set twice (flat and in [timeouts]); keep one"),
        ('script = "other.py"\n', "unknown field(s) script"),
        ("[checks]\nno_such = 1\n", "[preflight.checks] unknown field(s) no_such; known: "),
        # Values no deadline, retention or timing can use (a node never lost, nothing kept).
        ("[timeouts]\nnode_timeout_s = inf\n",
         "node_timeout_s=inf: must be a finite number of seconds > 0"),
        ("heartbeat_s = nan\n", "heartbeat_s=nan: must be a finite number of seconds > 0"),
        ("stop_grace_s = -1.0\n", "stop_grace_s=-1.0: must be a finite number of seconds >= 0"),
        ("keep_checkpoints = 0\n", "keep_checkpoints=0: must be >= 1"),
        ("nodes = 99999999999999\n", "--nodes 99999999999999: at most 1,048,576 nodes"),
    ],
)  # fmt: skip
def test_bad_files_say_the_key_and_the_fix(tmp_path: Path, toml: str, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        _build(tmp_path, toml)
    msg = str(e.value)
    assert "\n" not in msg and needle in msg, msg
    # What the loader finds names the file; a section's own check names the value.
    assert msg.startswith(f"--config {tmp_path / 'job.toml'}: ") or msg.startswith(needle), msg


def test_a_missing_file_is_one_line_naming_it(tmp_path: Path) -> None:
    from trainguard.cli.run import load_job_fields

    with pytest.raises(ValueError) as e:
        load_job_fields(tmp_path / "nope.toml")
    assert str(e.value) == (
        f"--config {tmp_path / 'nope.toml'}: No such file or directory; give a readable TOML "
        "file of job config fields (docs/config.md)"
    )


def test_from_fields_flat_or_by_section() -> None:
    a = JobConfig.from_fields(script="t.py", run_dir="/r", heartbeat_s=0.2, node_timeout_s=3.0)
    b = JobConfig.from_fields(
        script="t.py", run_dir="/r", timeouts={"heartbeat_s": 0.2, "node_timeout_s": 3.0}
    )
    c = JobConfig(
        script="t.py", run_dir="/r", timeouts=TimeoutsConfig(heartbeat_s=0.2, node_timeout_s=3.0)
    )
    assert a == b == c
    with pytest.raises(ValueError, match="node_timeout_s must exceed 2 × heartbeat_s"):
        JobConfig.from_fields(script="t.py", run_dir="/r", heartbeat_s=5.0)
    with pytest.raises(ValueError, match="unknown field"):
        JobConfig.from_fields(script="t.py", run_dir="/r", hearbeat_s=5.0)
    with pytest.raises(ValueError, match=r"\[timeouts\] is given whole and by field"):
        JobConfig.from_fields(script="t.py", run_dir="/r", heartbeat_s=0.2, timeouts=c.timeouts)
