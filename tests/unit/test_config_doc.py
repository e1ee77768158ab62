"""``docs/config.md`` is rendered from the config classes: the committed file is current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from trainguard.controller.config import SECTIONS, JobConfig
from trainguard.controller.config_doc import render_doc

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_rendered_from_the_config_classes() -> None:
    assert DOC.read_text() == render_doc(), (
        "docs/config.md differs from the config classes: run python tools/config_doc.py"
    )


def test_every_field_has_a_one_line_doc_in_the_file() -> None:
    text = DOC.read_text()
    for cls in (JobConfig, *SECTIONS.values()):
        for f in dataclasses.fields(cls):
            doc = f.metadata.get("doc", "")
            assert doc and "\n" not in doc, f"{cls.__name__}.{f.name} needs a one-line doc"
            if f.name not in SECTIONS:
                assert f"| `{f.name}`" in text


def test_the_example_file_in_the_doc_is_a_valid_config() -> None:
    import tomllib

    from trainguard.controller.config import COMMAND_LINE_FIELDS, group_fields

    example = DOC.read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    fields = group_fields(tomllib.loads(example), skip=COMMAND_LINE_FIELDS, check_types=True)
    cfg = JobConfig.from_fields(script="t.py", run_dir="/r", **fields)
    assert cfg.checkpoint.keep_checkpoints == 3 and cfg.preflight.checks == {"gemm_min_ratio": 0.5}
