"""Sort run logs into named groups (one group = one configuration run with several seeds).

Three ways to form groups, all returning ``{name: [RunRecord, ...]}`` in a stable order:

* :func:`groups_by_directory` -- each directory given is a group; a file given goes to the
  group of its parent directory (the layout ``nanoshampoo repeat`` writes).
* :func:`groups_from_specs` -- explicit ``NAME=GLOB`` labels, e.g.
  ``adam=logs/adam*/*.jsonl``.
* :func:`regroup` -- re-key already read runs by a JSONL config field (``optimizer``,
  ``preset``, ``world_size``) or by any field of the run's ``TrainConfig``.

Example:
    >>> specs = ["base=runs/base/*.jsonl", "hook=runs/hook/*.jsonl"]
    >>> groups = groups_from_specs(specs)  # doctest: +SKIP
    >>> sorted(groups)  # doctest: +SKIP
    ['base', 'hook']
"""

from __future__ import annotations

import glob
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from nanoshampoo.evidence.logs import (
    RUN_SUFFIXES,
    LogFormatError,
    RunRecord,
    find_run_files,
    read_run,
)

RUN_FIELDS = ("optimizer", "preset", "world_size")


def groups_by_directory(paths: Sequence[str | Path]) -> dict[str, list[RunRecord]]:
    """One group per directory; files join the group of their parent directory."""
    if not paths:
        raise ValueError("paths: give at least one run log or directory")
    files: dict[str, list[Path]] = {}
    for path in map(Path, paths):
        try:
            is_dir, exists = path.is_dir(), path.exists()
        except OSError as exc:  # e.g. a name too long for the file system
            raise LogFormatError(f"{path}: cannot read ({exc.strerror or exc})") from None
        if is_dir:
            found = find_run_files(path)
            if not found:
                raise LogFormatError(f"{path}: no run logs (*.jsonl or *.txt) in this directory")
            files.setdefault(str(path), []).extend(found)
        elif exists:
            files.setdefault(str(path.parent), []).append(path)
        else:
            raise LogFormatError(f"{path}: no such file or directory")
    return {
        name: [read_run(p) for p in _prefer_jsonl(_unique(group))] for name, group in files.items()
    }


def groups_from_specs(specs: Sequence[str]) -> dict[str, list[RunRecord]]:
    """Groups from ``NAME=GLOB`` strings; a glob matching a directory takes its run logs."""
    groups: dict[str, list[RunRecord]] = {}
    for spec in specs:
        name, sep, pattern = spec.partition("=")
        if not sep or not name or not pattern:
            raise ValueError(f"group: expected NAME=GLOB, got {spec!r}")
        if name in groups:
            raise ValueError(f"group: name {name!r} given twice")
        files: list[Path] = []
        for match in sorted(glob.glob(pattern, recursive=True)):
            path = Path(match)
            if path.is_dir():
                files.extend(find_run_files(path))
            elif path.suffix in RUN_SUFFIXES:
                files.append(path)
        files = _prefer_jsonl(_unique(files))
        if not files:
            raise LogFormatError(f"group {name!r}: pattern {pattern!r} matches no run logs")
        groups[name] = [read_run(p) for p in files]
    return groups


def regroup(groups: Mapping[str, Sequence[RunRecord]], key: str) -> dict[str, list[RunRecord]]:
    """Re-key all runs by ``key``: a run field in ``RUN_FIELDS`` or a ``TrainConfig`` field.

    Only JSONL runs carry these; a run without the key raises ``LogFormatError``.
    """
    regrouped: dict[str, list[RunRecord]] = {}
    for runs in groups.values():
        for run in runs:
            value = getattr(run, key) if key in RUN_FIELDS else run.config.get(key)
            if value is None:
                raise LogFormatError(
                    f"{run.path}: run has no {key!r} to group by (only .jsonl logs carry it)"
                )
            regrouped.setdefault(f"{key}={value}", []).append(run)
    return regrouped


def _unique(paths: Iterable[Path]) -> list[Path]:
    seen: dict[Path, None] = {}
    for path in paths:
        seen.setdefault(path.resolve(), None)
    return list(seen)


def _prefer_jsonl(paths: list[Path]) -> list[Path]:
    """Drop ``X.txt`` when ``X.jsonl`` of the same run is also present."""
    jsonl_stems = {(p.parent, p.stem) for p in paths if p.suffix == ".jsonl"}
    return [p for p in paths if p.suffix == ".jsonl" or (p.parent, p.stem) not in jsonl_stems]
