"""``TrainConfig``: a run's settings in typed sections, and one hyper-parameter table per component.

A run is fully described by this config and the code (which the run log records verbatim).
Python reads it by section (``cfg.schedule.num_iterations``, ``cfg.parallel.mode``: see
:class:`TrainConfig`); users spell every run-level key flat (``num_iterations = 300`` in a
preset, ``--num-iterations``), and ``run_keys`` maps one spelling onto the other.
The defaults are the ``tiny-shampoo`` CPU run (tiny GPT on the embedded corpus, 300 steps);
presets (``nanoshampoo/train/presets/*.toml``) hold only what differs from them, and CLI flags
override the preset field by field.

``optimizer`` names a registered setup (``nanoshampoo.train.setups``); each setup reads its
hyper-parameters from registered tables (``[adam]``, ``[muon]``, ...), held in ``tables`` and
read by class: ``cfg.table(MuonConfig).lr``. Keyword arguments, presets and flags spell a table
field ``muon.lr`` (a preset's ``[muon]`` table, ``{"muon": {"lr": 0.02}}``, holds the same
keys). That is the one spelling: a name from before (``muon_lr``, ``--autocast-bf16``) fails
with one line naming its new spelling (``RENAMED``, used for nothing else).

Example:
    >>> from nanoshampoo.train.setups.adam import AdamWConfig
    >>> cfg = TrainConfig(optimizer="adamw", num_iterations=100, **{"adamw.lr": 0.003})
    >>> cfg.schedule.num_iterations, cfg.data.tokens_per_step, cfg.table(AdamWConfig).lr
    (100, 2048, 0.003)
    >>> TrainConfig(muon_lr=0.02)
    Traceback (most recent call last):
    ...
    ValueError: TrainConfig.muon_lr is now muon.lr
    >>> TrainConfig(run_id="a/b")
    Traceback (most recent call last):
    ...
    ValueError: TrainConfig.run_id (--run-id) must not contain a path separator, got 'a/b'
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nanoshampoo.errors import UserError  # noqa: F401 - re-exported: the trainer's modules raise it
from nanoshampoo.model.gpt import gpt_preset_names
from nanoshampoo.train.branches import branch_steps
from nanoshampoo.train.compile_choice import COMPILE_CHOICES
from nanoshampoo.train.setups import (
    SetupArguments,
    SetupSpec,
    get_setup,
    table_classes,
    table_name,
)
from nanoshampoo.train.setups.checks import check_value_type

DATASETS = ("embedded", "shards")
DEVICES = ("auto", "cpu", "cuda")
# How the model is spread over ranks: "ddp" replicates it (the trainer averages gradients);
# "fsdp2" shards every parameter over all ranks (``fully_shard``); "hsdp" shards within groups
# of ``hsdp_shard_size`` ranks and replicates across the groups (a 2-D mesh).
PARALLEL_MODES = ("ddp", "fsdp2", "hsdp")
AUTOCAST_CHOICES = ("auto", "bf16", "off")
Table = TypeVar("Table")

# Names that are no longer a config key or flag, and the keys that took their place: used only to
# say so in the one-line error a user who types the old name gets (a name that fed several
# setups names each of their fields). The flat hyper-parameter names from before the setup
# tables, the Shampoo distributor's settings from before ``[distributor]``, and a flag alias.
RENAMED: dict[str, tuple[str, ...]] = {
    "embed_lr": ("adam.embed_lr",),
    "head_lr": ("adam.head_lr",),
    "scalar_lr": ("adam.scalar_lr",),
    "adam_beta1": ("adam.beta1",),
    "adam_beta2": ("adam.beta2",),
    "adam_eps": ("adam.eps",),
    "matrix_lr": ("shampoo.lr", "adamw.lr"),
    "matrix_beta1": ("shampoo.beta1", "adamw.beta1"),
    "matrix_beta2": ("shampoo.beta2", "adamw.beta2"),
    "matrix_weight_decay": ("shampoo.weight_decay", "soap.weight_decay", "adamw.weight_decay"),
    "precondition_frequency": ("shampoo.precondition_frequency",),
    "shampoo_epsilon": ("shampoo.epsilon",),
    "grafting_beta2": ("shampoo.grafting_beta2",),
    "grafting_epsilon": ("shampoo.grafting_epsilon",),
    "soap_lr": ("soap.lr",),
    "soap_beta1": ("soap.beta1",),
    "soap_beta2": ("soap.beta2",),
    "soap_epsilon": ("soap.epsilon",),
    "soap_precondition_frequency": ("soap.precondition_frequency",),
    "muon_lr": ("muon.lr",),
    "muon_momentum": ("muon.momentum",),
    "muon_weight_decay": ("muon.weight_decay",),
    "muon_ns_steps": ("muon.ns_steps",),
    **{
        name: (f"preconditioner.{name}",)
        for name in (
            "max_preconditioner_dim",
            "start_preconditioning_step",
            "factor_dtype",
            "amortize_roots",
            "momentum_dtype",
            "rank_deficient_stability",
            "eigenvalue_floor_rtol",
        )
    },
    **{
        name: (f"shampoo.{name}",)
        for name in (
            "root_dtype",
            "pack_factors",
            "grafting_dtype",
            "root_method",
            "warm_qr_tolerance",
            "warm_qr_max_iterations",
            "large_factor_dim",
            "large_factor_frequency_multiplier",
        )
    },
    "distributor": ("distributor.kind",),
    **{
        name: (f"distributor.{name}",)
        for name in ("communication_dtype", "communicate_params", "fsdp_assignment")
    },
    "autocast_bf16": ("autocast",),
}


def renamed_message(key: str, spelling: str = "key") -> str | None:
    """The one line for an old name (a key of ``RENAMED``) that names its new spelling as
    ``spelling`` says: ``"key"`` (``muon.lr``), ``"flag"`` (``--muon.lr``) or ``"preset"``
    (``[muon] lr``); None for any other name.

    Example:
        >>> renamed_message("muon_ns_steps", "flag")
        '--muon-ns-steps is now --muon.ns-steps'
    """
    if key not in RENAMED:
        return None
    new = RENAMED[key]
    if spelling == "flag":
        old = "--" + key.replace("_", "-")
        text = " or ".join(flag_of(k) for k in new)
    elif spelling == "preset":
        old = key
        text = " or ".join(f"[{k.replace('.', '] ', 1)}" if "." in k else k for k in new)
    else:
        old, text = key, " or ".join(new)
    hint = " (true: bf16, false: off)" if key == "autocast_bf16" else ""
    return f"{old} is now {text}{hint}"


def flag_of(key: str) -> str:
    """A config key's flag: ``num_iterations`` -> ``--num-iterations``, ``muon.ns_steps`` ->
    ``--muon.ns-steps`` (dashes for underscores, the table name kept as it is)."""
    table, dot, name = key.rpartition(".")
    return f"--{table}{dot}{name.replace('_', '-')}"


def _key(name: str) -> Any:
    """A section field whose flag and preset key is ``name`` rather than the field's own name
    (``ModelSettings.name`` is ``--model``)."""
    return {"key": name}


class _Section:
    """A run-level section: its ``__post_init__`` checks every field's type (``ValueError``
    naming ``TrainConfig.KEY``, the key a user types), then the section's own rules."""

    def _check_types(self) -> None:
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            key = f.metadata.get("key", f.name)
            check_run_value(f"TrainConfig.{key}", key, getattr(self, f.name))

    def _set(self, name: str, value: Any) -> None:
        # A frozen section normalises a value once, where it is built (a list becomes a tuple).
        object.__setattr__(self, name, value)


