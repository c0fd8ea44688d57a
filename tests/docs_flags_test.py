"""Every flag, ``nanoshampoo`` command and ``make`` target the documentation names exists.

The documentation is the README and every page under ``docs/``. Its commands are read from
fenced code blocks (a line ending in ``\\`` continues on the next) and inline code spans; a
flag outside code is read from the page's prose. Each flag is checked against the ``--help`` of
the command it belongs to:

- after ``python -m nanoshampoo.train``, ``nanoshampoo train`` or ``-m nanoshampoo.train``: the
  trainer's ``--help``; after ``nanoshampoo COMMAND``: that command's ``--help``; after a bare
  ``--`` (the training flags that ``compare``, ``tune``, ``repeat``, ``study`` and the bench
  scripts pass on) and inside a quoted value (``COMPARE_ARGS="--seed 1"``,
  ``--train-args "--threads 1"``): the trainer's;
- after ``bench/NAME.py``: the flags that script's parser declares (read from its source);
- after another program (``torchrun``, ``ruff``, ``pytest``, ``pip``, ``git``...): not checked,
  until a ``-m nanoshampoo...`` hands over to ours;
- a flag with no command before it (prose, ``--seed 3`` alone in a span): any ``nanoshampoo``
  command's ``--help``.

Only what ``--help`` lists counts: a hidden flag (argparse's ``SUPPRESS``: the flat aliases of
the table fields, the ``--TABLE.field_name`` spelling) and the retired spellings in
``RETIRED`` do not. ``nanoshampoo WORD`` in code must name a command, ``make WORD`` a Makefile
target.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import io
import re
import shlex
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = (
    "train",
    "prepare",
    "stats",
    "repeat",
    "compare",
    "tune",
    "study",
    "trace",
    "telemetry",
)
# Shown in --help as aliases of a newer spelling, which is the one the documentation uses.
RETIRED = {"--autocast-bf16"}
# Programs whose own flags the documentation may name; they are not ours to check.
EXTERNAL = {
    "torchrun",
    "ruff",
    "pytest",
    "pip",
    "git",
    "gh",
    "lscpu",
    "nvidia-smi",
    "time",
    "python",
    "python3",
    "uv",
    "tar",
    "curl",
    "wget",
    "ls",
    "du",
    "cat",
    "grep",
    "bash",
    "sh",
}
FLAG = re.compile(r"--[A-Za-z][\w.-]*")
BENCH = re.compile(r"(\./)?bench/[\w/-]+\.(py|sh)")
SPAN = re.compile(r"(``?)(.+?)\1", re.DOTALL)
ANY = "any nanoshampoo command"
TRAIN = "train"


@dataclass(frozen=True)
class Mention:
    """A flag (``--x``), command (``nanoshampoo x``) or target (``make x``) on a page's line."""

    page: str
    line: int
    kind: str  # "flag", "command" or "target"
    name: str
    context: str  # whose --help: a command, ANY, or "bench/NAME.py"

    def __str__(self) -> str:
        where = f"{self.page}:{self.line}"
        if self.kind == "flag":
            return f"{where}: {self.name} (checked against {self.context})"
        return f"{where}: {self.kind} {self.name!r}"


def _help_text(entry: Callable[[list[str]], object], argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        entry(argv)
    return out.getvalue()


@functools.cache
def command_flags() -> dict[str, frozenset[str]]:
    """Each ``nanoshampoo`` command's flags, as its ``--help`` prints them."""
    from nanoshampoo import cli
    from nanoshampoo.data import prepare
    from nanoshampoo.train import cli as train_cli

    texts = {TRAIN: _help_text(train_cli.main, ["--help"])}
    texts["prepare"] = _help_text(prepare.main, ["--help"])
    for command in COMMANDS[2:]:
        texts[command] = _help_text(cli.main, [command, "--help"])
    flags = {name: flags_in(text) - RETIRED for name, text in texts.items()}
    flags[ANY] = frozenset().union(*flags.values())
    return flags


def flags_in(text: str) -> frozenset[str]:
    return frozenset(m.group(0).rstrip(".-") for m in FLAG.finditer(text))


@functools.cache
def bench_flags(script: str) -> frozenset[str]:
    """The ``--flags`` a bench script's ``add_argument`` calls declare (empty: no such script)."""
    path = ROOT / script
    if not path.is_file():
        return frozenset()
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
            found.update(
                arg.value
                for arg in node.args
                if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")
            )
    return frozenset(found)


@functools.cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+)\s*:(?!=)", text, re.MULTILINE))
    for line in re.findall(r"^\.PHONY:(.*)$", text, re.MULTILINE):
        targets.update(line.split())
    return frozenset(targets)


