"""Synthetic scaling studies for the scaling tests: losses from a known power law per size."""

from __future__ import annotations

import numpy as np

from nanoshampoo.evidence.scaling import Observation

# size -> (scale at the smallest budget, alpha, floor c, smallest budget)
LAWS = {"s": (1.0, 0.33, 2.95, 100_000_000), "m": (0.85, 0.35, 2.75, 300_000_000)}
# setup -> its true speedup (it reaches the baseline's loss at budget speedup * D)
SPEEDUPS = {"adamw": 1.0, "soap": 1.7, "muon": 2.6, "sgd": 0.45}
PARAMS = {"s": 20_000_000, "m": 60_000_000}


def true_loss(size: str, tokens: float) -> float:
    scale, alpha, c, d_ref = LAWS[size]
    return scale * (tokens / d_ref) ** -alpha + c


def study_observations(
    seeds: int = 4, noise: float = 3e-3, budgets: int = 5, rng_seed: int = 3
) -> list[Observation]:
    """Every setup of ``SPEEDUPS`` at every size of ``LAWS``, ``budgets`` doublings from the
    smallest budget, ``seeds`` runs each with Gaussian noise of std ``noise`` on the loss."""
    rng = np.random.default_rng(rng_seed)
    observations = []
    for size, (_, _, _, d_ref) in LAWS.items():
        for setup, speedup in SPEEDUPS.items():
            for k in range(budgets):
                tokens = d_ref * 2**k
                for seed in range(seeds):
                    loss = true_loss(size, speedup * tokens) + rng.normal(0.0, noise)
                    observations.append(Observation(setup, size, tokens, seed, loss))
    return observations
