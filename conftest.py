"""Fixtures shared by test folders in different packages (pytest finds this file at the root).

Fixtures of one folder live in that folder's ``conftest.py`` (``docs/architecture.md``, "Tests").
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread() -> None:
    """torch on one intra-op thread: the tiny models of the training tests only contend for
    more. The setting outlives the test (torch has no scoped one). A test module asks for it
    with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    torch.set_num_threads(1)
