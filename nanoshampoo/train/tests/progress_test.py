"""Progress off a terminal: one line per tenth of the run or per ``every_s`` seconds."""

from __future__ import annotations

import io

import pytest
from tqdm import tqdm

from nanoshampoo.train.progress import SparseProgress, progress_bar


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def steps_printed(text: str) -> list[int]:
    """The step of each progress line (``desc: step N/T ...``)."""
    return [int(line.split("step ")[1].split("/")[0]) for line in text.splitlines()]


def run(total: int, initial: int, steps: int, seconds_per_step: float, every_s: float) -> str:
    out, clock = io.StringIO(), FakeClock()
    bar = SparseProgress(total, initial, "run", out, every_s=every_s, clock=clock)
    for _ in range(steps):
        clock.now += seconds_per_step
        bar.update(1)
    bar.close()
    return out.getvalue()


@pytest.mark.parametrize(
    ("total", "initial", "steps", "seconds_per_step", "every_s", "expected"),
    [
        # Fast steps: one line at each tenth, none more at close.
        (300, 0, 300, 0.1, 60.0, list(range(30, 301, 30))),
        # A total that tenths do not divide: the line comes at the first step past each tenth.
        (25, 0, 25, 0.1, 60.0, [3, 5, 8, 10, 13, 15, 18, 20, 23, 25]),
        # Slow steps (25 s each, no tenth reached): a line once 60 s have passed since the last.
        (100, 0, 7, 25.0, 60.0, [3, 6, 7]),
        # A resumed run counts its tenths from the total; close prints where it stopped.
        (100, 55, 20, 0.1, 60.0, [60, 70, 75]),
        # Fewer steps than tenths: every step is a line.
        (3, 0, 3, 0.1, 60.0, [1, 2, 3]),
    ],
)
def test_lines_come_at_each_tenth_and_at_least_every_every_s(
    total: int,
    initial: int,
    steps: int,
    seconds_per_step: float,
    every_s: float,
    expected: list[int],
) -> None:
    assert steps_printed(run(total, initial, steps, seconds_per_step, every_s)) == expected


def test_a_line_says_where_the_run_is_and_how_long_is_left() -> None:
    out, clock = io.StringIO(), FakeClock()
    bar = SparseProgress(300, 0, "tiny-shampoo-s0", out, clock=clock)
    bar.set_postfix(loss="4.913", tok_s="6,021")
    for _ in range(30):
        clock.now += 0.5
        bar.update(1)
    # 30 steps in 15 s: 0.5 s a step, 270 steps (2 min 15 s) to go.
    assert out.getvalue() == (
        "tiny-shampoo-s0: step 30/300 (10%), 15.0s, 0.5 s/step, 2m15s left, "
        "loss=4.913 tok_s=6,021\n"
    )


def test_a_resumed_run_rates_only_its_own_steps() -> None:
    out, clock = io.StringIO(), FakeClock()
    bar = SparseProgress(100, 90, "", out, clock=clock)
    for _ in range(10):
        clock.now += 2.0
        bar.update(1)
    assert out.getvalue() == "step 100/100 (100%), 20.0s, 2 s/step\n"


def test_write_prints_the_line_on_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    bar = SparseProgress(10, 0, "run", io.StringIO())
    bar.write("step:0/10 val_loss:6.9000")
    assert capsys.readouterr().out == "step:0/10 val_loss:6.9000\n"


def test_the_bar_is_tqdms_on_a_terminal_and_lines_elsewhere() -> None:
    terminal, file = Terminal(), io.StringIO()
    assert isinstance(progress_bar(10, 0, True, "run", terminal), tqdm)
    assert isinstance(progress_bar(10, 0, True, "run", file), SparseProgress)
    disabled = progress_bar(10, 0, False, "run", file)
    assert disabled.disable
    disabled.update(10)
    disabled.close()
    assert file.getvalue() == ""
