"""Checkpoints that resume a run exactly: model, optimizers, data position, step, clock, RNG.

Layout: ``<out_dir>/<run_id>.ckpt/step_NNNNNN/rank{r}.pt``, one file per rank, each written
atomically (:func:`nanoshampoo.io_utils.atomic_output`). ``rank0.pt`` also holds the
model weights (identical on every rank) and the run id; every rank holds its own optimizer
state (sharded optimizers such as DistAdam and the DDP Shampoo distributor keep different state
per rank), loader position and RNG state. Files load with ``torch.load(weights_only=True)``.

Checkpoints are never replaced: a run refuses to start when its run id already has a
checkpoint of a step it would write (:func:`check_no_checkpoint_replaced`), and
:func:`publish_checkpoint` refuses an existing directory.

A checkpoint is all ranks' files or nothing: every rank writes into ``step_NNNNNN.partial``,
and once all have written (a barrier), rank 0 renames it to ``step_NNNNNN``
(:func:`publish_checkpoint`). A run killed mid-write leaves at most a ``.partial`` directory,
which nothing loads; the previous checkpoint is untouched.

A write that fails (the disk is full: ``OSError`` ENOSPC, or torch's ``RuntimeError`` from its
zip writer) removes the rank's ``.partial`` directory and raises :class:`CheckpointWriteError`,
one line naming the file and the run's last good checkpoint. Before the run's first
checkpoint, :func:`check_state_loadable` refuses an optimizer state that a resume could not
load under ``weights_only=True`` (a user's optimizer keeping a function or an object of its
own there), naming the optimizer and the state's key.

Under ``parallel`` ``fsdp2`` / ``hsdp`` a checkpoint is a sharded ``torch.distributed.checkpoint``
(DCP) directory instead: every rank writes its shards of the model and optimizer state
(``dcp.save``, published the same way), and rank 0 adds ``meta.pt`` (step, clock, loader
position, RNG, run id). DCP reshards on load, so it resumes at any world size: the DTensor state
of the model and AdamW is cut anew, and Shampoo's ``round_robin`` / ``replicate`` state is keyed
by global block names. (``default`` names blocks by shard: same shard count only.)

Example:
    >>> path = checkpoint_path("runs", "r1", step=100)  # runs/r1.ckpt/step_000100
"""

from __future__ import annotations

import errno
import io
import re
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nanoshampoo.io_utils import OutputPathError, atomic_output
from nanoshampoo.train.config import UserError, check_run_id
from nanoshampoo.train.outcomes import last_line, optimizer_name
from nanoshampoo.validation import check_float, check_int

FORMAT_VERSION = 1
PARTIAL_SUFFIX = ".partial"
SHARDED_META = "meta.pt"
_STEP_DIR = re.compile(r"^step_(\d+)$")
# The class in the weights-only unpickler's refusal: "Unsupported global: GLOBAL pkg.Class ...".
_REFUSED_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")


class _Missing:
    """A field the record lacks: shown as ``got missing``."""

    def __repr__(self) -> str:
        return "missing"


_MISSING = _Missing()
# The loader's state (``DistributedTokenLoader.state_dict``): field -> type.
_LOADER_FIELDS = {
    "shard_index": int,
    "position": int,
    "passes": int,
    "tokens_per_step": int,
    "shard_names": list,
}


def checkpoint_path(out_dir: str, run_id: str, step: int) -> Path:
    return Path(out_dir) / f"{run_id}.ckpt" / f"step_{step:06d}"


def check_no_checkpoint_replaced(out_dir: str, run_id: str, after_step: int) -> None:
    """``UserError`` if run ``run_id`` already has a checkpoint of a step after ``after_step``.

    A fresh run (``after_step`` 0) refuses any existing checkpoint of its run id (its logs may
    have been moved away); a resume into the same run id refuses checkpoints beyond its start,
    which it would write again.
    """
    directory = Path(out_dir) / f"{run_id}.ckpt"
    if not directory.is_dir():
        return
    later = sorted(
        p.name
        for p in directory.iterdir()
        if (match := _STEP_DIR.match(p.name)) and int(match[1]) > after_step
    )
    if later:
        raise UserError(
            f"--run-id {run_id}: {directory} already holds {', '.join(later[:3])}"
            f"{', ...' if len(later) > 3 else ''}, which this run would replace; a run id names "
            "one run (choose another, or --resume its last checkpoint)"
        )