def code_and_prose(markdown: str) -> Iterator[tuple[int, str, bool]]:
    """``(line number, text, is_code)``: each command of a code block (fenced: continued lines
    joined; or indented), each inline code span (which may cross a line break inside its
    paragraph), and each paragraph's prose outside its spans; ``(0, "", False)`` ends a
    paragraph or a block."""
    paragraph: list[tuple[int, str]] = []
    in_block = False
    pending: tuple[int, str] | None = None
    for number, line in enumerate([*markdown.splitlines(), ""], 1):
        if line.lstrip().startswith("```") or (not line.strip() and not in_block):
            yield from _paragraph(paragraph)
            yield 0, "", False
            paragraph = []
            if line.strip():
                in_block = not in_block
            continue
        if not in_block:
            paragraph.append((number, line))
            continue
        start, text = pending if pending else (number, "")
        text += " " + line.rstrip()
        if text.endswith("\\"):
            pending = (start, text[:-1])
            continue
        pending = None
        yield start, text, True


def _paragraph(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str, bool]]:
    if not lines:
        return
    if all(line.startswith("    ") for _, line in lines):  # an indented code block
        yield from ((number, line, True) for number, line in lines)
        return
    text = "\n".join(line for _, line in lines)
    first = lines[0][0]
    prose = text
    for match in SPAN.finditer(text):
        yield first + text.count("\n", 0, match.start()), match.group(2), True
        prose = prose.replace(match.group(0), " " * len(match.group(0)), 1)
    for offset, line in enumerate(prose.split("\n")):
        yield first + offset, line, False


def tokens(text: str) -> list[str]:
    try:
        return shlex.split(text, comments=False, posix=True)
    except ValueError:  # an unbalanced quote in prose
        return text.split()


def mentions_in(
    page: str, number: int, text: str, is_code: bool, default: str = ANY
) -> Iterator[Mention]:
    """The mentions of one code text or prose line; a flag with no command before it belongs
    to ``default``."""
    if not is_code:
        for flag in FLAG.finditer(text):
            yield Mention(page, number, "flag", _clean(flag.group(0)), default)
        return
    yield from _walk(page, number, tokens(text), default)


def _clean(flag: str) -> str:
    return flag.split("=", 1)[0].rstrip(".,;:)-")


def _walk(page: str, number: int, words: list[str], context: str) -> Iterator[Mention]:
    index = 0
    while index < len(words):
        word = words[index].strip("`'\"(),;")
        following = words[index + 1].strip("`'\",;:.()") if index + 1 < len(words) else ""
        if " " in words[index].strip() and context != "external":  # a quoted value: training flags
            value = re.sub(r"^\w+=", "", words[index].strip())  # COMPARE_ARGS="..."
            yield from _walk(page, number, value.split(), TRAIN)
        elif word in ("&&", "|", ";", "||"):
            context = ANY
        elif word == "--":
            context = TRAIN
        elif word in ("nanoshampoo.train", "nanoshampoo/train"):
            context = TRAIN
        elif words[index] == "nanoshampoo" and re.fullmatch(r"[a-z][a-z_-]*", following):
            yield Mention(page, number, "command", following, ANY)
            context = following if following in COMMANDS else ANY
            index += 1
        elif word == "make" and re.fullmatch(r"[a-z][\w-]*", following):
            yield Mention(page, number, "target", following, ANY)
            context = TRAIN  # make's variables hold training flags (COMPARE_ARGS=...)
            index += 1
        elif BENCH.fullmatch(word):
            context = word.removeprefix("./")
        elif word in EXTERNAL and context == ANY:
            context = "external"
        elif FLAG.fullmatch(_clean(word)) and word.startswith("--") and context != "external":
            yield Mention(page, number, "flag", _clean(word), context)
        index += 1


