"""The speedup that transfers: how many baseline tokens a setup's final loss is worth.

The input is final validation losses keyed by (setup, model size, budget D in training tokens,
seed), one :class:`Observation` each. A run that diverged or failed has a non-finite loss: it is
counted and left out of every mean, as in :mod:`nanoshampoo.evidence.stats`.

1. Baseline fit, per size (:func:`fit_power_law`): the baseline's seed-mean final losses
   L̄(D_j) at k >= 4 budgets are fit by least squares (``scipy.optimize.curve_fit``) with
   L(D) = a·D^(−α) + c, a > 0, α > 0, 0 <= c < min_j L̄(D_j). Each point keeps its residual
   L̄(D_j) − L(D_j).
2. Speedup (:func:`speedup_at`) of a setup whose mean final loss at budget D is ℓ: inside the
   fitted range L(D_max) <= ℓ <= L(D_min) the effective budget is D_eff = L⁻¹(ℓ) =
   (a/(ℓ − c))^(1/α) and the speedup is D_eff/D (kind ``"measured"``). Below L(D_max) only
   "> D_max/D" is known (``"above"``), above L(D_min) only "< D_min/D" (``"below"``); the
   curve's D_eff/D is kept as ``extrapolated`` but is never the value. A cell whose every seed
   diverged has kind ``"diverged"``.
3. Fit check (:func:`check_fit`): the lack-of-fit F-test. Each residual in standard errors of
   its mean, z_j = r_j / (s/√n_j) with s the seeds' pooled std, and F = Σ z_j² / (k − 3) on
   (k − 3, N − k) degrees of freedom with its p-value. A small p says the curve misses the
   points by more than the seeds' noise; the bootstrap below counts that noise only, not the
   power law's misfit.
4. Interval (:func:`estimate_speedups`): a percentile bootstrap over seeds. Each resample draws
   with replacement the baseline's seeds at every budget and each setup's seeds at each budget,
   refits the baseline and recomputes every speedup of that size. A resample's speedup beyond
   the fitted range is censored at the bound it crossed (D_max/D or D_min/D) and counted, so a
   percentile that lands on a bound is reported as one (``low_is_bound``/``high_is_bound``).

One-budget comparisons stay Welch's t-test (:func:`budget_comparisons`, through
:func:`nanoshampoo.evidence.stats.welch_compare`).

Example:
    >>> obs = [Observation("adamw", "s", d, 0, 0.5 * (d / 1e6) ** -0.4 + 3.0)
    ...        for d in (1_000_000, 2_000_000, 4_000_000, 8_000_000)]
    >>> fit = fit_baseline(obs, "adamw", "s")
    >>> round(fit.alpha, 6), round(fit.c, 6)
    (0.4, 3.0)
    >>> kind, value, _ = speedup_at(fit, fit.loss(4_000_000), 2_000_000)
    >>> kind, round(value, 9)
    ('measured', 2.0)
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import scipy.optimize
import scipy.stats

from nanoshampoo.evidence.stats import Comparison, welch_compare
from nanoshampoo.validation import is_int, is_real

MIN_BUDGETS = 4
DEFAULT_RESAMPLES = 1000
DEFAULT_CONFIDENCE = 0.95
# A loss within this relative distance of an end of the fitted range counts as inside it: at
# the ends the fitted curve and a noiseless baseline's own mean differ by rounding only.
_RANGE_RTOL = 1e-12
# The solver's stopping tolerances: tight enough that noiseless power-law data are fit to
# rounding, so the baseline's own points invert to its own budgets.
_TOLERANCE = 1e-14
# Floors tried for the starting point of the fit, as fractions of the smallest mean loss below it.
_FLOOR_GRID = 1.0 - np.geomspace(1e-3, 1.0, 40)

Kind = Literal["measured", "above", "below", "diverged"]


@dataclass(frozen=True)
class Observation:
    """One run's final validation loss: ``setup`` trained a ``size`` model on ``tokens`` tokens.

    ``loss`` is a finite number >= 0, or NaN/inf for a run that diverged or failed.
    """

    setup: str
    size: str
    tokens: int
    seed: int
    loss: float

    def __post_init__(self) -> None:
        for name in ("setup", "size"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"{name}: must be a non-empty string, got {value!r}")
        if not is_int(self.tokens) or self.tokens <= 0:
            raise ValueError(f"tokens: must be an int > 0, got {self.tokens!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed: must be an int, got {self.seed!r}")
        if not is_real(self.loss) or self.loss < 0:
            raise ValueError(
                f"loss: must be a number >= 0 (NaN or inf: diverged), got {self.loss!r}"
            )


@dataclass(frozen=True)
class CellLosses:
    """The runs of one (setup, size, budget): finite losses in seed order (float64), the rest
    counted in ``diverged``."""

    losses: np.ndarray
    diverged: int


Key = tuple[str, str, int]  # (setup, size, tokens)


def group_observations(observations: Sequence[Observation]) -> dict[Key, CellLosses]:
    """Observations by (setup, size, tokens), in the order cells first appear.

    ``ValueError`` naming the run when one (setup, size, tokens, seed) appears twice.
    """
    runs: dict[Key, dict[int, float]] = {}
    for obs in observations:
        seeds = runs.setdefault((obs.setup, obs.size, obs.tokens), {})
        if obs.seed in seeds:
            raise ValueError(
                f"observations: setup {obs.setup!r}, size {obs.size!r}, "
                f"{obs.tokens} tokens, seed {obs.seed} appears twice"
            )
        seeds[obs.seed] = float(obs.loss)
    cells = {}
    for key, seeds in runs.items():
        losses = np.array([seeds[s] for s in sorted(seeds)], dtype=np.float64)
        finite = np.isfinite(losses)
        cells[key] = CellLosses(losses=losses[finite], diverged=int((~finite).sum()))
    return cells


@dataclass(frozen=True)
class BaselineFit:
    """L(D) = a·D^(−α) + c fitted to one size's baseline mean losses.

    The curve is held as ``scale``·(D/``d_ref``)^(−``alpha``) + ``c`` with ``d_ref`` the
    smallest budget (so ``a = scale * d_ref**alpha``, kept in ``a``): ``scale`` is the loss
    above the floor at the smallest budget. ``tokens`` ascend; ``residuals[j] =
    mean_losses[j] − L(tokens[j])``; ``loss_range`` is (L(D_max), L(D_min)).
    """

    size: str
    tokens: tuple[int, ...]
    mean_losses: tuple[float, ...]
    d_ref: int
    scale: float
    alpha: float
    c: float
    a: float
    residuals: tuple[float, ...]
    loss_range: tuple[float, float]

    def loss(self, tokens: float | np.ndarray) -> float | np.ndarray:
        """L(D) at ``tokens`` (a number or a float64 array)."""
        return (
            self.scale * (np.asarray(tokens, dtype=np.float64) / self.d_ref) ** -self.alpha + self.c
        )

    def effective_tokens(self, loss: float) -> float:
        """L⁻¹(``loss``) = d_ref·(scale/(loss − c))^(1/α); ``inf`` at or below the floor ``c``."""
        if loss <= self.c:
            return math.inf
        return float(self.d_ref * (self.scale / (loss - self.c)) ** (1.0 / self.alpha))


def _power_law(x: np.ndarray, scale: float, alpha: float, c: float) -> np.ndarray:
    return scale * x**-alpha + c


def _power_law_jacobian(x: np.ndarray, scale: float, alpha: float, c: float) -> np.ndarray:
    """d/d(scale, α, c) of :func:`_power_law`, shape (len(x), 3)."""
    power = x**-alpha
    return np.stack([power, -scale * power * np.log(x), np.ones_like(x)], axis=1)


def _starting_point(x: np.ndarray, y: np.ndarray, size: str) -> tuple[float, float, float]:
    """(scale, α, c) with the least squared error among straight-line fits of log(y − c) on
    log x over a grid of floors c in [0, min y)."""
    best, best_error = None, math.inf
    for c in float(y.min()) * _FLOOR_GRID:
        slope, intercept = np.polyfit(np.log(x), np.log(y - c), 1)
        if slope >= 0:
            continue
        params = (math.exp(intercept), -slope, c)
        error = float(np.sum((_power_law(x, *params) - y) ** 2))
        if error < best_error:
            best, best_error = params, error
    if best is None:
        raise ValueError(
            f"size {size!r}: the baseline's mean losses do not fall with the budget; "
            "no power law with a > 0, alpha > 0 fits them"
        )
    return best


def fit_power_law(
    size: str,
    tokens: Sequence[int],
    mean_losses: Sequence[float],
    start: tuple[float, float, float] | None = None,
) -> BaselineFit:
    """Least-squares fit of L(D) = a·D^(−α) + c to ``mean_losses`` at ``tokens``.

    Bounds: a > 0, α > 0, 0 <= c < min(mean_losses) (a cross-entropy is >= 0, and without a
    floor c and α trade off without limit: c → −∞, α → 0 is a straight line in log D).
    ``start``: (scale, α, c) to start from (a resample starts from the point estimate); by
    default, or when it is outside the bounds, a grid over c picks it. ``ValueError`` naming
    ``size`` for fewer than ``MIN_BUDGETS`` budgets, repeated budgets, or a failed fit.
    """
    order = np.argsort(tokens)
    d = np.asarray(tokens, dtype=np.int64)[order]
    y = np.asarray(mean_losses, dtype=np.float64)[order]
    if d.size < MIN_BUDGETS:
        raise ValueError(
            f"size {size!r}: the baseline has {d.size} budgets; a power-law fit "
            f"needs at least {MIN_BUDGETS}"
        )
    if d[0] <= 0 or np.any(np.diff(d) == 0) or not np.all(np.isfinite(y)) or y.min() <= 0:
        raise ValueError(
            f"size {size!r}: budgets must be > 0 and differ, and mean losses be finite and > 0"
        )
    # D in units of the smallest budget: with raw token counts (1e6..1e10) a = scale·D_min^α is
    # astronomically large and its Jacobian column tiny, so the solver's steps and scaling are
    # ill-conditioned; with x = D/D_min in [1, D_max/D_min] scale is a loss gap of order c.
    x = d / d[0]
    floor = float(y.min())
    if start is None or not (start[0] > 0 and start[1] > 0 and 0 <= start[2] < floor):
        start = _starting_point(x, y, size)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", scipy.optimize.OptimizeWarning)
            params, _ = scipy.optimize.curve_fit(
                _power_law,
                x,
                y,
                p0=start,
                bounds=([0.0, 0.0, 0.0], [np.inf, np.inf, floor]),
                method="trf",
                jac=_power_law_jacobian,
                ftol=_TOLERANCE,
                xtol=_TOLERANCE,
                gtol=_TOLERANCE,
            )
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"size {size!r}: the power-law fit failed ({exc})") from exc
    scale, alpha, c = (float(p) for p in params)
    if not (
        math.isfinite(scale) and scale > 0 and math.isfinite(alpha) and alpha > 0 and c < floor
    ):
        raise ValueError(
            f"size {size!r}: the power-law fit failed (a = {scale:g}, "
            f"alpha = {alpha:g}, c = {c:g} reach a bound)"
        )
    fitted = _power_law(x, scale, alpha, c)
    return BaselineFit(
        size=size,
        tokens=tuple(int(t) for t in d),
        mean_losses=tuple(float(v) for v in y),
        d_ref=int(d[0]),
        scale=scale,
        alpha=alpha,
        c=c,
        a=scale * float(d[0]) ** alpha,
        residuals=tuple(float(r) for r in y - fitted),
        loss_range=(float(fitted[-1]), float(fitted[0])),
    )


def _baseline_cells(
    cells: dict[Key, CellLosses], baseline: str, size: str
) -> dict[int, CellLosses]:
    found = {t: cell for (s, z, t), cell in cells.items() if s == baseline and z == size}
    if not found:
        raise ValueError(f"size {size!r}: no runs of the baseline {baseline!r}")
    for tokens, cell in found.items():
        if not cell.losses.size:
            raise ValueError(
                f"size {size!r}: every run of the baseline {baseline!r} at {tokens} "
                "tokens diverged; there is no mean loss to fit"
            )
    return dict(sorted(found.items()))


@dataclass(frozen=True)
class FitCheck:
    """How well one size's baseline fit describes its own points, measured in seed noise.

    The lack-of-fit F-test of a curve fitted to replicated points: with ``n_j`` finite seeds at
    budget j, k budgets and ``N = Σ n_j`` runs, the pure-error variance is the seeds' pooled
    variance ``s² = Σ_j Σ_i (y_ij − ȳ_j)² / (N − k)``, ``standard_errors[j] = s/√n_j`` and
    ``z[j] = residuals[j] / standard_errors[j]``. ``f_statistic = Σ_j z_j² / (k − 3)`` (three
    fitted parameters) on ``dof = (k − 3, N − k)``, ``p_value`` its upper tail. Pooling over
    budgets, rather than one std per budget, is what keeps the test honest at three seeds: a
    3-seed std is too noisy to divide by. The statistic and its p are NaN (and ``z`` entries NaN)
    when s is not > 0 or either dof is 0. ``floor_on_bound``: the fitted floor c sits at its
    lower bound 0, so these budgets do not determine a floor and the fit is a pure power law.
    """

    size: str
    standard_errors: tuple[float, ...]
    z: tuple[float, ...]
    f_statistic: float
    dof: tuple[int, int]
    p_value: float
    floor_on_bound: bool


# c within this fraction of the smallest mean loss above 0 counts as on its bound (the solver
# stops at the bound up to its tolerance).
_FLOOR_BOUND_RTOL = 1e-6


def check_fit(fit: BaselineFit, cells: dict[int, CellLosses]) -> FitCheck:
    """:class:`FitCheck` of ``fit`` against the baseline's runs ``cells`` (keyed by tokens,
    the budgets of ``fit``)."""
    runs = [cells[tokens].losses for tokens in fit.tokens]
    dof = (len(runs) - 3, sum(r.size for r in runs) - len(runs))
    pure_error = math.fsum(float(((r - r.mean()) ** 2).sum()) for r in runs)
    sigma = math.sqrt(pure_error / dof[1]) if dof[1] > 0 else math.nan
    errors = tuple(sigma / math.sqrt(r.size) for r in runs)
    z = tuple(res / e if e > 0 else math.nan for res, e in zip(fit.residuals, errors))
    f_statistic, p_value = math.nan, math.nan
    if dof[0] > 0 and all(math.isfinite(v) for v in z):
        f_statistic = math.fsum(v * v for v in z) / dof[0]
        p_value = float(scipy.stats.f.sf(f_statistic, *dof))
    return FitCheck(
        size=fit.size,
        standard_errors=errors,
        z=z,
        f_statistic=f_statistic,
        dof=dof,
        p_value=p_value,
        floor_on_bound=fit.c <= _FLOOR_BOUND_RTOL * min(fit.mean_losses),
    )


def fit_baseline(observations: Sequence[Observation], baseline: str, size: str) -> BaselineFit:
    """:func:`fit_power_law` of ``baseline``'s seed-mean final losses at ``size``."""
    cells = _baseline_cells(group_observations(observations), baseline, size)
    return fit_power_law(size, list(cells), [float(c.losses.mean()) for c in cells.values()])