def latest_checkpoint(out_dir: str, run_id: str) -> Path | None:
    """The published checkpoint of run ``run_id`` with the highest step, or None."""
    directory = Path(out_dir) / f"{run_id}.ckpt"
    steps = [
        (int(m[1]), p)
        for p in (directory.iterdir() if directory.is_dir() else ())
        if (m := _STEP_DIR.match(p.name))
    ]
    return max(steps)[1] if steps else None


def partial_path(directory: Path) -> Path:
    """Where the ranks write ``directory``'s files before :func:`publish_checkpoint`."""
    return directory.with_name(directory.name + PARTIAL_SUFFIX)


def save_checkpoint(
    directory: Path,
    rank: int,
    world_size: int,
    step: int,
    train_time_ms: float,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    loader: Any,
    run_id: str,
    resumed_from: Path | None = None,
) -> None:
    """Write this rank's ``rank{rank}.pt`` under ``partial_path(directory)`` (created if needed).

    The checkpoint exists at ``directory`` only after every rank has saved and rank 0 has
    called :func:`publish_checkpoint`. ``resumed_from``: the checkpoint the run resumed from,
    named as the last good one by a failed write when the run has none of its own yet.
    """
    record: dict[str, Any] = {
        "format_version": FORMAT_VERSION,
        "run_id": run_id,
        "step": step,
        "world_size": world_size,
        "train_time_ms": train_time_ms,
        "optimizers": [opt.state_dict() for opt in optimizers],
        "loader": loader.state_dict(),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }
    if rank == 0:
        record["model"] = model.state_dict()
    with _removing_partial_on_write_failure(directory, f"rank{rank}.pt", resumed_from):
        with atomic_output(partial_path(directory) / f"rank{rank}.pt") as tmp:
            _write_record(record, tmp)


def _write_record(record: dict[str, Any], path: Path) -> None:
    torch.save(record, path)


class CheckpointWriteError(UserError):
    """A checkpoint file could not be written (a full disk); the message names the file, the
    reason and the run's last good checkpoint."""


def _is_write_failure(exc: BaseException) -> bool:
    """An ``OSError`` or torch's zip writer failing (``[enforce fail at inline_container.cc``:
    what ``torch.save`` to a path raises when the disk fills up under it)."""
    if isinstance(exc, (OSError, OutputPathError)):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        "inline_container.cc" in text or "PytorchStreamWriter" in text
    )


@contextmanager
def _removing_partial_on_write_failure(
    directory: Path, name: str, resumed_from: Path | None
) -> Iterator[None]:
    """A write failure inside: remove ``directory``'s ``.partial`` (never trusted anyway) and
    raise :class:`CheckpointWriteError` naming ``name`` and the last good checkpoint: the run's
    latest, else ``resumed_from`` (a run resumed under a new run id has none of its own)."""
    try:
        yield
    except (OSError, RuntimeError, OutputPathError) as exc:
        if not _is_write_failure(exc):
            raise
        staged = partial_path(directory)
        shutil.rmtree(staged, ignore_errors=True)
        if isinstance(exc, OutputPathError):  # atomic_output could not create the file
            why = str(exc.__cause__ or exc)
        elif isinstance(exc, OSError):
            why = exc.strerror or str(exc)
            if exc.errno != errno.ENOSPC:
                why = f"{why} [errno {exc.errno}]"
        else:  # torch's message says only that the zip writer failed: say what is left
            free = shutil.disk_usage(directory.parent if directory.parent.is_dir() else ".").free
            why = f"{last_line(exc)}; {free:,} bytes free on its disk"
        run_id = directory.parent.name.removesuffix(".ckpt")
        last = latest_checkpoint(str(directory.parent.parent), run_id) or resumed_from
        raise CheckpointWriteError(
            f"checkpoint {directory}: could not write {name} ({why}); "
            f"{staged.name} removed; the last good checkpoint is "
            f"{last if last is not None else 'none of this run'}"
        ) from exc


def check_state_loadable(optimizers: list[torch.optim.Optimizer]) -> None:
    """``UserError`` naming the optimizer and the state key if an optimizer's state dict would
    not come back from ``torch.load(weights_only=True)`` (what a resume reads): a function, a
    lambda or an object of the user's own class in its state.

    Serializes to memory and loads back; each tensor stands in as an empty one of its dtype
    (tensors always load), so the check costs no copy of the state.
    """
    for optimizer in optimizers:
        state = _without_tensor_data(optimizer.state_dict())
        if _round_trip_error(state) is None:
            continue
        for key, value in _state_leaves(state):
            error = _round_trip_error(value)
            if error is not None:
                raise UserError(
                    f"optimizer {optimizer_name(optimizer)}: its state {key} holds a "
                    f"{type(value).__qualname__}, which a checkpoint cannot hold ({error}); "
                    "keep tensors, numbers, strings and lists, tuples and dicts of them"
                )
        raise UserError(  # each leaf alone loads, the whole does not: name the whole
            f"optimizer {optimizer_name(optimizer)}: its state dict does not load back under "
            f"torch.load(weights_only=True) ({_round_trip_error(state)})"
        )


