"""``TrainConfig``: every knob of a training run, in one validated dataclass.

A run is fully described by this config and the code (which the run log records verbatim).
Presets (``nanoshampoo/train/presets/*.toml``) and CLI flags override its defaults field by field.

Example:
    >>> cfg = TrainConfig(optimizer="adamw", num_iterations=100)
    >>> cfg.tokens_per_step
    2048
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from nanoshampoo.model.gpt import gpt_preset_names

OPTIMIZER_SETUPS = ("shampoo", "adamw", "distadam", "shampoo-distadam")
DATASETS = ("embedded", "shards")
DEVICES = ("auto", "cpu", "cuda")
SHAMPOO_DISTRIBUTORS = ("auto", "single")


@dataclass
class TrainConfig:
    """Hyper-parameters and run settings; defaults are the ``tiny-shampoo`` CPU run.

    Learning rates are the peak values; the schedule is constant, then a linear cooldown to 0
    over the last ``cooldown_frac`` of ``num_iterations``. ``batch_size`` counts sequences of
    ``seq_len`` tokens over all ranks together and must divide by the world size.
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
    # --- schedule
    num_iterations: int = 300
    cooldown_frac: float = 0.7
    # --- optimizer setup and its hyper-parameters
    optimizer: str = "shampoo"
    # AdamW (or DistAdam) for the embedding, the head and every 1-D parameter.
    embed_lr: float = 0.3
    head_lr: float = 1.0 / 320
    scalar_lr: float = 0.01
    adam_beta1: float = 0.8
    adam_beta2: float = 0.95
    adam_eps: float = 1e-10
    # Block matrices (ndim >= 2): Shampoo, or AdamW in the "adamw"/"distadam" setups.
    matrix_lr: float = 0.0015
    matrix_beta1: float = 0.9
    matrix_beta2: float = 0.95
    matrix_weight_decay: float = 0.2
    # Shampoo only.
    max_preconditioner_dim: int = 8192
    precondition_frequency: int = 5
    start_preconditioning_step: int = -1
    grafting_beta2: float = 0.95
    grafting_epsilon: float = 1e-10
    shampoo_epsilon: float = 1e-12
    # "auto": the DDP distributor when world size > 1; "single": every rank computes every block.
    shampoo_distributor: str = "auto"
    # --- evaluation, logging, checkpoints
    val_every: int = 50
    val_tokens: int = 32768
    log_every: int = 10
    checkpoint_every: int = 0
    save_final_checkpoint: bool = True
    resume: str = ""
    out_dir: str = "runs"
    run_id: str = ""
    seed: int = 0
    progress: bool = True
    # --- execution
    device: str = "auto"
    autocast_bf16: bool = True
    compile: bool = False
    profile_steps: tuple[int, ...] = ()
    profile_dir: str = ""

    def __post_init__(self) -> None:
        self.profile_steps = tuple(self.profile_steps)
        _check_choice("model", self.model, tuple(gpt_preset_names()))
        _check_choice("dataset", self.dataset, DATASETS)
        _check_choice("optimizer", self.optimizer, OPTIMIZER_SETUPS)
        _check_choice("device", self.device, DEVICES)
        _check_choice("shampoo_distributor", self.shampoo_distributor, SHAMPOO_DISTRIBUTORS)
        for name in ("seq_len", "batch_size", "num_iterations", "val_tokens",
                     "max_preconditioner_dim", "precondition_frequency"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("val_every", "log_every", "checkpoint_every", "seed", "vocab_size"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("embed_lr", "head_lr", "scalar_lr", "matrix_lr", "adam_eps",
                     "matrix_weight_decay", "grafting_epsilon", "shampoo_epsilon"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainConfig.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2", "matrix_beta1", "matrix_beta2", "grafting_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"TrainConfig.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 <= self.cooldown_frac <= 1.0:
            raise ValueError(f"TrainConfig.cooldown_frac must be in [0, 1], got {self.cooldown_frac}")
        if self.start_preconditioning_step != -1 and (
            self.start_preconditioning_step < self.precondition_frequency
        ):
            raise ValueError(
                "TrainConfig.start_preconditioning_step must be -1 or >= precondition_frequency, "
                f"got {self.start_preconditioning_step}"
            )
        if self.dataset == "shards":
            for name in ("train_files", "val_files"):
                if not getattr(self, name):
                    raise ValueError(f"TrainConfig.{name} is required when dataset='shards'")
            if self.vocab_size < 1:
                raise ValueError("TrainConfig.vocab_size is required when dataset='shards'")
        if any(s < 0 for s in self.profile_steps):
            raise ValueError(f"TrainConfig.profile_steps must be >= 0, got {self.profile_steps}")
        if self.profile_steps and not self.profile_dir:
            raise ValueError("TrainConfig.profile_dir is required when profile_steps is set")

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict[str, object]:
        """Plain JSON-serialisable dict (tuples become lists)."""
        return {
            k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()
        }


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"TrainConfig.{name} must be one of {list(choices)}, got {value!r}")
