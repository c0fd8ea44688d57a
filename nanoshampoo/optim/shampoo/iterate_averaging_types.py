"""Configs of iterate averaging (``iterate_averaging_config``): classic momentum, GPA,
Schedule-Free.

Each applies after the search direction ``P`` of a block is formed (preconditioned, grafted,
decoupled decay added); the maths is in :mod:`~nanoshampoo.optim.shampoo.iterate_averaging`.

- :class:`ClassicMomentumConfig`: SGD momentum on ``P`` (``torch.optim.SGD``'s semantics); one
  sequence, no ``train()``/``eval()``.
- :class:`GeneralizedPrimalAveragingConfig` (GPA, arXiv 2512.17131) and
  :class:`ScheduleFreeConfig` (Defazio et al. 2024, "The Road Less Scheduled", arXiv 2405.15682):
  three sequences, ``z`` (plain steps), ``x`` (the average of ``z``: what is evaluated) and
  ``y = mu_y x + (1 - mu_y) z`` (where gradients are taken). The parameters hold ``y`` after
  ``optimizer.train()`` and ``x`` after ``optimizer.eval()``.

Names, defaults and bounds follow the well-known PyTorch Distributed Shampoo library; every
field is validated in ``__post_init__`` (``ValueError`` whose message starts with the field).

Example:
    >>> ClassicMomentumConfig(momentum=0.9, use_nesterov=True)
    ClassicMomentumConfig(momentum=0.9, dampening=0.0, use_nesterov=True)
    >>> GeneralizedPrimalAveragingConfig(eval_interp_coeff=1.0)
    Traceback (most recent call last):
    ...
    ValueError: Invalid self.eval_interp_coeff=1.0. Must be within [0.0, 1.0).
"""

from __future__ import annotations

from dataclasses import dataclass

from nanoshampoo.optim.shampoo.config_checks import check_bool, check_rule
from nanoshampoo.optim.shampoo.utils.abstract_dataclass import AbstractDataclass
from nanoshampoo.validation import check_float


def _check_train_interp_coeff(mu_y: object) -> None:
    check_rule(
        "train_interp_coeff",
        f"Invalid self.train_interp_coeff={mu_y!r}.",
        mu_y,
        "Must be within (0.0, 1.0].",
        lambda coefficient: 0.0 < coefficient <= 1.0,
    )


@dataclass(init=False)
class IterateAveragingConfig(AbstractDataclass):
    """Base of every ``iterate_averaging_config`` (abstract: build one of its subclasses).

    Momentum and GPA relate through the learning rate: heavy-ball momentum ``mu`` at ``lr``
    (:class:`ClassicMomentumConfig`) takes the same steps as GPA with ``eval_interp_coeff=mu``,
    ``train_interp_coeff=1.0`` at ``lr / (1 - mu)``, because GPA scales each step by
    ``1 - mu_x mu_y`` instead of accumulating it into a buffer that grows it by ``1 / (1 - mu)``.
    """


@dataclass(kw_only=True)
class ClassicMomentumConfig(IterateAveragingConfig):
    """SGD momentum on the search direction ``P``, then ``W <- W - lr P``::

        M <- momentum M + (1 - dampening) P
        P <- (1 - dampening) P + momentum M     (use_nesterov)
        P <- M                                  (otherwise)

    With ``dampening = 0`` this is ``torch.optim.SGD(momentum, nesterov)``; torch refuses
    Nesterov with dampening, which here scales both terms by ``1 - dampening``.

    Args:
        momentum: in (0.0, 1.0); 0 would do nothing: pass ``iterate_averaging_config=None``.
        dampening: in [0.0, 1.0).
        use_nesterov: Nesterov's look-ahead form.
    """

    momentum: float = 0.5
    dampening: float = 0.0
    use_nesterov: bool = False

    def __post_init__(self) -> None:
        check_rule(
            "momentum",
            f"Invalid self.momentum={self.momentum!r}.",
            self.momentum,
            "Must be within (0.0, 1.0).",
            lambda m: 0.0 < m < 1.0,
            hint="(0 would do nothing: pass iterate_averaging_config=None)",
        )
        check_rule(
            "dampening",
            f"Invalid self.dampening={self.dampening!r}.",
            self.dampening,
            "Must be within [0.0, 1.0).",
            lambda d: 0.0 <= d < 1.0,
        )
        check_bool("use_nesterov", self.use_nesterov)


@dataclass(kw_only=True)
class GeneralizedPrimalAveragingConfig(IterateAveragingConfig):
    """Generalized primal averaging with constant coefficients (arXiv 2512.17131)::

        z_{t+1} = z_t - lr P(y_t)
        x_{t+1} = mu_x x_t + (1 - mu_x) z_{t+1}
        y_{t+1} = mu_y x_{t+1} + (1 - mu_y) z_{t+1}

    ``mu_y = 1`` is heavy-ball momentum ``mu_x`` at ``lr (1 - mu_x)``; ``mu_y = mu_x`` is
    Nesterov's. Starts from ``x_1 = y_1 = z_1`` = the parameters at the first step.

    Args:
        eval_interp_coeff: ``mu_x``, in [0.0, 1.0) (the momentum, for momentum equivalence).
        train_interp_coeff: ``mu_y``, in (0.0, 1.0] (1.0 heavy-ball, ``mu_x`` Nesterov).
    """

    eval_interp_coeff: float = 0.9
    train_interp_coeff: float = 0.8

    def __post_init__(self) -> None:
        check_rule(
            "eval_interp_coeff",
            f"Invalid self.eval_interp_coeff={self.eval_interp_coeff!r}.",
            self.eval_interp_coeff,
            "Must be within [0.0, 1.0).",
            lambda mu_x: 0.0 <= mu_x < 1.0,
        )
        _check_train_interp_coeff(self.train_interp_coeff)


@dataclass(kw_only=True)
class ScheduleFreeConfig(IterateAveragingConfig):
    """Schedule-Free: primal averaging whose ``x`` is the lr-weighted average of all ``z``.

    The steps are GPA's (:class:`GeneralizedPrimalAveragingConfig`) with ``mu_y`` fixed and
    ``mu_x`` chosen at every step ``t`` from the learning rates so far (the weighting of
    equation (23) of arXiv 2405.15682, ``c_{t+1} = lr_t^r / sum_{i<=t} lr_i^r``)::

        mu_x(t) = 1 - lr_t^r / sum_{i=1..t} lr_i^r          (r = eval_coeff_lr_power)

    so that ``x_{t+1} = sum_i lr_i^r z_{i+1} / sum_i lr_i^r``. The weighting enters only the
    average, not the step: ``z`` still moves by ``lr_t P``. A step at ``lr = 0`` adds nothing
    to the average (and, with every lr so far 0, ``x`` stays where it is).

    Args:
        train_interp_coeff: ``mu_y`` (the paper's ``beta``), in (0.0, 1.0].
        eval_coeff_lr_power: ``r``, a finite number >= 0 (0: the uniform average of the ``z``).
    """

    train_interp_coeff: float = 0.8
    eval_coeff_lr_power: int = 2

    def __post_init__(self) -> None:
        _check_train_interp_coeff(self.train_interp_coeff)
        check_float("eval_coeff_lr_power", self.eval_coeff_lr_power, at_least=0.0)


PRIMAL_AVERAGING_CONFIG_TYPES = (GeneralizedPrimalAveragingConfig, ScheduleFreeConfig)