@dataclass(frozen=True)
class RunSettings(_Section):
    """What names the run, seeds it, and what it writes: ids, the out dir and resume point, log,
    checkpoint, telemetry and profile cadence, the progress bar, and how the source is kept."""

    # The preset the run was made from; a new run's id starts with it.
    preset: str = "tiny-shampoo"
    # "" makes a unique id; a resume without one continues the checkpoint's run (and its logs).
    run_id: str = ""
    seed: int = 0
    out_dir: str = "runs"
    resume: str = ""
    log_every: int = 10
    checkpoint_every: int = 0
    save_final_checkpoint: bool = True
    # > 0: stop after step S (and the decay branches that fork there) with a checkpoint of step
    # S and a "paused" record; --resume that checkpoint goes on. Successive halving pauses a
    # trial at each rung's fork this way (evidence/tune_halving.py).
    pause_at_step: int = 0
    # Steps between telemetry records (train/telemetry.py); -1: at each validation
    # (every val_every steps), 0: off.
    telemetry_every: int = -1
    # A directory for TensorBoard scalars (loss, lr, telemetry); "": none.
    tensorboard: str = ""
    progress: bool = True
    # false: the imported source is stored once, as OUT_DIR/sources/<sha256>.source, and the
    # text log names it; true: the log holds it (the self-contained log a record submission needs).
    embed_source: bool = False
    profile_steps: tuple[int, ...] = ()
    profile_dir: str = ""

    def __post_init__(self) -> None:
        self._check_types()
        self._set("profile_steps", tuple(self.profile_steps))
        for name in ("log_every", "checkpoint_every", "pause_at_step", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.telemetry_every < -1:
            raise ValueError(
                "TrainConfig.telemetry_every (--telemetry-every) must be >= 0, or -1 for every "
                f"validation, got {self.telemetry_every}"
            )
        if self.seed > MAX_SEED:
            raise ValueError(
                f"TrainConfig.seed (--seed) must be at most {MAX_SEED} (the random "
                f"generators' 64-bit seed), got {self.seed}"
            )
        check_run_id("TrainConfig.run_id (--run-id)", self.run_id)
        # A new run's id starts with the preset's name.
        check_run_id("TrainConfig.preset (--preset)", self.preset)
        if not self.out_dir:
            raise ValueError("TrainConfig.out_dir must not be empty")
        if any(s < 0 for s in self.profile_steps):
            raise ValueError(f"TrainConfig.profile_steps must be >= 0, got {self.profile_steps}")
        if self.profile_steps and not self.profile_dir:
            raise ValueError("TrainConfig.profile_dir is required when profile_steps is set")


@dataclass(frozen=True)
class ModelSettings(_Section):
    """Which GPT: a preset of ``nanoshampoo.model.gpt`` (``--model``), and whether its linear
    layers are the combined-weight kind."""

    name: str = field(default="tiny", metadata=_key("model"))
    combined_linear: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        _check_choice("model", self.name, tuple(gpt_preset_names()))


@dataclass(frozen=True)
class DataSettings(_Section):
    """Where the tokens come from and how many a step takes.

    ``dataset`` "embedded" prepares the packaged corpus into ``data_dir`` (idempotent);
    "shards" reads ``train_files`` / ``val_files`` (glob patterns) with the given ``vocab_size``
    (0: the embedded tokenizer's). ``batch_size`` counts sequences of ``seq_len`` tokens per
    optimizer step over all ranks together; it must divide by ``world_size * grad_accum_steps``
    (each rank runs ``grad_accum_steps`` micro-batches). A validation reads ``val_tokens``.
    """

    dataset: str = "embedded"
    data_dir: str = "data/embedded"
    train_files: str = ""
    val_files: str = ""
    vocab_size: int = 0
    seq_len: int = 128
    batch_size: int = 16
    grad_accum_steps: int = 1
    val_tokens: int = 32768

    def __post_init__(self) -> None:
        self._check_types()
        _check_choice("dataset", self.dataset, DATASETS)
        for name in ("seq_len", "batch_size", "grad_accum_steps", "val_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 0:
            raise ValueError(f"TrainConfig.vocab_size must be >= 0, got {self.vocab_size}")
        if self.dataset == "shards":
            for name in ("train_files", "val_files"):
                if not getattr(self, name):
                    raise ValueError(f"TrainConfig.{name} is required when dataset='shards'")
            if self.vocab_size < 1:
                raise ValueError("TrainConfig.vocab_size is required when dataset='shards'")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclass(frozen=True)
class ScheduleSettings(_Section):
    """How long the run is and how its learning rate moves; when it validates.

    Learning rates are the peak values; the schedule is constant, then a linear cooldown to 0
    over the last ``cooldown_frac`` of ``num_iterations``, after a linear warmup over the first
    ``warmup_steps`` steps (0: none, the speedrun's recipe). ``val_every`` steps between
    validations (0: only the last step).
    """

    num_iterations: int = 300
    cooldown_frac: float = 0.7
    warmup_steps: int = 0
    # Fractions b of num_iterations: each is also trained as the run of round(b * N) steps,
    # branched off this run where its cooldown starts (train/branches.py; docs/training.md
    # "Decay branches").
    decay_branches: tuple[float, ...] = ()
    val_every: int = 50

    def __post_init__(self) -> None:
        self._check_types()
        if self.num_iterations < 1:
            raise ValueError(f"TrainConfig.num_iterations must be >= 1, got {self.num_iterations}")
        for name in ("val_every", "warmup_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.cooldown_frac <= 1.0:
            raise ValueError(
                f"TrainConfig.cooldown_frac must be in [0, 1], got {self.cooldown_frac}"
            )
        self._check_decay_branches()

    def _check_decay_branches(self) -> None:
        """A tuple of fractions strictly in (0, 1), increasing, whose lengths round(b * N) are
        distinct and in [1, N) (``ValueError`` naming the field)."""
        fractions = tuple(self.decay_branches)
        self._set("decay_branches", fractions)
        label = "TrainConfig.decay_branches (--decay-branches)"
        if not all(0.0 < b < 1.0 for b in fractions):
            raise ValueError(
                f"{label} must be fractions strictly between 0 and 1, got {list(fractions)}"
            )
        if any(a >= b for a, b in zip(fractions, fractions[1:])):
            raise ValueError(f"{label} must be strictly increasing, got {list(fractions)}")
        lengths = [branch_steps(b, self.num_iterations) for b in fractions]
        if len(set(lengths)) < len(lengths) or not all(
            1 <= n < self.num_iterations for n in lengths
        ):
            raise ValueError(
                f"{label} {list(fractions)}: the branches' lengths round(b * N) at "
                f"--num-iterations {self.num_iterations} are {lengths}; they must "
                f"be distinct, at least 1 and below {self.num_iterations}"
            )


@dataclass(frozen=True)
class ParallelSettings(_Section):
    """Where and how the run executes: the device, how the model is spread over ranks, the CPU
    threads, compilation, autocast, and how long a collective waits for a peer.

    ``mode`` (``--parallel``, ``PARALLEL_MODES``): under fsdp2/hsdp a setup built on
    DistributedShampoo shards as its ``[distributor]`` table says, and the embed/head/scalars
    use AdamW (DistAdam does not apply to sharded parameters). ``hsdp_shard_size``: ranks per
    shard group under hsdp; 0: the local world size (shard within a node).
    """

    mode: str = field(default="ddp", metadata=_key("parallel"))
    hsdp_shard_size: int = 0
    device: str = "auto"
    # CPU threads per process; 0: the cores this process may run on, shared by its local ranks,
    # or 1 when a probe finds the cores busy (re-probed every 10 steps).
    threads: int = 0
    # torch.compile of the model: "true", "false", or "auto": where it was measured to pay for
    # its compilation within the run (train/compile_choice.py).
    compile: str = "auto"
    # "auto": bf16 on CUDA with bf16 support, or on a CPU where a probe finds bf16 matmuls faster.
    autocast: str = "auto"
    # Seconds a collective may wait for another rank before the run fails (a dead peer).
    dist_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        self._check_types()
        _check_choice("parallel", self.mode, PARALLEL_MODES)
        _check_choice("device", self.device, DEVICES)
        _check_choice("autocast", self.autocast, AUTOCAST_CHOICES)
        _check_choice("compile", self.compile, COMPILE_CHOICES)
        for name in ("threads", "hsdp_shard_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.threads > MAX_THREADS:
            raise ValueError(
                f"TrainConfig.threads (--threads) must be at most {MAX_THREADS}, got {self.threads}"
            )
        # A timeout beyond a day overflows the collectives' timer (and waits on a dead peer).
        if not 0 < self.dist_timeout_s <= 86400:
            raise ValueError(
                "TrainConfig.dist_timeout_s (--dist-timeout-s) must be in (0, 86400] "
                "seconds, got "
                f"{self.dist_timeout_s}"
            )
        if self.mode != "hsdp" and self.hsdp_shard_size:
            raise ValueError(
                "TrainConfig.hsdp_shard_size applies to parallel='hsdp' only, got "
                f"{self.hsdp_shard_size} with parallel={self.mode!r}"
            )


# TrainConfig's sections, in the order their keys are listed (``--help``, ``to_dict``).
SECTIONS: dict[str, type[_Section]] = {
    "run": RunSettings,
    "model": ModelSettings,
    "data": DataSettings,
    "schedule": ScheduleSettings,
    "parallel": ParallelSettings,
}


@dataclass(frozen=True)
class RunKey:
    """A run-level key as users spell it (``num_iterations``, ``--num-iterations``) and where
    ``TrainConfig`` holds it: ``section`` ("" for ``optimizer``, on the config itself) and the
    section's field ``name``; ``type`` is the field's annotation, resolved."""

    key: str
    section: str
    name: str
    type: Any
    default: Any

    def read(self, cfg: TrainConfig) -> Any:
        """The key's value in ``cfg``."""
        holder = getattr(cfg, self.section) if self.section else cfg
        return getattr(holder, self.name)


@functools.cache
def run_keys() -> dict[str, RunKey]:
    """Every run-level key (the flat spelling of presets, flags and ``to_dict``) -> where it
    lives: the sections' fields, in ``SECTIONS`` order, with ``optimizer`` after ``schedule``."""
    keys: dict[str, RunKey] = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f.metadata.get("key", f.name)
            keys[key] = RunKey(key, section, f.name, hints[f.name], f.default)
        if section == "schedule":
            keys["optimizer"] = RunKey("optimizer", "", "optimizer", str, DEFAULT_OPTIMIZER)
    return keys


DEFAULT_OPTIMIZER = "shampoo"


@dataclass(frozen=True, init=False)
class TrainConfig:
    """A run's settings, in sections by meaning, and the optimizer setup with its tables;
    defaults are the ``tiny-shampoo`` CPU run.

    - ``run`` (:class:`RunSettings`): identity, seed, outputs and their cadence;
    - ``model`` (:class:`ModelSettings`): which GPT;
    - ``data`` (:class:`DataSettings`): the corpus, batch and sequence shapes;
    - ``schedule`` (:class:`ScheduleSettings`): steps, learning-rate shape, validation cadence;
    - ``parallel`` (:class:`ParallelSettings`): device, ranks, threads, compile, autocast;
    - ``optimizer``: the registered setup; ``tables``: every registered table's instance
      (defaults where not given), read by class: ``cfg.table(MuonConfig)``;
      ``setup_arguments``: the optimizer arguments the setup's check built from its tables
      (:class:`SetupArguments`: the library's configs, built and validated once, here).

    The sections are Python's view only: keys stay flat for users (``num_iterations``,
    ``--num-iterations``, ``to_dict``), so construct with flat keyword arguments, and
    ``TABLE.FIELD`` (or ``TABLE={...}``, a table's fields, or ``TABLE=instance``) for the
    tables; ``TABLE.FIELD`` wins over ``TABLE={...}``. Each section validates its own fields
    once, where it is built; ``__post_init__`` checks only what spans sections.
    """

    run: RunSettings
    model: ModelSettings
    data: DataSettings
    schedule: ScheduleSettings
    parallel: ParallelSettings
    optimizer: str
    tables: dict[str, Any]
    # What the setup's check built from the tables (the optimizer's arguments), for its builder.
    setup_arguments: SetupArguments | None = field(compare=False)

    def __init__(self, **values: Any) -> None:
        flat, tables = split_values(values)
        keys = run_keys()
        for section, cls in SECTIONS.items():
            given = {keys[k].name: v for k, v in flat.items() if keys[k].section == section}
            object.__setattr__(self, section, cls(**given))
        optimizer = flat.get("optimizer", DEFAULT_OPTIMIZER)
        check_run_value("TrainConfig.optimizer", "optimizer", optimizer)
        object.__setattr__(self, "optimizer", optimizer)
        built = {}
        for name, cls in table_classes().items():
            given = tables.get(name, {})
            built[name] = given if isinstance(given, cls) else cls(**given)
        object.__setattr__(self, "tables", built)
        self.__post_init__()

    def __post_init__(self) -> None:
        """What spans sections: the setup's own checks (keeping what they build), the setup and
        the parallel mode, the profiled steps within the run."""
        spec = get_setup(self.optimizer)
        built = spec.check(self) if spec.check is not None else None
        object.__setattr__(self, "setup_arguments", built)
        self._check_parallel(spec)
        steps = self.schedule.num_iterations
        late = [s for s in self.run.profile_steps if s >= steps]
        if late:
            raise ValueError(
                f"TrainConfig.profile_steps (--profile-steps) {late}: the run's "
                f"steps are 0..{steps - 1} (--num-iterations "
                f"{steps}); these would never be profiled"
            )

    def _check_parallel(self, spec: SetupSpec) -> None:
        """A DistAdam setup runs under ddp only (``ValueError`` naming the field)."""
        mode = self.parallel.mode
        if mode != "ddp" and spec.uses_distadam:
            adamw_setup = self.optimizer.removesuffix("-distadam").replace("distadam", "adamw")
            raise ValueError(
                f"TrainConfig.optimizer {self.optimizer!r} uses DistAdam, which does not apply "
                f"under parallel={mode!r} (sharded parameters); use an AdamW setup "
                f"such as {adamw_setup!r}"
            )

    @property
    def setup(self) -> SetupSpec:
        """The registered setup that ``optimizer`` names."""
        return get_setup(self.optimizer)

    def table(self, cls: type[Table]) -> Table:
        """The run's instance of the hyper-parameter table ``cls`` (a registered table's
        dataclass: ``cfg.table(MuonConfig).lr``)."""
        return self.tables[table_name(cls)]

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-serialisable dict: the run keys, then ``TABLE.FIELD`` for every field of
        the tables the setup reads (tuples become lists). ``TrainConfig(**to_dict())`` rebuilds
        the config."""
        values = {key: k.read(self) for key, k in run_keys().items()}
        flat = flatten_tables(values | {name: self.tables[name] for name in self.setup.tables})
        return {key: list(v) if isinstance(v, tuple) else v for key, v in flat.items()}


def flatten_tables(values: Mapping[str, Any]) -> dict[str, Any]:
    """``values`` with every table (a registered table's name holding a ``{field: value}`` dict
    or its dataclass instance) spelled as ``TABLE.FIELD`` keys, in order; other keys unchanged.
    The one place a table becomes flag-spelled keys (``to_dict``, ``--help``, compare).

    Example:
        >>> from nanoshampoo.train.setups.shampoo_family import MuonConfig
        >>> flatten_tables({"seed": 1, "muon": MuonConfig(lr=0.02), "adam": {"eps": 1e-8}})
        ... # doctest: +ELLIPSIS
        {'seed': 1, 'muon.lr': 0.02, 'muon.momentum': 0.95, ..., 'adam.eps': 1e-08}
    """
    tables = table_classes()
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if key in tables and dataclasses.is_dataclass(value):
            value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        if key in tables and isinstance(value, Mapping):
            flat.update({f"{key}.{name}": item for name, item in value.items()})
        else:
            flat[key] = value
    return flat


def check_run_value(label: str, key: str, value: Any) -> None:
    """``ValueError`` naming ``label`` unless ``value`` fits run key ``key``'s type; a boolean
    ``compile`` (its type before it took "auto") is told its spelling."""
    if key == "compile" and isinstance(value, bool):
        raise ValueError(
            f'{label} is "true", "false" or "auto" (a string), got {value!r}: '
            f'write "{str(value).lower()}"'
        )
    check_value_type(label, value, run_keys()[key].type)


def table_field_types() -> dict[str, dict[str, Any]]:
    """Table name -> {field name: annotation} of every registered table."""
    return {
        name: {f.name: f.type for f in dataclasses.fields(cls)}
        for name, cls in table_classes().items()
    }


def split_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword values -> (run keys, {table: {field: value}} or {table: instance}).

    Precedence: ``TABLE={...}``, then ``TABLE.FIELD``. ``ValueError`` naming every unknown
    key (one line naming the new spelling for an old name).
    """
    run_names = run_keys()
    tables = table_field_types()
    run: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    dotted, unknown = {}, []
    for key, value in values.items():
        if key in run_names:
            run[key] = value
        elif key == "tables":
            nested.update(value)
        elif key in tables and (
            isinstance(value, Mapping) or isinstance(value, table_classes()[key])
        ):
            nested[key] = value
        elif "." in key and key.split(".", 1)[0] in tables:
            dotted[key] = value
        else:
            unknown.append(key)
    for key in unknown:
        message = renamed_message(key)
        if message:
            raise ValueError(f"TrainConfig.{message}")
    if unknown:
        raise ValueError(f"TrainConfig has no fields {sorted(unknown)}")
    merged: dict[str, Any] = {}
    for table, given in nested.items():
        if isinstance(given, Mapping):
            merged.setdefault(table, {}).update(given)
        else:
            merged[table] = given  # an instance: taken as it is
    for key, value in dotted.items():
        table, name = key.split(".", 1)
        if name not in tables[table]:
            raise ValueError(
                f"TrainConfig has no fields [{key!r}]: table {table!r} has {sorted(tables[table])}"
            )
        if not isinstance(merged.get(table, {}), Mapping):
            merged[table] = dataclasses.asdict(merged[table])
        merged.setdefault(table, {})[name] = value
    for table, given in merged.items():
        if isinstance(given, Mapping):
            extra = sorted(set(given) - set(tables[table]))
            if extra:
                raise ValueError(f"TrainConfig has no fields {[f'{table}.{k}' for k in extra]}")
    return run, merged


# Largest seed: torch.manual_seed takes a 64-bit one (ranks and seeds add small offsets).
MAX_SEED = 2**63 - 1
# More intra-op threads than any CPU has cores only slows a run; a huge count exhausts memory
# creating their stacks (100000 did, on a 2-core machine).
MAX_THREADS = 1024
# Longest run id (or preset name, which a new run id starts with): file names get suffixes
# (``.ckpt/step_000000``, ``.compare.json``) and a file system allows 255 bytes.
MAX_ID_LENGTH = 100


def check_run_id(label: str, run_id: str) -> None:
    """A run id names files inside the out dir: no path separator, not ``.`` or ``..``, at most
    ``MAX_ID_LENGTH`` characters."""
    separators = {os.sep, os.altsep, "/", "\\"} - {None}
    if any(sep in run_id for sep in separators) or run_id in (".", ".."):
        raise ValueError(f"{label} must not contain a path separator, got {run_id!r}")
    if len(run_id) > MAX_ID_LENGTH:
        raise ValueError(
            f"{label} is too long: at most {MAX_ID_LENGTH} characters, got {len(run_id)}"
        )


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"TrainConfig.{name} must be one of {list(choices)}, got {value!r}")