def documentation_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def page_mentions(page: Path) -> list[Mention]:
    """Every mention on ``page``. A flag with no command before it belongs to the last bench
    script its paragraph named before it, if any (``bench/x.py`` with ``--dtype bfloat16``),
    and must exist there or in a ``nanoshampoo`` command."""
    name = str(page.relative_to(ROOT))
    found: list[Mention] = []
    script = None
    for number, text, is_code in code_and_prose(page.read_text()):
        if number == 0:
            script = None
            continue
        default = ANY if script is None else f"{script} or {ANY}"
        found.extend(mentions_in(name, number, text, is_code, default))
        if is_code:
            named = [w.removeprefix("./") for w in tokens(text) if BENCH.fullmatch(w)]
            script = named[-1] if named else script
    return found


def exists(mention: Mention) -> bool:
    if mention.kind == "command":
        return mention.name in COMMANDS
    if mention.kind == "target":
        return mention.name in make_targets()
    script = mention.context.removesuffix(f" or {ANY}")
    if script.startswith("bench/"):
        if mention.name in bench_flags(script):
            return True
        if script == mention.context:
            return False
        script = ANY
    return mention.name in command_flags()[script]


@pytest.mark.parametrize("page", documentation_pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_command_and_target_the_documentation_names_exists(page: Path) -> None:
    assert [str(m) for m in page_mentions(page) if not exists(m)] == []


def test_the_help_lists_no_hidden_or_retired_flag() -> None:
    flags = command_flags()
    assert {"--seed", "--shampoo.epsilon", "--preconditioner.max-preconditioner-dim"} <= flags[
        TRAIN
    ]
    assert "--shampoo.root_method" not in flags[TRAIN]  # the hidden underscore spelling
    assert "--autocast-bf16" not in flags[ANY]
    assert {"--search", "--setup", "--trials"} <= flags["tune"]


def test_mentions_are_attributed_to_their_command(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Use `--seed 3` or --out-dir.\n\n"
        "```bash\n"
        "nanoshampoo compare --setups adamw --seeds 3 \\\n"
        "    -- --num-iterations 100\n"
        "torchrun --standalone --nproc_per_node=2 -m nanoshampoo.train --preset tiny-muon\n"
        'python bench/decay_branches.py --steps 8 --train-args "--threads 1"\n'
        'make compare COMPARE_ARGS="--muon-lr 0.1"\n'
        "nanoshampoo frobnicate\n"
        "```\n"
    )
    found = [
        (m.line, m.kind, m.name, m.context)
        for number, text, is_code in code_and_prose(page.read_text())
        for m in mentions_in("page.md", number, text, is_code)
    ]
    assert found == [
        (1, "flag", "--seed", ANY),
        (1, "flag", "--out-dir", ANY),
        (4, "command", "compare", ANY),
        (4, "flag", "--setups", "compare"),
        (4, "flag", "--seeds", "compare"),
        (4, "flag", "--num-iterations", TRAIN),
        (6, "flag", "--preset", TRAIN),
        (7, "flag", "--steps", "bench/decay_branches.py"),
        (7, "flag", "--train-args", "bench/decay_branches.py"),
        (7, "flag", "--threads", TRAIN),
        (8, "target", "compare", ANY),
        (8, "flag", "--muon-lr", TRAIN),
        (9, "command", "frobnicate", ANY),
    ]
    missing = [
        (m.name, m.context)
        for number, text, is_code in code_and_prose(page.read_text())
        for m in mentions_in("page.md", number, text, is_code)
        if not exists(m)
    ]
    assert missing == [("--muon-lr", TRAIN), ("frobnicate", ANY)]


def test_the_commands_checked_are_the_cli_s_commands() -> None:
    """A new ``nanoshampoo`` command is checked too: this list is the CLI's, in any order."""
    import argparse

    from nanoshampoo import cli

    parser = cli._parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert sorted(sub.choices) == sorted(COMMANDS)
