"""Why a phase failed, in one line for `submit`, read from the node logs of its last attempt.

In order of preference:
1. the trainer's own one-line errors (`megatron-hpc: error: ...`), which already say the fix;
2. the root cause torchrun names: the rank in its "Root Cause (first observed failure)" section
   (the earliest over the nodes), with that worker's own exception line (torch prefixes a worker's
   output with `[rankN]:`) or, failing that, the traceback or signal torchrun recorded for it;
3. the last exception line of any traceback but torchrun's own ChildFailedError, which only says
   that a worker failed;
4. the tail of the first node's log.

The format of torchrun's summary: torch/distributed/elastic/multiprocessing/errors/__init__.py
(_MSG_FORMAT_TEMPLATE, _FAILURE_FORMAT_TEMPLATE). No torch import.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from megatron_hpc.run_folder import node_logs

_OURS = "megatron-hpc: error:"
# node.sh's first line of each attempt of a phase: logs are appended across requeues.
_ATTEMPT_START = re.compile(r"^megatron-hpc: (compile|run) phase, node \d+ of \d+")
_RANK_LINE = re.compile(r"^\[rank(\d+)\]:\s?(.*)$")
_ROOT_CAUSE = "Root Cause (first observed failure):"
_FIELD = re.compile(r"^\s{2}(\w+)\s*:\s?(.*)$")
_TORCHRUN_WRAPPER_ERROR = "ChildFailedError"


@dataclass(frozen=True, slots=True)
class _RootCause:
    time: str
    rank: int | None
    message: list[str]
    """torchrun's `traceback :` field with its continuation lines."""


def explain_failure(run_dir: Path, phase: str, *, lines: int = 15) -> str:
    logs = node_logs(run_dir, phase)
    texts = [last_attempt(p.read_text(errors="replace")) for p in logs]
    ours: list[str] = []
    for text in texts:
        for line in text.splitlines():
            if _OURS in line and line.strip() not in ours:
                ours.append(line.strip())
    if ours:
        return "\n".join(ours[:3])
    found = [(cause, text) for text in texts if (cause := root_cause(text)) is not None]
    if found:
        cause, text = min(found, key=lambda pair: pair[0].time)  # ISO-like times sort as text
        reason = _explain_root_cause(cause, text)
        if reason:
            return reason
    for text in texts:
        exceptions = [_strip_rank(ln) for ln in text.splitlines() if _looks_like_exception(_strip_rank(ln))]
        exceptions = [ln for ln in exceptions if _TORCHRUN_WRAPPER_ERROR not in ln.split(":", 1)[0]]
        if exceptions:
            return exceptions[-1].strip()
    tail = texts[0].splitlines()[-lines:] if texts else ["(no log was written)"]
    return "last lines of its log:\n" + "\n".join(tail)


def last_attempt(text: str) -> str:
    """The part of a node log written by the phase's last attempt (a requeued job appends to it)."""
    starts = [i for i, line in enumerate(text.splitlines()) if _ATTEMPT_START.match(line)]
    return "\n".join(text.splitlines()[starts[-1]:]) if starts else text


def root_cause(text: str) -> _RootCause | None:
    """The first root-cause failure of torchrun's summary in a log, or None."""
    lines = text.splitlines()
    try:
        start = next(i for i, ln in enumerate(lines) if ln.strip() == _ROOT_CAUSE)
    except StopIteration:
        return None
    fields: dict[str, str] = {}
    message: list[str] = []
    for line in lines[start + 1:]:
        if line.startswith("====="):
            break
        if message:  # the traceback's continuation lines, indented by torchrun
            message.append(line.strip())
            continue
        m = _FIELD.match(line)
        if m is None:
            continue
        fields[m.group(1)] = m.group(2).strip()
        if m.group(1) == "traceback":
            message.append(m.group(2).strip())
    rank = re.match(r"\d+", fields.get("rank", ""))
    return _RootCause(time=fields.get("time", ""), rank=int(rank.group()) if rank else None, message=message)


def _explain_root_cause(cause: _RootCause, text: str) -> str | None:
    who = f"rank {cause.rank}" if cause.rank is not None else "a worker"
    if cause.rank is not None:
        own = [m.group(2) for ln in text.splitlines() if (m := _RANK_LINE.match(ln)) and int(m.group(1)) == cause.rank]
        exceptions = [ln for ln in own if _looks_like_exception(ln)]
        if exceptions:
            return f"{who}: {exceptions[-1].strip()}"
    exceptions = [ln for ln in cause.message if _looks_like_exception(ln)]
    if exceptions:
        return f"{who}: {exceptions[-1]}"
    first = cause.message[0] if cause.message else ""
    if first.startswith("Signal "):  # e.g. "Signal 9 (SIGKILL) received by PID 123": an OOM kill, a kill -9
        return f"{who}: {first}"
    return None


def _strip_rank(line: str) -> str:
    m = _RANK_LINE.match(line)
    return m.group(2) if m else line


def _looks_like_exception(line: str) -> bool:
    head = line.strip().split(":", 1)[0]
    return head.endswith(("Error", "Exception", "Interrupt")) and " " not in head