def _without_tensor_data(value: Any) -> Any:
    # Every tensor, DTensors included (a sharded checkpoint writes them through DCP, not
    # pickle), as an empty plain one of its dtype.
    if isinstance(value, torch.Tensor):
        return torch.empty(0, dtype=value.dtype)
    if isinstance(value, dict):
        return {k: _without_tensor_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_without_tensor_data(v) for v in value)
    return value


def _round_trip_error(value: Any) -> str | None:
    """Why ``value`` does not survive ``torch.save`` then ``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    try:
        torch.save(value, buffer)
    except Exception as exc:  # noqa: BLE001 - pickling a user's object may raise anything
        return f"it cannot be saved: {last_line(exc)}"
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception:  # noqa: BLE001 - the weights-only unpickler's refusal, whatever its type
        return "torch.load(weights_only=True) refuses it"
    return None


def _state_leaves(value: Any, label: str = "") -> Iterator[tuple[str, Any]]:
    """``(label, leaf)`` of a state dict, e.g. ``("state[0]['fn']", <lambda>)``; dicts,
    lists and tuples are walked through."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _state_leaves(item, f"{label}[{key!r}]" if label else str(key))
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _state_leaves(item, f"{label}[{index}]")
    else:
        yield label, value


def save_sharded_checkpoint(
    directory: Path,
    rank: int,
    step: int,
    train_time_ms: float,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    loader: Any,
    run_id: str,
    parallel: str,
    resumed_from: Path | None = None,
) -> None:
    """Collective: ``dcp.save`` this rank's shards under ``partial_path(directory)``; rank 0
    also writes ``meta.pt``. Published, like :func:`save_checkpoint`, after a barrier
    (``resumed_from`` as there).

    The loader position is rank 0's: it counts global steps, the same on every rank.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    staged = partial_path(directory)
    if rank == 0:  # a crashed save's files (maybe of another world size) must not mix in
        shutil.rmtree(staged, ignore_errors=True)
    dist.barrier()
    with _removing_partial_on_write_failure(directory, f"rank {rank}'s shards", resumed_from):
        dcp.save(_sharded_state(model, optimizers), checkpoint_id=staged)
    if rank == 0:
        record: dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "format": "dcp",
            "parallel": parallel,
            "run_id": run_id,
            "step": step,
            "world_size": dist.get_world_size(),
            "train_time_ms": train_time_ms,
            "num_optimizers": len(optimizers),
            "loader": loader.state_dict(),
            "cpu_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        }
        with _removing_partial_on_write_failure(directory, SHARDED_META, resumed_from):
            with atomic_output(staged / SHARDED_META) as tmp:
                _write_record(record, tmp)


def _sharded_state(model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> dict[str, Any]:
    """The DCP state dict: the model's and each optimizer's own state dicts (DTensors inside).

    Also the template a load fills in place, so optimizer state must exist before loading.
    """
    return {
        "model": model.state_dict(),
        "optimizers": {str(i): opt.state_dict() for i, opt in enumerate(optimizers)},
    }


def publish_checkpoint(directory: Path) -> None:
    """Rank 0, after every rank saved: move the complete ``.partial`` directory to ``directory``.

    An existing ``directory`` is never replaced (``UserError``; :func:`check_no_checkpoint_replaced`
    refuses such a run before its first step).
    """
    if directory.exists():
        raise UserError(f"checkpoint {directory} already exists; not replacing it")
    partial_path(directory).rename(directory)


@dataclass
class CheckpointRecords:
    """The loaded files of one rank: its own, and rank 0's (the model weights)."""

    directory: Path
    own: dict[str, Any]
    shared: dict[str, Any]

    @property
    def sharded(self) -> bool:
        """A DCP directory (written under ``parallel`` ``fsdp2`` / ``hsdp``)."""
        return self.own.get("format") == "dcp"

    @property
    def step(self) -> int:
        return int(self.own["step"])

    @property
    def run_id(self) -> str:
        """The run that wrote it (checkpoints without the field: from ``<run_id>.ckpt``)."""
        return str(self.shared.get("run_id") or self.directory.parent.name.removesuffix(".ckpt"))


