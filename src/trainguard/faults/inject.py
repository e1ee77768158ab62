"""Fault-injection specs: ``--inject KIND:key=value:...``.

Kinds (each fires once per job, not again after the restart it causes):

- ``kill:rank=R:step=S``      SIGKILL the worker of rank R at the end of step S
- ``kill:rank=R:after=T``     SIGKILL it T seconds after its worker started (the agent does
                              it: works for any script, also one that never reports steps)
- ``exit:rank=R:step=S:code=C`` the worker exits with status C at the end of step S
- ``hang:rank=R:step=S``      rank R stops making progress at step S; its process and
                              its heartbeat thread stay alive
- ``hang:rank=R:after=T``     the agent SIGSTOPs rank R's process group T seconds after start
                              (a frozen process, for any script)
- ``node-down:node=N:step=S`` SIGKILL node N's agent and all its workers (power loss)
                              when that node's first rank ends step S (or ``after=T``
                              seconds after that node's workers started)
- ``slow:rank=R:factor=F[:step=S]`` rank R's steps take F times as long (sleep injection),
                              from step S on (default: from its process's second step)
- ``hang-collective:rank=R:step=S`` rank R stops inside its first collective of step S,
                              before issuing it; the other ranks wait in that collective
- ``loss-spike:step=S``       every rank trains step S on random tokens (the script applies
                              it: ``Runtime.drill``); the loss jumps
- ``nan:step=S``              step S's loss is NaN on every rank (the script skips that update)
- ``gemm-wrong:node=N[:step=S]`` node N computes wrong matrix products (one element of each
                              off by a part in 2**10, persistently: a defective unit). Without
                              step: from the start, so its pre-flight GEMM check fails. With
                              step=S: it passes the pre-flight and goes wrong once its ranks
                              reach step S, in its workers' GEMMs (scripts under
                              ``trainguard.init``) and in its in-job known-answer probes
- ``sdc:rank=R:step=S[:target=T][:bit=B]`` silent data corruption in training: rank R flips
                              bit B (default 22, the float32 mantissa's top bit) of element 0
                              of a real tensor (``trainguard.checkpoint.sdc_drill``);
                              nothing crashes.
                              target=param (default) or optimizer: a replicated parameter or
                              optimizer-state tensor, in the live state, at its first
                              checkpoint save at or after step S; target=grad: a parameter's
                              gradient in step S's backward, before the all-reduce (every
                              replica then applies the same corrupt average)
"""

from __future__ import annotations

import json
from typing import Any

from trainguard.protocol.inject import SDC_DEFAULT_BIT, SDC_TARGETS, InjectSpec

__all__ = ["SDC_DEFAULT_BIT", "SDC_TARGETS", "InjectSpec", "dumps", "loads", "parse_inject"]

_REQUIRED: dict[str, tuple[str, ...]] = {  # kind → its required keys
    "kill": ("rank", "step"),
    "exit": ("rank", "step", "code"),
    "hang": ("rank", "step"),
    "node-down": ("node", "step"),
    "slow": ("rank", "factor"),
    "gemm-wrong": ("node",),
    "hang-collective": ("rank", "step"),
    "loss-spike": ("step",),
    "nan": ("step",),
    "sdc": ("rank", "step"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "slow": ("step",),
    "sdc": ("bit", "target"),
    "gemm-wrong": ("step",),
}
KINDS = tuple(_REQUIRED)  # every drill --inject takes (docs/drills.md)
# Kinds the agent can fire by time, from outside the process: ``after=T`` replaces ``step=S``.
TIMED = ("kill", "hang", "node-down")
_EXAMPLE = "kill:rank=1:step=20"


def parse_inject(text: str, index: int) -> InjectSpec:
    """Parse one ``--inject`` value. Raises ValueError with the expected form on bad input."""
    kind, *parts = text.strip().split(":")
    if kind not in _REQUIRED:
        raise ValueError(
            f"--inject {text!r}: unknown kind {kind!r}; use one of {', '.join(_REQUIRED)} "
            f"(e.g. {_EXAMPLE})"
        )
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, value = part.partition("=")
        if not sep or not value:
            raise ValueError(f"--inject {text!r}: {part!r} is not key=value (e.g. {_EXAMPLE})")
        fields[key] = value
    required = _REQUIRED[kind]
    if "after" in fields:
        if kind not in TIMED:
            raise ValueError(
                f"--inject {text!r}: after=SECONDS works for {', '.join(TIMED)} only (the "
                f"agent fires those from outside the process); {kind} needs step=S and a "
                f"script that reports steps (trainguard.init / Runtime.step_end)"
            )
        if "step" in fields:
            raise ValueError(f"--inject {text!r}: give step=S or after=SECONDS, not both")
        required = tuple(k if k != "step" else "after" for k in required)
    missing = [k for k in required if k not in fields]
    extra = [k for k in fields if k not in required + _OPTIONAL.get(kind, ())]
    if missing or extra:
        want = ":".join(f"{k}=…" for k in _REQUIRED[kind])
        alt = " (or after=SECONDS for step)" if kind in TIMED else ""
        raise ValueError(f"--inject {text!r}: {kind} takes {kind}:{want}{alt}")
    target = fields.pop("target", "param")
    if target not in SDC_TARGETS:
        raise ValueError(f"--inject {text!r}: target must be one of {', '.join(SDC_TARGETS)}")
    try:
        kw: dict[str, Any] = {
            k: (float(v) if k in ("factor", "after") else int(v)) for k, v in fields.items()
        }
    except ValueError:
        raise ValueError(f"--inject {text!r}: values must be numbers (e.g. {_EXAMPLE})") from None
    for key in ("rank", "node", "step"):
        if key in kw and kw[key] < 0:
            raise ValueError(f"--inject {text!r}: {key} must be >= 0")
    if "after" in kw and not (kw["after"] >= 0 and kw["after"] < float("inf")):
        raise ValueError(f"--inject {text!r}: after must be a number of seconds >= 0")
    if kind == "sdc" and not 0 <= kw.get("bit", SDC_DEFAULT_BIT) < 64:
        raise ValueError(f"--inject {text!r}: bit must be 0..63 (within one element)")
    if kind == "slow" and kw["factor"] < 1.0:
        raise ValueError(f"--inject {text!r}: factor must be >= 1.0")
    if kind == "sdc":
        kw["target"] = target
    return InjectSpec(id=index, kind=kind, **kw)


def dumps(specs: list[InjectSpec]) -> str:
    return json.dumps([s.to_json() for s in specs])


def loads(text: str) -> list[InjectSpec]:
    return [InjectSpec.from_json(d) for d in json.loads(text)] if text else []