def speedup_at(fit: BaselineFit, loss: float, tokens: int) -> tuple[Kind, float, float]:
    """``(kind, value, extrapolated)`` of mean final loss ``loss`` reached in ``tokens`` tokens.

    ``measured``: value = L⁻¹(loss)/tokens (the ends of the fitted range included);
    ``above``: loss < L(D_max), value = D_max/tokens, a lower bound; ``below``: loss >
    L(D_min), value = D_min/tokens, an upper bound. ``extrapolated`` is L⁻¹(loss)/tokens
    in every case (``inf`` at or below the floor c).
    """
    low, high = fit.loss_range
    tolerance = _RANGE_RTOL * abs(high)
    extrapolated = fit.effective_tokens(loss) / tokens
    if loss < low - tolerance:
        return "above", fit.tokens[-1] / tokens, extrapolated
    if loss > high + tolerance:
        return "below", fit.tokens[0] / tokens, extrapolated
    return "measured", _censored(fit, loss, tokens), extrapolated


def _censored(fit: BaselineFit, loss: float, tokens: int) -> float:
    """L⁻¹(loss)/tokens clipped to the fitted range [D_min, D_max]/tokens."""
    return min(max(fit.effective_tokens(loss), fit.tokens[0]), fit.tokens[-1]) / tokens


