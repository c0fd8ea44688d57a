"""Fixtures shared by test folders in different packages (pytest finds this file at the root).

Fixtures of one folder live in that folder's ``conftest.py`` (``docs/architecture.md``,
"Tests"). The trainer processes the tests start get the trainer's malloc settings from this
environment, so they run as they would after their re-exec (``nanoshampoo.train.allocator``)
without importing torch and the package a second time. Under pytest-xdist (``make test`` runs
the suite on one worker per core, a test file at a time) three more things hold: each worker's
torch uses its share of the cores, the embedded corpus is prepared once, and the files that cost
the most are handed out first.
"""

from __future__ import annotations

import fcntl
import os
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from nanoshampoo.train.allocator import TUNED_MALLOC_ENV


def pytest_configure(config: pytest.Config) -> None:
    for name, value in TUNED_MALLOC_ENV.items():  # the tests that re-exec remove them
        os.environ.setdefault(name, value)
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:  # a worker: its share of the cores, not all of them per worker
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // int(workers)))


# A test's estimated cost in units of a slow test: a slow or distributed test (a trained run, a
# gloo process group) takes seconds to minutes, any other test well under a second.
SLOW_COST, DISTRIBUTED_COST, QUICK_COST = 1.0, 1.0, 0.01


def estimated_cost(item: pytest.Item) -> float:
    """The estimated cost of one test, from its markers."""
    cost = SLOW_COST if item.get_closest_marker("slow") else QUICK_COST
    return cost + (DISTRIBUTED_COST if item.get_closest_marker("distributed") else 0.0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The test files in order of their estimated cost, the costliest first; the order within a
    file is kept. ``make test`` hands whole files to the workers in this order
    (``--dist loadfile --no-loadscope-reorder``), so that the longest files start first and the
    short ones fill the gaps, rather than a long file starting last and running alone."""
    file_cost: dict[Path, float] = defaultdict(float)
    for item in items:
        file_cost[item.path] += estimated_cost(item)
    items.sort(key=lambda item: -file_cost[item.path])  # stable: a file's tests stay in order


@pytest.fixture
def one_thread() -> None:
    """torch on one intra-op thread: the tiny models of the training tests only contend for
    more. The setting outlives the test (torch has no scoped one). A test module asks for it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def embedded_corpus_prepared_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Under pytest-xdist, the trainer's default ``--data-dir`` (``data/embedded``) prepared by
    one worker at a time before any test: two trainers preparing it at once would each swap
    their copy in under the other's reads. Once prepared, this is a hash check."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return
    from nanoshampoo.data.prepare import prepare_embedded

    # The workers' temporary directories share this parent.
    lock = tmp_path_factory.getbasetemp().parent / "embedded-corpus.lock"
    with lock.open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        prepare_embedded("data/embedded")