def read_checkpoint(directory: Path, rank: int, world_size: int) -> CheckpointRecords:
    """Load and check this rank's checkpoint files; ``UserError`` naming the file if unusable."""
    if not directory.is_dir():
        raise UserError(f"--resume {directory}: no such checkpoint directory")
    if (directory / SHARDED_META).is_file():
        meta = _load(directory / SHARDED_META)
        _check_version(directory, meta)
        _check_record(directory / SHARDED_META, meta, sharded=True, holds_model=False)
        return CheckpointRecords(directory, meta, meta)  # DCP reshards to any world size
    own = _load(directory / f"rank{rank}.pt")
    shared = own if rank == 0 else _load(directory / "rank0.pt")
    _check_version(directory, own)
    _check_record(directory / f"rank{rank}.pt", own, sharded=False, holds_model=rank == 0)
    if shared is not own:
        _check_record(directory / "rank0.pt", shared, sharded=False, holds_model=True)
    if own["world_size"] != world_size:
        raise UserError(
            f"--resume {directory}: checkpoint was written by {own['world_size']} ranks, "
            f"this run has {world_size}"
        )
    return CheckpointRecords(directory, own, shared)


def _check_version(directory: Path, record: dict[str, Any]) -> None:
    if record.get("format_version") != FORMAT_VERSION:
        raise UserError(
            f"--resume {directory}: unsupported checkpoint format {record.get('format_version')!r}"
        )


def _check_record(path: Path, record: dict[str, Any], sharded: bool, holds_model: bool) -> None:
    """``UserError`` naming ``path`` and the field, for a record unlike ``save_checkpoint``'s."""

    def bad(name: str, expected: str) -> UserError:
        shown = repr(record[name]) if name in record else "missing"
        return UserError(f"--resume: {path}: field {name!r} must be {expected}, got {shown[:60]}")

    def check(name: str, rule: Callable[..., Any], **bounds: Any) -> None:
        """``rule`` (a ``nanoshampoo.validation`` check) on the field, as a one-line UserError."""
        try:
            rule(f"field {name!r}", record.get(name, _MISSING), **bounds)
        except ValueError as err:
            raise UserError(f"--resume: {path}: {str(err)[:160]}") from None

    check("step", check_int, at_least=0)
    check("world_size", check_int, at_least=1)
    check("train_time_ms", check_float, at_least=0.0)
    if not isinstance(record.get("run_id", ""), str):
        raise bad("run_id", "a string")
    try:  # a resumed run's logs are named by it: "../x" would write outside --out-dir
        check_run_id(f"--resume: {path}: field 'run_id'", record.get("run_id", ""))
    except ValueError as exc:
        raise UserError(str(exc)) from None
    loader = record.get("loader")
    if not isinstance(loader, dict) or any(
        not isinstance(loader.get(k), t) or isinstance(loader.get(k), bool)
        for k, t in _LOADER_FIELDS.items()
    ):
        raise bad("loader", f"the loader's state (a dict of {', '.join(_LOADER_FIELDS)})")
    rng = record.get("cpu_rng")
    if (
        not isinstance(rng, torch.Tensor)
        or rng.dtype != torch.uint8
        or (rng.shape != torch.get_rng_state().shape)
    ):
        raise bad("cpu_rng", "a uint8 tensor (torch.get_rng_state())")
    if record.get("cuda_rng") is not None and not isinstance(record["cuda_rng"], torch.Tensor):
        raise bad("cuda_rng", "None or a tensor")
    if sharded:
        check("num_optimizers", check_int, at_least=0)
        return
    optimizers = record.get("optimizers")
    if not isinstance(optimizers, list) or not all(isinstance(o, dict) for o in optimizers):
        raise bad("optimizers", "a list of optimizer state dicts")
    if holds_model and not isinstance(record.get("model"), dict):
        raise bad("model", "the model's state dict")
    tensors = (
        [(f"model[{k!r}]", v) for k, v in record.get("model", {}).items()] if holds_model else []
    )
    tensors += [
        (f"optimizers[{i}] state {k}", v)
        for i, o in enumerate(optimizers)
        for k, v in _state_tensors(o.get("state"))
    ]
    for name, value in tensors:  # NaN weights or moments would only surface steps later
        if (
            isinstance(value, torch.Tensor)
            and value.is_floating_point()
            and not bool(torch.isfinite(value).all())
        ):
            raise UserError(f"--resume: {path}: {name} holds NaN or Inf")