@dataclass(frozen=True)
class SpeedupInterval:
    """Bootstrap percentile interval of one speedup at ``confidence``.

    Out of ``resamples`` refits that succeeded (``failed_fits`` did not and are left out),
    ``above``/``below`` fell beyond the fitted range and were censored at D_max/D or D_min/D.
    An end that lands on a censoring point is a bound, said by its kind as in
    :func:`speedup_at`: ``"below"`` (the true percentile is < D_min/D, the end shown),
    ``"above"`` (> D_max/D), else ``"measured"``.
    """

    low: float
    high: float
    low_kind: Kind
    high_kind: Kind
    confidence: float
    resamples: int
    above: int
    below: int
    failed_fits: int


@dataclass(frozen=True)
class Speedup:
    """The speedup of ``setup`` over the baseline at one ``size`` and budget ``tokens``.

    ``value``/``kind``/``extrapolated`` as :func:`speedup_at` gives them for ``loss``, the mean
    final loss of ``seeds`` finite runs (``diverged`` more were left out); kind ``"diverged"``
    (value and extrapolated NaN) when no run finished. ``interval`` is ``None`` without a
    bootstrap: resamples 0, or fewer than two finite seeds in this cell or at some budget of
    the baseline.
    """

    setup: str
    size: str
    tokens: int
    kind: Kind
    value: float
    extrapolated: float
    loss: float
    seeds: int
    diverged: int
    interval: SpeedupInterval | None


