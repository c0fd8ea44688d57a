"""``TrainConfig``: every knob of a training run, in one validated dataclass.

A run is fully described by this config and the code (which the run log records verbatim).
The defaults are the ``tiny-shampoo`` CPU run (tiny GPT on the embedded corpus, 300 steps);
presets (``nanoshampoo/train/presets/*.toml``) hold only what differs from them, and CLI flags
override the preset field by field.

Example:
    >>> cfg = TrainConfig(optimizer="adamw", num_iterations=100)
    >>> cfg.tokens_per_step, cfg.matrix_optimizer, cfg.small_params_optimizer
    (2048, 'adamw', 'adamw')
    >>> TrainConfig(run_id="a/b")
    Traceback (most recent call last):
    ...
    ValueError: TrainConfig.run_id must not contain a path separator, got 'a/b'
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch

from nanoshampoo.errors import UserError  # noqa: F401 - re-exported: the trainer's modules raise it
from nanoshampoo.model.gpt import gpt_preset_names

# Setup name -> (optimizer of the block matrices, optimizer of embed/head/scalars).
OPTIMIZER_SETUPS: dict[str, tuple[str, str]] = {
    "shampoo": ("shampoo", "adamw"),
    "soap": ("soap", "adamw"),
    "muon": ("muon", "adamw"),
    "adamw": ("adamw", "adamw"),
    "distadam": ("distadam", "distadam"),
    "shampoo-distadam": ("shampoo", "distadam"),
    "soap-distadam": ("soap", "distadam"),
    "muon-distadam": ("muon", "distadam"),
}
# The matrix optimizers that are ``DistributedShampoo`` with some preconditioner.
SHAMPOO_FAMILY = ("shampoo", "soap", "muon")
DATASETS = ("embedded", "shards")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTORS = ("auto", "single", "ddp")
# How the model is spread over ranks: "ddp" replicates it (the trainer averages gradients);
# "fsdp2" shards every parameter over all ranks (``fully_shard``); "hsdp" shards within groups
# of ``hsdp_shard_size`` ranks and replicates across the groups (a 2-D mesh).
PARALLEL_MODES = ("ddp", "fsdp2", "hsdp")
# FSDPParamAssignmentStrategy of the sharded Shampoo (see its docstring): "round_robin" and
# "replicate" are lossless, "default" preconditions each rank's shard on its own.
FSDP_ASSIGNMENTS = ("default", "round_robin", "replicate")
STORAGE_DTYPES = ("float32", "bfloat16")
AUTOCAST_CHOICES = ("auto", "bf16", "off")
RANK_DEFICIENT_STABILITY = ("perturbation", "pseudo-inverse")
ROOT_METHODS = ("eigh", "warm-qr")


@dataclass
class TrainConfig:
    """Hyper-parameters and run settings; defaults are the ``tiny-shampoo`` CPU run.

    Learning rates are the peak values; the schedule is constant, then a linear cooldown to 0
    over the last ``cooldown_frac`` of ``num_iterations``. ``batch_size`` counts sequences of
    ``seq_len`` tokens per optimizer step over all ranks together; it must divide by
    ``world_size * grad_accum_steps`` (each rank runs ``grad_accum_steps`` micro-batches).
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
    # --- optimizer setup (a key of OPTIMIZER_SETUPS) and its hyper-parameters
    optimizer: str = "shampoo"
    # AdamW (or DistAdam) for the embedding, the head and every 1-D parameter.
    embed_lr: float = 0.3
    head_lr: float = 1.0 / 320
    scalar_lr: float = 0.01
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    adam_eps: float = 1e-10
    # Block matrices (ndim >= 2) in the shampoo, adamw and distadam setups.
    matrix_lr: float = 0.0015
    matrix_beta1: float = 0.9
    matrix_beta2: float = 0.95
    matrix_weight_decay: float = 0.2
    # Shampoo (root-inverse, Adam grafting).
    precondition_frequency: int = 5
    shampoo_epsilon: float = 1e-12
    grafting_beta2: float = 0.95
    grafting_epsilon: float = 1e-10
    # SOAP (eigenvalue-corrected Shampoo, no grafting; its paper's betas, epsilon, frequency).
    soap_lr: float = 0.003
    soap_beta1: float = 0.95
    soap_beta2: float = 0.95
    soap_epsilon: float = 1e-8
    soap_precondition_frequency: int = 10
    # Muon (spectral descent by Newton-Schulz, Nesterov momentum, speedrun shape scaling).
    muon_lr: float = 0.05
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    muon_ns_steps: int = 5
    # Shared by the DistributedShampoo setups (shampoo, soap, muon).
    max_preconditioner_dim: int = 8192
    # -1: the first root is computed at step precondition_frequency (the library's rule).
    start_preconditioning_step: int = -1
    factor_dtype: str = "float32"
    # Step-speed and state-memory knobs of the shampoo-family setups (STORAGE_DTYPES; "float32"
    # keeps each state in the blocks' float32 computation dtype, as the optimizer's None does).
    # amortize_roots (shampoo, soap): a fixed share of the roots / eigenbases every step
    # instead of all of them every precondition frequency steps (no spike steps).
    amortize_roots: bool = False
    # Storage of shampoo's roots (inv_factor_matrix_dtype).
    root_dtype: str = "float32"
    # Shampoo's factors kept as lower triangles (pack_factor_matrices): half their bytes, the
    # same numbers.
    pack_factors: bool = False
    # Storage of shampoo's Adam-grafting second moment (its second_moment_dtype).
    grafting_dtype: str = "float32"
    # Storage of the filtered gradient and the momentum (shampoo, soap, muon).
    momentum_dtype: str = "float32"
    # Shampoo's roots (ROOT_METHODS): "eigh" every time, or "warm-qr": from the previous
    # eigenvectors, accepted within warm_qr_tolerance (estimated relative direction error)
    # after at most warm_qr_max_iterations QR iterations, else eigh (WarmStartedEigenConfig).
    root_method: str = "eigh"
    warm_qr_tolerance: float = 0.05
    warm_qr_max_iterations: int = 1
    # Shampoo's factors of at least large_factor_dim (0: off) get their root every
    # precondition_frequency * large_factor_frequency_multiplier steps.
    large_factor_dim: int = 0
    large_factor_frequency_multiplier: int = 1
    # Singular factors (shampoo, soap): "perturbation" adds epsilon (shampoo_epsilon /
    # soap_epsilon); "pseudo-inverse" drops numerically-zero eigenvalues (epsilon is then 0).
    rank_deficient_stability: str = "perturbation"
    # Eigenvalues below eigenvalue_floor_rtol * lambda_max count as rounding noise (shampoo, soap):
    # raised to it under "perturbation" (PerturbationConfig.eigenvalue_floor_rtol), dropped under
    # "pseudo-inverse" (its rank_rtol). -1: the optimizer's default, sqrt(n) * eps of the least
    # precise of the block and factor dtypes; 0: no floor.
    eigenvalue_floor_rtol: float = -1.0
    # "auto": DDP when world size > 1; "single": every rank computes every block.
    distributor: str = "auto"
    communication_dtype: str = "float32"
    communicate_params: bool = True
    # --- model parallelism (PARALLEL_MODES). Under fsdp2/hsdp the Shampoo-family matrix
    # optimizer shards with ``fsdp_assignment``, ``distributor`` must stay "auto", and the
    # embed/head/scalars use AdamW (DistAdam does not apply to sharded parameters).
    parallel: str = "ddp"
    fsdp_assignment: str = "round_robin"
    # Ranks per shard group under hsdp; 0: the local world size (shard within a node).
    hsdp_shard_size: int = 0
    # --- evaluation, logging, checkpoints
    val_every: int = 50
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
    # --- execution
    device: str = "auto"
    # "auto": bf16 on CUDA with bf16 support, or on a CPU where a probe finds bf16 matmuls faster.
    autocast: str = "auto"
    # CPU threads per process; 0: the cores this process may run on, shared by its local ranks,
    # or 1 when a probe finds the cores busy (re-probed every 10 steps).
    threads: int = 0
    compile: bool = False
    # Seconds a collective may wait for another rank before the run fails (a dead peer).
    dist_timeout_s: float = 600.0
    profile_steps: tuple[int, ...] = ()
    profile_dir: str = ""

    def __post_init__(self) -> None:
        self.profile_steps = tuple(self.profile_steps)
        _check_choice("model", self.model, tuple(gpt_preset_names()))
        _check_choice("dataset", self.dataset, DATASETS)
        _check_choice("optimizer", self.optimizer, tuple(OPTIMIZER_SETUPS))
        _check_choice("device", self.device, DEVICES)
        _check_choice("distributor", self.distributor, DISTRIBUTORS)
        _check_choice("factor_dtype", self.factor_dtype, STORAGE_DTYPES)
        _check_choice("communication_dtype", self.communication_dtype, STORAGE_DTYPES)
        for name in ("root_dtype", "grafting_dtype", "momentum_dtype"):
            _check_choice(name, getattr(self, name), STORAGE_DTYPES)
        _check_choice("root_method", self.root_method, ROOT_METHODS)
        _check_choice("autocast", self.autocast, AUTOCAST_CHOICES)
        _check_choice("parallel", self.parallel, PARALLEL_MODES)
        _check_choice("fsdp_assignment", self.fsdp_assignment, FSDP_ASSIGNMENTS)
        _check_choice("rank_deficient_stability", self.rank_deficient_stability,
                      RANK_DEFICIENT_STABILITY)
        for name in ("seq_len", "batch_size", "grad_accum_steps", "num_iterations", "val_tokens",
                     "max_preconditioner_dim", "precondition_frequency",
                     "soap_precondition_frequency", "muon_ns_steps",
                     "large_factor_frequency_multiplier"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("val_every", "log_every", "checkpoint_every", "seed", "vocab_size",
                     "threads", "hsdp_shard_size", "warm_qr_max_iterations", "large_factor_dim"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        # "not >= 0" also refuses NaN; inf stays allowed (a run that diverges at once).
        for name in ("embed_lr", "head_lr", "scalar_lr", "matrix_lr", "soap_lr", "muon_lr",
                     "adam_eps", "matrix_weight_decay", "muon_weight_decay", "grafting_epsilon",
                     "shampoo_epsilon", "soap_epsilon"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2", "matrix_beta1", "matrix_beta2", "grafting_beta2",
                     "soap_beta1", "soap_beta2", "muon_momentum"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if not (0.0 <= self.warm_qr_tolerance and math.isfinite(self.warm_qr_tolerance)):
            raise ValueError("TrainConfig.warm_qr_tolerance must be finite and >= 0, got "
                             f"{self.warm_qr_tolerance}")
        floor = self.eigenvalue_floor_rtol
        if not (floor == -1.0 or 0.0 <= floor < 1.0):
            raise ValueError("TrainConfig.eigenvalue_floor_rtol must be in [0, 1), or -1 for the "
                             f"optimizer's default, got {floor}")
        if not 0.0 <= self.cooldown_frac <= 1.0:
            raise ValueError(f"TrainConfig.cooldown_frac must be in [0, 1], got {self.cooldown_frac}")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"TrainConfig.dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        self._check_storage_dtypes()
        frequency = self.active_precondition_frequency
        if self.start_preconditioning_step != -1 and self.start_preconditioning_step < frequency:
            raise ValueError(
                "TrainConfig.start_preconditioning_step must be -1 or >= the precondition "
                f"frequency ({frequency}), got {self.start_preconditioning_step}"
            )
        self._check_parallel()
        if self.dataset == "shards":
            for name in ("train_files", "val_files"):
                if not getattr(self, name):
                    raise ValueError(f"TrainConfig.{name} is required when dataset='shards'")
            if self.vocab_size < 1:
                raise ValueError("TrainConfig.vocab_size is required when dataset='shards'")
        separators = {os.sep, os.altsep, "/", "\\"} - {None}
        if any(sep in self.run_id for sep in separators) or self.run_id in (".", ".."):
            raise ValueError(
                f"TrainConfig.run_id must not contain a path separator, got {self.run_id!r}")
        if not self.out_dir:
            raise ValueError("TrainConfig.out_dir must not be empty")
        if any(s < 0 for s in self.profile_steps):
            raise ValueError(f"TrainConfig.profile_steps must be >= 0, got {self.profile_steps}")
        if self.profile_steps and not self.profile_dir:
            raise ValueError("TrainConfig.profile_dir is required when profile_steps is set")

    def _check_storage_dtypes(self) -> None:
        """A narrow EMA stalls when its new-sample weight is below the dtype's epsilon (the
        optimizer refuses it too, naming its own field): name the TrainConfig field here."""
        momentum_beta = {"soap": self.soap_beta1, "muon": self.muon_momentum}.get(
            self.matrix_optimizer, self.matrix_beta1)
        for name, beta, beta_name in (("grafting_dtype", self.grafting_beta2, "grafting_beta2"),
                                      ("momentum_dtype", momentum_beta, "the matrix beta1")):
            dtype = getattr(self, name)
            eps = torch.finfo(getattr(torch, dtype)).eps
            if dtype != "float32" and beta > 0.0 and not 1.0 - beta >= eps:
                raise ValueError(
                    f"TrainConfig.{name} {dtype!r} cannot hold an EMA with {beta_name} {beta}: "
                    f"1 - beta must be >= {eps} (each step's change would round away)")

    def _check_parallel(self) -> None:
        """The fields that only fit one parallel mode (``ValueError`` naming the field)."""
        if self.parallel != "hsdp" and self.hsdp_shard_size:
            raise ValueError("TrainConfig.hsdp_shard_size applies to parallel='hsdp' only, got "
                             f"{self.hsdp_shard_size} with parallel={self.parallel!r}")
        if self.parallel == "ddp":
            return
        if "distadam" in OPTIMIZER_SETUPS[self.optimizer]:
            adamw_setup = self.optimizer.removesuffix("-distadam").replace("distadam", "adamw")
            raise ValueError(
                f"TrainConfig.optimizer {self.optimizer!r} uses DistAdam, which does not apply "
                f"under parallel={self.parallel!r} (sharded parameters); use an AdamW setup "
                f"such as {adamw_setup!r}")
        if self.distributor != "auto":
            raise ValueError(f"TrainConfig.distributor must be 'auto' under parallel="
                             f"{self.parallel!r} (the sharding decides), got {self.distributor!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def matrix_optimizer(self) -> str:
        """What updates the block matrices: ``shampoo``, ``soap``, ``muon``, ``adamw`` or
        ``distadam``."""
        return OPTIMIZER_SETUPS[self.optimizer][0]

    @property
    def small_params_optimizer(self) -> str:
        """What updates the embedding, the head and the 1-D parameters: ``adamw`` or ``distadam``."""
        return OPTIMIZER_SETUPS[self.optimizer][1]

    @property
    def active_precondition_frequency(self) -> int:
        """The precondition frequency the setup's matrix optimizer uses (1: every step)."""
        return {"shampoo": self.precondition_frequency,
                "soap": self.soap_precondition_frequency}.get(self.matrix_optimizer, 1)

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-serialisable dict (tuples become lists)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"TrainConfig.{name} must be one of {list(choices)}, got {value!r}")
