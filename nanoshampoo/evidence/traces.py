"""Communication/computation overlap from PyTorch profiler Chrome traces, per rank.

For each rank's trace this computes, from unions of intervals (nested or concurrent events
are counted once, never summed):

* ``communication_ms``: time during which communication is in progress;
* ``computation_ms``: time during which computation runs;
* ``overlap_ms``: time doing both; ``overlap_pct = 100 * overlap / communication`` (the
  Holistic Trace Analysis "comm-comp overlap");
* ``exposed_communication_ms = communication - overlap``: communicating but not computing,
  the time a better schedule can win back.

Two kinds of traces are classified differently.

**CUDA traces** (any event with ``cat == "kernel"``): communication is NCCL kernels (name
starting ``nccl``, e.g. ``ncclDevKernel_ReduceScatter_Sum_f32_RING_LL``), computation is
every other kernel, over all GPU streams of the rank. Memcpy/memset events are neither.

**CPU traces** (gloo backend). Observed on torch 2.13 CPU with a 2-rank gloo job (see
``bench/evidence_gloo_trace.py``): every collective, whatever its API
(``reduce_scatter_tensor``, ``all_gather_into_tensor``, ``all_reduce``, functional
collectives, ``barrier``), runs on a gloo worker thread (named ``pt_gloo_runloop`` or just
``python``, so threads are recognized by their events, not their names) as a
``user_annotation`` named ``gloo:<collective>`` (``gloo:all_reduce`` -- gloo runs
reduce-scatter as an all-reduce --, ``gloo:all_gather``, ``gloo:barrier``), which may contain
the worker's own ``aten::`` ops (copies, the ``div_`` of an AVG reduction). The main thread
shows the launch as a ``cpu_op`` named
``c10d::<op>_`` (``c10d::_reduce_scatter_base_``, ``c10d::_allgather_base_``,
``c10d::allreduce_``, ``c10d::barrier``), containing staging ``aten::clone``/``aten::copy_``;
functional collectives add ``_c10d_functional::all_reduce`` and a blocking
``_c10d_functional::wait_tensor``. ``Work.wait()`` called from Python leaves no event: the
main thread simply has a gap while it blocks. Hence:

* communication = ``gloo:*`` events on any thread, united with main-thread communication ops
  (names starting ``c10d::``, ``_c10d_functional::``, ``c10d_functional::``, or
  ``record_param_comms``): while the main thread is inside a collective call it is busy
  with communication, not computing;
* computation = ``aten::`` ops (``cat == "cpu_op"``) on threads that run no ``gloo:*`` event,
  minus the time of communication ops on that thread. Counting ``aten::`` ops rather than
  wrapper ops (``autograd::engine::evaluate_function: ...``, ``Optimizer.step#...``,
  ``ProfilerStep#N``) keeps a blocked wait inside a wrapper -- a gradient hook that waits, an
  optimizer step that waits on a future -- from counting as compute; subtracting
  communication ops drops the staging copies inside ``c10d::`` ops and anything inside a
  ``wait_tensor``.

Example:
    >>> for stats in analyze_paths(["profile/"]):  # doctest: +SKIP
    ...     print(stats.rank, f"{stats.overlap_pct:.1f}%", stats.exposed_communication_ms)
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nanoshampoo.errors import UserError
from nanoshampoo.evidence.intervals import difference, intersection, merge, total
from nanoshampoo.evidence.tables import format_table
from nanoshampoo.validation import is_real

CPU_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "record_param_comms")
GLOO_PREFIX = "gloo:"
NCCL_PREFIX = "nccl"
STEP_ANNOTATION = re.compile(r"^ProfilerStep#\d+$")
TRACE_SUFFIXES = (".json", ".json.gz")


class TraceFormatError(UserError):
    """A trace file that cannot be analyzed; the message names the file."""


@dataclass(frozen=True)
class OverlapStats:
    """Communication/computation overlap of one rank's trace; times in milliseconds.

    ``overlap_pct`` is ``None`` when the trace has no communication. ``by_collective`` maps
    each communication event name to its ``(communication_ms, exposed_ms)``.
    """

    path: str
    rank: int | None
    device: str  # "cuda" or "cpu"
    steps: int  # ProfilerStep#N annotations in the trace
    window_ms: float
    communication_ms: float
    computation_ms: float
    overlap_ms: float
    exposed_communication_ms: float
    overlap_pct: float | None
    by_collective: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class _Event:
    name: str
    cat: str
    thread: tuple[Any, Any]  # (pid, tid)
    start: float  # microseconds
    end: float


def load_trace(path: str | Path) -> dict[str, Any]:
    """Read a Chrome trace (``.json`` or ``.json.gz``) written by ``torch.profiler``."""
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        if path.exists() and not path.is_file():
            raise TraceFormatError(f"{path}: not a regular file (a trace is a plain file)")
        with opener(path, "rt", encoding="utf-8") as f:
            trace = json.load(f)
    except FileNotFoundError:
        raise TraceFormatError(f"{path}: no such file") from None
    except RecursionError:
        raise TraceFormatError(f"{path}: JSON nested too deeply to be a Chrome trace") from None
    except (OSError, EOFError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TraceFormatError(f"{path}: not a readable JSON trace ({exc})") from exc
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        raise TraceFormatError(f"{path}: no 'traceEvents' list (not a Chrome trace)")
    return trace


def analyze_trace(path: str | Path) -> OverlapStats:
    """Overlap statistics of one trace file (see the module docstring for the rules)."""
    path = Path(path)
    trace = load_trace(path)
    events, thread_names = _complete_events(path, trace["traceEvents"])
    if not events:
        raise TraceFormatError(f"{path}: no complete ('ph': 'X') events")
    if any(e.cat == "kernel" for e in events):
        device = "cuda"
        comm_events = [e for e in events if e.cat == "kernel" and _is_nccl(e.name)]
        comm = merge([(e.start, e.end) for e in comm_events])
        compute = merge(
            [(e.start, e.end) for e in events if e.cat == "kernel" and not _is_nccl(e.name)]
        )
    else:
        device = "cpu"
        comm_events, comm, compute = _classify_cpu(events, thread_names)
    overlap = intersection(comm, compute)
    step_events = [e for e in events if STEP_ANNOTATION.match(e.name)]
    window = step_events or events
    by_name: dict[str, list[tuple[float, float]]] = {}
    for e in comm_events:
        by_name.setdefault(e.name, []).append((e.start, e.end))
    communication_ms = total(comm) / 1e3
    overlap_ms = total(overlap) / 1e3
    return OverlapStats(
        path=str(path),
        rank=_rank(path, trace),
        device=device,
        steps=len(step_events),
        window_ms=(max(e.end for e in window) - min(e.start for e in window)) / 1e3,
        communication_ms=communication_ms,
        computation_ms=total(compute) / 1e3,
        overlap_ms=overlap_ms,
        exposed_communication_ms=communication_ms - overlap_ms,
        overlap_pct=100.0 * overlap_ms / communication_ms if communication_ms > 0 else None,
        by_collective={
            name: (total(spans) / 1e3, total(difference(spans, compute)) / 1e3)
            for name, spans in sorted(by_name.items())
        },
    )


def find_trace_files(directory: str | Path) -> list[Path]:
    """Trace files (``*.json``, ``*.json.gz``) directly inside ``directory``, sorted."""
    directory = Path(directory)
    files = [p for p in directory.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES)]
    return sorted(
        files, key=lambda p: (_rank_from_name(p) is None, _rank_from_name(p) or 0, p.name)
    )


def analyze_paths(paths: Sequence[str | Path]) -> list[OverlapStats]:
    """Analyze trace files and every trace file inside the given directories."""
    files: list[Path] = []
    for path in map(Path, paths):
        try:
            is_dir = path.is_dir()
        except OSError as exc:  # e.g. a name too long for the file system
            raise TraceFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if is_dir:
            found = find_trace_files(path)
            if not found:
                raise TraceFormatError(
                    f"{path}: no trace files (*.json, *.json.gz) in this directory"
                )
            files.extend(found)
        else:
            files.append(path)
    seen: dict[Path, Path] = {}
    for f in files:  # one file given twice would count as two ranks
        if f.exists() and seen.setdefault(f.resolve(), f) is not f:
            raise TraceFormatError(
                f"{f}: given twice (as {seen[f.resolve()]}); each trace "
                "file is one rank's and counts once"
            )
    return [analyze_trace(f) for f in files]


def _complete_events(path: Path, raw: list[Any]) -> tuple[list[_Event], dict[tuple[Any, Any], str]]:
    events = []
    thread_names: dict[tuple[Any, Any], str] = {}
    for index, e in enumerate(raw):
        if not isinstance(e, dict):
            raise TraceFormatError(f"{path}: traceEvents[{index}] is not an object")
        if e.get("ph") == "M" and e.get("name") == "thread_name":
            name = (e.get("args") or {}).get("name", "")
            key = (e.get("pid"), e.get("tid"))
            # torch may name one tid twice (e.g. "pt_gloo_runloop" and "python"); keep both.
            thread_names[key] = f"{thread_names[key]} {name}" if key in thread_names else str(name)
        if e.get("ph") != "X":
            continue
        ts, dur = e.get("ts"), e.get("dur")
        if not (_finite_number(ts) and _finite_number(dur) and dur >= 0):
            raise TraceFormatError(
                f"{path}: traceEvents[{index}] ({e.get('name')!r}) needs finite numeric 'ts' and "
                f"'dur' >= 0, got ts={ts!r} dur={dur!r}"
            )
        events.append(
            _Event(
                str(e.get("name", "")),
                str(e.get("cat", "")),
                (e.get("pid"), e.get("tid")),
                float(ts),
                float(ts) + float(dur),
            )
        )
    return events, thread_names


def _finite_number(value: Any) -> bool:
    return is_real(value) and math.isfinite(value)


def _classify_cpu(
    events: list[_Event], thread_names: dict[tuple[Any, Any], str]
) -> tuple[list[_Event], np.ndarray, np.ndarray]:
    """Communication events, communication intervals and computation intervals of a CPU trace."""
    gloo_threads = {e.thread for e in events if e.name.startswith(GLOO_PREFIX)}
    gloo_threads |= {t for t, name in thread_names.items() if "gloo" in name}
    comm_events = [e for e in events if e.name.startswith(GLOO_PREFIX)]
    compute_parts = []
    by_thread: dict[tuple[Any, Any], list[_Event]] = {}
    for e in events:
        if e.thread not in gloo_threads and e.cat == "cpu_op":
            by_thread.setdefault(e.thread, []).append(e)
    for thread_events in by_thread.values():
        comm_ops = [e for e in thread_events if e.name.startswith(CPU_COMM_PREFIXES)]
        comm_events.extend(comm_ops)
        aten = [(e.start, e.end) for e in thread_events if e.name.startswith("aten::")]
        compute_parts.append(difference(aten, [(e.start, e.end) for e in comm_ops]))
    comm = merge([(e.start, e.end) for e in comm_events])
    compute = merge(np.concatenate(compute_parts)) if compute_parts else np.empty((0, 2))
    return comm_events, comm, compute


def _is_nccl(name: str) -> bool:
    return name.lower().startswith(NCCL_PREFIX)


def _rank(path: Path, trace: dict[str, Any]) -> int | None:
    info = trace.get("distributedInfo")
    if isinstance(info, dict) and isinstance(info.get("rank"), int):
        return int(info["rank"])
    return _rank_from_name(path)


def _rank_from_name(path: Path) -> int | None:
    match = re.search(r"rank[-_]?(\d+)", path.name)
    return int(match.group(1)) if match else None


def format_overlap(stats: Sequence[OverlapStats]) -> str:
    """Text table: one row per rank, then each rank's time per communication event name."""
    header = [
        "rank",
        "device",
        "steps",
        "window_ms",
        "comm_ms",
        "compute_ms",
        "overlap_ms",
        "overlap_%",
        "exposed_comm_ms",
        "file",
    ]
    rows = [header]
    for s in stats:
        rows.append(
            [
                "-" if s.rank is None else str(s.rank),
                s.device,
                str(s.steps),
                f"{s.window_ms:.3f}",
                f"{s.communication_ms:.3f}",
                f"{s.computation_ms:.3f}",
                f"{s.overlap_ms:.3f}",
                "-" if s.overlap_pct is None else f"{s.overlap_pct:.1f}",
                f"{s.exposed_communication_ms:.3f}",
                Path(s.path).name,
            ]
        )
    lines = format_table(rows)
    for s in stats:
        if s.by_collective:
            lines.append(f"rank {s.rank} communication by event (ms, exposed ms):")
            lines.extend(
                f"  {name}: {comm:.3f}, {exposed:.3f}"
                for name, (comm, exposed) in s.by_collective.items()
            )
    return "\n".join(lines)
