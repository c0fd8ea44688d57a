"""``TrainConfig``: a training run's settings, and one hyper-parameter table per component.

A run is fully described by this config and the code (which the run log records verbatim).
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
    >>> cfg.tokens_per_step, cfg.table(AdamWConfig).lr, cfg.setup.rest
    (2048, 0.003, 'adamw')
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
import os
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from nanoshampoo.errors import UserError  # noqa: F401 - re-exported: the trainer's modules raise it
from nanoshampoo.model.gpt import gpt_preset_names
from nanoshampoo.train.branches import branch_steps
from nanoshampoo.train.compile_choice import COMPILE_CHOICES
from nanoshampoo.train.setups import SetupSpec, get_setup, table_classes, table_name
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


@dataclass(init=False)
class TrainConfig:
    """Run settings and the hyper-parameter tables; defaults are the ``tiny-shampoo`` CPU run.

    Learning rates are the peak values; the schedule is constant, then a linear cooldown to 0
    over the last ``cooldown_frac`` of ``num_iterations``, after a linear warmup over the first
    ``warmup_steps`` steps (0: none, the speedrun's recipe). ``batch_size`` counts sequences of
    ``seq_len`` tokens per optimizer step over all ranks together; it must divide by
    ``world_size * grad_accum_steps`` (each rank runs ``grad_accum_steps`` micro-batches).

    Construct with keyword arguments: the fields below, and ``TABLE.FIELD`` (or
    ``TABLE={...}``, a table's fields, or ``TABLE=instance``) for the tables; ``TABLE.FIELD``
    wins over ``TABLE={...}``.
    """

    preset: str = "tiny-shampoo"
    # --- model
    model: str = "tiny"
    combined_linear: bool = False
    # --- data: "embedded" prepares the packaged corpus into data_dir (idempotent);
    # "shards" reads train_files / val_files (glob patterns) with the given vocab_size.
    dataset: str = "embedded"
    data_dir: str = "data/embedded"
    train_files: str = ""
    val_files: str = ""
    vocab_size: int = 0
    seq_len: int = 128
    batch_size: int = 16
    grad_accum_steps: int = 1
    # --- schedule
    num_iterations: int = 300
    cooldown_frac: float = 0.7
    warmup_steps: int = 0
    # Fractions b of num_iterations: each is also trained as the run of round(b * N) steps,
    # branched off this run where its cooldown starts (train/branches.py; docs/training.md
    # "Decay branches").
    decay_branches: tuple[float, ...] = ()
    # --- the optimizer setup (a registered name); its hyper-parameters are in ``tables``.
    optimizer: str = "shampoo"
    # --- model parallelism (PARALLEL_MODES). Under fsdp2/hsdp a setup built on
    # DistributedShampoo shards as its ``[distributor]`` table says, and the embed/head/scalars
    # use AdamW (DistAdam does not apply to sharded parameters).
    parallel: str = "ddp"
    # Ranks per shard group under hsdp; 0: the local world size (shard within a node).
    hsdp_shard_size: int = 0
    # --- evaluation, logging, checkpoints
    val_every: int = 50
    # Steps between telemetry records (train/telemetry.py); -1: at each validation
    # (every val_every steps), 0: off.
    telemetry_every: int = -1
    # A directory for TensorBoard scalars (loss, lr, telemetry); "": none.
    tensorboard: str = ""
    val_tokens: int = 32768
    log_every: int = 10
    checkpoint_every: int = 0
    save_final_checkpoint: bool = True
    resume: str = ""
    out_dir: str = "runs"
    # "" makes a unique id; a resume without one continues the checkpoint's run (and its logs).
    run_id: str = ""
    seed: int = 0
    progress: bool = True
    # false: the imported source is stored once, as OUT_DIR/sources/<sha256>.source, and the
    # text log names it; true: the log holds it (the self-contained log a record submission needs).
    embed_source: bool = False
    # --- execution
    device: str = "auto"
    # "auto": bf16 on CUDA with bf16 support, or on a CPU where a probe finds bf16 matmuls faster.
    autocast: str = "auto"
    # CPU threads per process; 0: the cores this process may run on, shared by its local ranks,
    # or 1 when a probe finds the cores busy (re-probed every 10 steps).
    threads: int = 0
    # torch.compile of the model: "true", "false", or "auto": where it was measured to pay for
    # its compilation within the run (train/compile_choice.py).
    compile: str = "auto"
    # Seconds a collective may wait for another rank before the run fails (a dead peer).
    dist_timeout_s: float = 600.0
    profile_steps: tuple[int, ...] = ()
    profile_dir: str = ""
    # Table name -> its dataclass instance (every registered table; defaults where not given).
    tables: dict[str, Any] = field(default_factory=dict)

    def __init__(self, **values: Any) -> None:
        run, tables = split_values(values)
        for f in run_fields():
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            setattr(self, f.name, run.get(f.name, default))
        built = {}
        for name, cls in table_classes().items():
            given = tables.get(name, {})
            built[name] = given if isinstance(given, cls) else cls(**given)
        self.tables = built
        self.__post_init__()

    def __post_init__(self) -> None:
        # Long on purpose: the run's one validation pass, a check per field in field order, so
        # a bad config fails here, where it is built, and nowhere later.
        hints = typing.get_type_hints(TrainConfig)
        for f in run_fields():
            check_run_value(f"TrainConfig.{f.name}", f.name, getattr(self, f.name), hints)
        self.profile_steps = tuple(self.profile_steps)
        _check_choice("model", self.model, tuple(gpt_preset_names()))
        _check_choice("dataset", self.dataset, DATASETS)
        spec = get_setup(self.optimizer)
        _check_choice("device", self.device, DEVICES)
        _check_choice("autocast", self.autocast, AUTOCAST_CHOICES)
        _check_choice("compile", self.compile, COMPILE_CHOICES)
        _check_choice("parallel", self.parallel, PARALLEL_MODES)
        for name in ("seq_len", "batch_size", "grad_accum_steps", "num_iterations", "val_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "val_every",
            "log_every",
            "checkpoint_every",
            "seed",
            "vocab_size",
            "threads",
            "hsdp_shard_size",
            "warmup_steps",
        ):
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
        if self.threads > MAX_THREADS:
            raise ValueError(
                f"TrainConfig.threads (--threads) must be at most {MAX_THREADS}, got {self.threads}"
            )
        if not 0.0 <= self.cooldown_frac <= 1.0:
            raise ValueError(
                f"TrainConfig.cooldown_frac must be in [0, 1], got {self.cooldown_frac}"
            )
        # A timeout beyond a day overflows the collectives' timer (and waits on a dead peer).
        if not 0 < self.dist_timeout_s <= 86400:
            raise ValueError(
                "TrainConfig.dist_timeout_s (--dist-timeout-s) must be in (0, 86400] "
                "seconds, got "
                f"{self.dist_timeout_s}"
            )
        if spec.check is not None:
            spec.check(self)
        self._check_parallel(spec)
        if self.dataset == "shards":
            for name in ("train_files", "val_files"):
                if not getattr(self, name):
                    raise ValueError(f"TrainConfig.{name} is required when dataset='shards'")
            if self.vocab_size < 1:
                raise ValueError("TrainConfig.vocab_size is required when dataset='shards'")
        check_run_id("TrainConfig.run_id (--run-id)", self.run_id)
        # A new run's id starts with the preset's name.
        check_run_id("TrainConfig.preset (--preset)", self.preset)
        if not self.out_dir:
            raise ValueError("TrainConfig.out_dir must not be empty")
        if any(s < 0 for s in self.profile_steps):
            raise ValueError(f"TrainConfig.profile_steps must be >= 0, got {self.profile_steps}")
        late = [s for s in self.profile_steps if s >= self.num_iterations]
        if late:
            raise ValueError(
                f"TrainConfig.profile_steps (--profile-steps) {late}: the run's "
                f"steps are 0..{self.num_iterations - 1} (--num-iterations "
                f"{self.num_iterations}); these would never be profiled"
            )
        if self.profile_steps and not self.profile_dir:
            raise ValueError("TrainConfig.profile_dir is required when profile_steps is set")
        self._check_decay_branches()

    def _check_decay_branches(self) -> None:
        """A tuple of fractions strictly in (0, 1), increasing, whose lengths round(b * N) are
        distinct and in [1, N) (``ValueError`` naming the field)."""
        self.decay_branches = fractions = tuple(self.decay_branches)
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

    def _check_parallel(self, spec: SetupSpec) -> None:
        """The fields that only fit one parallel mode (``ValueError`` naming the field)."""
        if self.parallel != "hsdp" and self.hsdp_shard_size:
            raise ValueError(
                "TrainConfig.hsdp_shard_size applies to parallel='hsdp' only, got "
                f"{self.hsdp_shard_size} with parallel={self.parallel!r}"
            )
        if self.parallel == "ddp":
            return
        if spec.uses_distadam:
            adamw_setup = self.optimizer.removesuffix("-distadam").replace("distadam", "adamw")
            raise ValueError(
                f"TrainConfig.optimizer {self.optimizer!r} uses DistAdam, which does not apply "
                f"under parallel={self.parallel!r} (sharded parameters); use an AdamW setup "
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

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-serialisable dict: the run fields, then ``TABLE.FIELD`` for every field of
        the tables the setup reads (tuples become lists). ``TrainConfig(**to_dict())`` rebuilds
        the config."""
        values = {f.name: getattr(self, f.name) for f in run_fields()}
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


def check_run_value(label: str, name: str, value: Any, hints: Mapping[str, Any]) -> None:
    """``ValueError`` naming ``label`` unless ``value`` fits run field ``name``'s type; a
    boolean ``compile`` (its type before it took "auto") is told its spelling."""
    if name == "compile" and isinstance(value, bool):
        raise ValueError(
            f'{label} is "true", "false" or "auto" (a string), got {value!r}: '
            f'write "{str(value).lower()}"'
        )
    check_value_type(label, value, hints[name])


def run_fields() -> tuple[dataclasses.Field[Any], ...]:
    """``TrainConfig``'s run-level fields (every field but ``tables``)."""
    return tuple(f for f in dataclasses.fields(TrainConfig) if f.name != "tables")


def table_field_types() -> dict[str, dict[str, Any]]:
    """Table name -> {field name: annotation} of every registered table."""
    return {
        name: {f.name: f.type for f in dataclasses.fields(cls)}
        for name, cls in table_classes().items()
    }


def split_values(values: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Keyword values -> (run fields, {table: {field: value}} or {table: instance}).

    Precedence: ``TABLE={...}``, then ``TABLE.FIELD``. ``ValueError`` naming every unknown
    key (one line naming the new spelling for an old name).
    """
    run_names = {f.name for f in run_fields()}
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