@dataclass(frozen=True)
class ScalingStudy:
    """Every size's baseline fit and every (setup, size, budget)'s speedup over ``baseline``.

    Sizes and setups keep the order in which they first appear in the observations; budgets
    ascend. ``seed`` seeds the one ``numpy.random.Generator`` behind every interval.
    ``fit_checks[i]`` is :func:`check_fit` of ``fits[i]``.
    """

    baseline: str
    fits: tuple[BaselineFit, ...]
    speedups: tuple[Speedup, ...]
    resamples: int
    confidence: float
    seed: int
    fit_checks: tuple[FitCheck, ...] = ()

    def fit(self, size: str) -> BaselineFit:
        """The baseline fit of ``size`` (``KeyError`` if there is none)."""
        for fit in self.fits:
            if fit.size == size:
                return fit
        raise KeyError(size)


def estimate_speedups(
    observations: Sequence[Observation],
    baseline: str,
    *,
    resamples: int = DEFAULT_RESAMPLES,
    confidence: float = DEFAULT_CONFIDENCE,
    seed: int = 0,
) -> ScalingStudy:
    """Fit the baseline at every size and estimate every other setup's speedups with intervals.

    The bootstrap draws from ``numpy.random.default_rng(seed)`` in a fixed order, so that a
    reference can replay it: sizes in order; per size, resamples in order; per resample, first
    the baseline's seed indices at each budget (ascending), ``rng.integers(0, n, n)`` for n
    finite seeds, then each setup's (setups in order, budgets ascending) for cells with at least
    two finite seeds. A size whose baseline has fewer than two finite seeds at some budget draws
    nothing and gets no intervals.
    """
    if not is_int(resamples) or resamples < 0:
        raise ValueError(f"resamples: must be an int >= 0, got {resamples!r}")
    if not (is_real(confidence) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence: must be in (0, 1), got {confidence!r}")
    cells = group_observations(observations)
    rng = np.random.default_rng(seed)
    fits, checks, speedups = [], [], []
    setups = list(dict.fromkeys(setup for setup, _, _ in cells))
    for size in dict.fromkeys(size for _, size, _ in cells):
        base = _baseline_cells(cells, baseline, size)
        fit = fit_power_law(size, list(base), [float(c.losses.mean()) for c in base.values()])
        fits.append(fit)
        checks.append(check_fit(fit, base))
        others = sorted(
            ((key, cell) for key, cell in cells.items() if key[1] == size and key[0] != baseline),
            key=lambda item: (setups.index(item[0][0]), item[0][2]),
        )
        intervals = _bootstrap(fit, base, others, resamples, confidence, rng)
        for (setup, _, tokens), cell in others:
            speedups.append(_speedup(fit, setup, tokens, cell, intervals.get((setup, tokens))))
    return ScalingStudy(
        baseline=baseline,
        fits=tuple(fits),
        speedups=tuple(speedups),
        resamples=resamples,
        confidence=float(confidence),
        seed=seed,
        fit_checks=tuple(checks),
    )


def _speedup(
    fit: BaselineFit, setup: str, tokens: int, cell: CellLosses, interval: SpeedupInterval | None
) -> Speedup:
    common = dict(
        setup=setup,
        size=fit.size,
        tokens=tokens,
        seeds=int(cell.losses.size),
        diverged=cell.diverged,
    )
    if not cell.losses.size:
        return Speedup(
            kind="diverged",
            value=math.nan,
            extrapolated=math.nan,
            loss=math.nan,
            interval=None,
            **common,
        )
    loss = float(cell.losses.mean())
    kind, value, extrapolated = speedup_at(fit, loss, tokens)
    return Speedup(
        kind=kind, value=value, extrapolated=extrapolated, loss=loss, interval=interval, **common
    )


def _bootstrap(
    fit: BaselineFit,
    base: dict[int, CellLosses],
    others: list[tuple[Key, CellLosses]],
    resamples: int,
    confidence: float,
    rng: np.random.Generator,
) -> dict[tuple[str, int], SpeedupInterval]:
    """Percentile intervals of the censored speedups of ``others`` (see the module docstring)."""
    if resamples == 0 or any(c.losses.size < 2 for c in base.values()):
        return {}
    drawn = [
        (setup, tokens, cell.losses) for (setup, _, tokens), cell in others if cell.losses.size >= 2
    ]
    values: list[list[float]] = [[] for _ in drawn]
    above, below = [0] * len(drawn), [0] * len(drawn)
    failed = 0
    start = (fit.scale, fit.alpha, fit.c)
    for _ in range(resamples):
        base_means = [_resampled_mean(c.losses, rng) for c in base.values()]
        means = [_resampled_mean(losses, rng) for _, _, losses in drawn]
        try:
            refit = fit_power_law(fit.size, fit.tokens, base_means, start=start)
        except ValueError:
            failed += 1
            continue
        for i, ((_, tokens, _), loss) in enumerate(zip(drawn, means)):
            kind, _, _ = speedup_at(refit, loss, tokens)
            above[i] += kind == "above"
            below[i] += kind == "below"
            values[i].append(_censored(refit, loss, tokens))
    tail = 50.0 * (1.0 - confidence)
    intervals = {}
    for i, (setup, tokens, _) in enumerate(drawn):
        if not values[i]:
            continue
        low, high = (float(v) for v in np.percentile(values[i], [tail, 100.0 - tail]))
        intervals[(setup, tokens)] = SpeedupInterval(
            low=low,
            high=high,
            low_kind=_end_kind(fit, low, tokens),
            high_kind=_end_kind(fit, high, tokens),
            confidence=confidence,
            resamples=len(values[i]),
            above=above[i],
            below=below[i],
            failed_fits=failed,
        )
    return intervals


def _end_kind(fit: BaselineFit, value: float, tokens: int) -> Kind:
    """Whether a percentile of censored speedups sits on a censoring point (the clipped values
    are those exact floats; one interpolated towards an uncensored value lies strictly inside)."""
    if value <= fit.tokens[0] / tokens:
        return "below"
    if value >= fit.tokens[-1] / tokens:
        return "above"
    return "measured"


def _resampled_mean(losses: np.ndarray, rng: np.random.Generator) -> float:
    return float(losses[rng.integers(0, losses.size, losses.size)].mean())


@dataclass(frozen=True)
class BudgetComparison:
    """Welch's comparison of one setup's final losses with the baseline's at one budget."""

    size: str
    tokens: int
    comparison: Comparison


def budget_comparisons(
    observations: Sequence[Observation], baseline: str, confidence: float = DEFAULT_CONFIDENCE
) -> tuple[BudgetComparison, ...]:
    """Every (setup, size, budget) the baseline also ran, compared by Welch's t-test on the
    finite final losses (``welch_compare``, metric ``"final_val_loss"``); cells where either
    side has no finished run are left out. In the order the cells first appear."""
    cells = group_observations(observations)
    found = []
    for (setup, size, tokens), cell in cells.items():
        base = cells.get((baseline, size, tokens))
        if setup == baseline or base is None or not base.losses.size or not cell.losses.size:
            continue
        comparison = welch_compare(
            "final_val_loss", (baseline, list(base.losses)), (setup, list(cell.losses)), confidence
        )
        found.append(BudgetComparison(size=size, tokens=tokens, comparison=comparison))
    return tuple(found)
