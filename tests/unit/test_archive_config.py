"""The cold tier's and the metrics address's settings are refused before a job starts when
they cannot work, each in one line that names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.controller.config import JobConfig


def _cfg(tmp_path: Path, **kw: object) -> JobConfig:
    return JobConfig.from_fields(script="train.py", run_dir=str(tmp_path / "run"), **kw)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"archive_url": "s3://"}, "give a bucket"),
        ({"archive_url": "file://"}, "give a path"),
        ({"archive_url": "zip://x"}, "cannot hold an archive"),
        ({"archive_url": "nosuch://b/x"}, "unknown storage scheme"),
        ({"archive_url": ["s3://b/x", "s3://b/x/"]}, "twice"),
        ({"archive_url": "s3://b/x", "archive_copies": 2}, "archive_copies"),
        ({"archive_copies": 2}, "archive_url is not"),
        ({"archive_compress": "bogus"}, "archive_compress"),
        ({"metrics_bind": "9400"}, "HOST:PORT"),
        ({"metrics_open": True}, "needs metrics_bind"),
    ],
)
def test_settings_that_cannot_work_are_refused(
    tmp_path: Path, fields: dict[str, object], says: str
) -> None:
    with pytest.raises(ValueError, match=says) as e:
        _cfg(tmp_path, **fields)
    assert "\n" not in str(e.value)


def test_an_archive_inside_the_durable_tier_is_refused(tmp_path: Path) -> None:
    hot = tmp_path / "run" / "checkpoints"
    with pytest.raises(ValueError, match="overlaps the durable tier"):
        _cfg(tmp_path, archive_url=f"file://{hot}/cold")
    with pytest.raises(ValueError, match="overlaps the durable tier"):
        _cfg(tmp_path, archive_url=str(tmp_path))  # the durable tier inside the archive
    assert _cfg(tmp_path, archive_url=f"file://{tmp_path}/cold").archive.archive_urls
    assert _cfg(tmp_path, metrics_bind="[::1]:9400").metrics.metrics_bind == "[::1]:9400"
