"""The leaderboard's readings of scale: the model's size and budget (non-embedding parameters,
tokens per parameter) and, from runs with decay branches, the final loss at each budget and each
setup's speedup off the baseline's fitted loss-versus-budget curve (the reading that a loss read
mid-run, inside the baseline's own decay, cannot give)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nanoshampoo.evidence.logs import RunRecord
from nanoshampoo.evidence.report import budget_rows
from nanoshampoo.evidence.scaling import Observation, ScalingStudy, estimate_speedups
from nanoshampoo.evidence.scaling_report import format_count, format_speedup
from nanoshampoo.evidence.stats import BudgetSummary
from nanoshampoo.evidence.tables import format_markdown_table


def model_scale(runs: Sequence[RunRecord]) -> str:
    """ "model tiny: 792k non-embedding parameters; 300 steps x 2048 tokens = 614k tokens, 0.78
    per parameter" for the first run whose log records its config; "" if none does."""
    config = next(
        (run.config for run in runs if {"model", "batch_size", "seq_len"} <= set(run.config)), None
    )
    if config is None:
        return ""
    from nanoshampoo.model.gpt import gpt_preset, non_embedding_parameters  # imports torch

    try:
        params = non_embedding_parameters(gpt_preset(str(config["model"]), vocab_size=1))
    except ValueError:  # a size this version does not know
        return ""
    steps = max(run.total_steps for run in runs)
    per_step = int(config["batch_size"]) * int(config["seq_len"])
    return (
        f"model {config['model']}: {format_count(params)} non-embedding parameters; {steps} "
        f"steps x {per_step} tokens = {format_count(steps * per_step)} tokens, "
        f"{steps * per_step / params:.2g} per parameter"
    )


# The leaderboard's one model size, as the scaling analysis names it.
FITTED_SIZE = "this model"


def fitted_speedups(
    groups: Mapping[str, Sequence[RunRecord]], baseline: str, setups: Sequence[str]
) -> tuple[ScalingStudy | None, str]:
    """Every setup's speedup off the baseline's fitted ``L(D)``, with budgets ``D`` in steps
    (the ratio ``D_eff / D`` has no unit), from the runs' decay branches and final losses.

    ``(None, "")`` when no run has branches; ``(None, why)`` when the baseline's runs give
    fewer than four budgets or its losses admit no fit."""
    found = [
        Observation(name, FITTED_SIZE, steps, 0 if run.seed is None else run.seed, loss)
        for name in setups
        for run in groups[name]
        for steps, loss in run.final_losses_by_steps().items()
    ]
    if not any(run.branches for name in setups for run in groups[name]):
        return None, ""
    budgets = {o.tokens for o in found if o.setup == baseline}
    if len(budgets) < 4:
        return None, (
            f"the baseline's runs give {len(budgets)} budget(s); the fit needs 4 "
            f"(--decay-branches with at least 3 fractions)"
        )
    try:
        return estimate_speedups(found, baseline), ""
    except ValueError as exc:
        return None, str(exc)


def budget_section(budgets: Sequence[tuple[str, tuple[BudgetSummary, ...]]]) -> list[str]:
    """``## Final val loss at each budget (decay branches)`` of ``(setup, its budgets)`` in
    the leaderboard's order (only when runs have branches)."""
    rows = [["setup", *row] for row in budget_rows((), "—")]
    for setup, summaries in budgets:
        rows += [[setup, *line] for line in budget_rows(summaries, "—")[1:]]
    if len(rows) == 1:
        return []
    return [
        "## Final val loss at each budget (decay branches)",
        "",
        *format_markdown_table(rows),
        "",
        "Mean ± std over seeds of the final val loss of each run's decay branch of that many steps "
        "(the run of that length, forked from the full run where its cooldown starts), and of "
        "the full runs at their own length; diverged branches are counted, not averaged.",
        "",
    ]


def fitted_section(baseline: str, study: ScalingStudy | None, note: str) -> list[str]:
    """``## Speedup off the baseline's fitted curve`` from ``fitted_speedups``' answer (only
    when the runs have branches)."""
    title = f"## Speedup off {baseline}'s fitted loss-versus-budget curve"
    if study is None:
        return [title, "", f"No fit: {note}.", ""] if note else []
    fit = study.fit(FITTED_SIZE)
    budgets = sorted({s.tokens for s in study.speedups})
    rows = [["setup", *[f"{steps} steps" for steps in budgets]]]
    for setup in dict.fromkeys(s.setup for s in study.speedups):
        cells = {s.tokens: format_speedup(s) for s in study.speedups if s.setup == setup}
        rows.append([setup, *[cells.get(steps, "—") for steps in budgets]])
    residuals = ", ".join(f"{r:+.4f}" for r in fit.residuals)
    return [
        title,
        "",
        *format_markdown_table(rows),
        "",
        f"{baseline}'s mean final losses at {', '.join(map(str, fit.tokens))} steps fitted "
        f"by L(D) = a·D^(−α) + c: α {fit.alpha:.4f}, c {fit.c:.4f}; residuals {residuals}. A "
        f"cell is the budget {baseline} would need to reach the setup's mean final loss "
        f"there, per budget given (D_eff / D), with a {100 * study.confidence:.0f}% bootstrap "
        f"interval over seeds ({study.resamples} resamples); a loss beyond the fitted range is "
        "a bound (> or <), its extrapolation labelled as one. Unlike steps to target, each "
        "reading compares complete, decayed runs.",
        "",
    ]