def _state_tensors(state: Any, label: str = "") -> list[tuple[str, Any]]:
    """``(label, value)`` of every leaf of an optimizer state dict's ``state`` (nested dicts,
    such as DistributedShampoo's per-block state, walked through)."""
    if not isinstance(state, dict):
        return [(label, state)] if label else []
    return [
        leaf for key, value in state.items() for leaf in _state_tensors(value, f"{label}[{key!r}]")
    ]


def restore_checkpoint(
    records: CheckpointRecords,
    model: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    loader: Any,
) -> tuple[int, float]:
    """Restore everything ``save_checkpoint`` wrote; return ``(step, train_time_ms)``."""
    own, directory = records.own, records.directory
    if records.sharded and own["num_optimizers"] != len(optimizers):
        raise UserError(
            f"--resume {directory}: checkpoint holds {own['num_optimizers']} optimizers, the "
            f"run builds {len(optimizers)} (different optimizer setup?)"
        )
    if not records.sharded and len(own["optimizers"]) != len(optimizers):
        raise UserError(
            f"--resume {directory}: checkpoint holds {len(own['optimizers'])} optimizers, the "
            f"run builds {len(optimizers)} (different optimizer setup?)"
        )
    # The loader first: it checks everything before it changes, so a misfit changes nothing.
    try:
        loader.load_state_dict(own["loader"])
    except ValueError as exc:
        raise UserError(
            f"--resume {directory}: its data position does not fit this run ({exc}); "
            "resume with the --batch-size, --seq-len and data files of the run that "
            "wrote it"
        ) from exc
    try:
        if records.sharded:
            _load_sharded(directory, model, optimizers)
        else:
            model.load_state_dict(records.shared["model"])
            for opt, state in zip(optimizers, own["optimizers"]):
                opt.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError, TypeError, AttributeError) as exc:
        # A state of the right types but another layout, e.g. from another optimizer setup.
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"--resume {directory}: does not fit this run's model or optimizer setup ({first_line})"
        ) from exc
    torch.set_rng_state(own["cpu_rng"])
    if own["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(own["cuda_rng"])
    return records.step, float(own["train_time_ms"])


def _load_sharded(
    directory: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> None:
    """Collective: fill the model and optimizers from a DCP directory (resharded by DCP)."""
    import torch.distributed.checkpoint as dcp

    for opt in optimizers:
        _create_lazy_state(opt)
    state = _sharded_state(model, optimizers)
    dcp.load(state, checkpoint_id=directory)
    model.load_state_dict(state["model"])
    for i, opt in enumerate(optimizers):
        opt.load_state_dict(state["optimizers"][str(i)])


@torch.no_grad()
def _create_lazy_state(opt: torch.optim.Optimizer) -> None:
    """Give an optimizer that builds its state on the first step (AdamW) that state, so that a
    DCP load has tensors to fill: one step on zero gradients at learning rate 0 (parameters
    unchanged; the state it makes is overwritten by the load). No-op when state exists.
    """
    if opt.state:
        return
    params = [p for group in opt.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [group["lr"] for group in opt.param_groups]
    for group in opt.param_groups:
        group["lr"] = 0.0
    opt.step()
    for group, lr in zip(opt.param_groups, lrs):
        group["lr"] = lr
    for p in params:
        p.grad = None


def _load(path: Path) -> dict[str, Any]:
    # Registers the configs a DistributedShampoo state dict's param groups hold, for the
    # weights_only load below (a resume reads its checkpoint before it builds the optimizers).
    from nanoshampoo.optim.shampoo import shampoo_types  # noqa: F401

    if not path.is_file():
        raise UserError(f"--resume: checkpoint file {path} does not exist")
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure to unpickle means a damaged file
        # The exception's own text may suggest weights_only=False: wrong advice for a damaged
        # file, and unsafe. Name the file and the failure's type only, or the class that the
        # weights-only loader refused (a whole file written before check_state_loadable).
        refused = _REFUSED_GLOBAL.search(str(exc))
        if refused:
            raise UserError(
                f"--resume: {path} holds an object of class {refused[1]}, which "
                "torch.load(weights_only=True) does not load (an optimizer kept it in its "
                "state); the file is whole, but no resume can read it"
            ) from exc
        raise UserError(
            f"--resume: {path} is not a readable checkpoint (empty, truncated or "
            f"corrupt: {type(exc).__name__})"
        ) from exc
    if not isinstance(record, dict) or "step" not in record:
        raise UserError(f"--resume: {path} is not a nanoshampoo training checkpoint")
    return record
