"""Probe verdicts are reused only for the same machine and probe, while fresh, and say so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nanoshampoo.train import probe_cache
from nanoshampoo.train.compile_choice import resolve_compile
from nanoshampoo.train.hardware import resolve_autocast
from nanoshampoo.train.probe_cache import MAX_AGE_S, ProbeCache, cache_path


class Probe:
    """A probe that counts its calls and answers ``verdict``."""

    def __init__(self, verdict: object) -> None:
        self.verdict, self.calls = verdict, 0

    def __call__(self) -> object:
        self.calls += 1
        return self.verdict


def test_a_saved_verdict_is_reused_by_the_next_run_and_named(tmp_path: Path) -> None:
    path, probe = tmp_path / "probes.json", Probe(2.5)
    assert ProbeCache(path).answer("q", {"shape": [1, 2]}, probe) == (2.5, "")
    assert not path.exists()  # nothing is written before save()
    first = ProbeCache(path, now=lambda: 1000.0)
    first.answer("q", {"shape": [1, 2]}, probe)
    first.save()
    verdict, note = ProbeCache(path, now=lambda: 1090.0).answer("q", {"shape": [1, 2]}, probe)
    assert (verdict, probe.calls) == (2.5, 2)
    assert note == f"cached in {path}, measured 90 s ago"


@pytest.mark.parametrize(
    ("settings", "machine", "age", "why"),
    [
        ({"shape": [2, 2]}, {}, 10.0, "for another machine or probe"),
        ({"shape": [1, 2]}, {"torch": "0.0.1"}, 10.0, "for another machine or probe"),
        ({"shape": [1, 2]}, {"cpu": "another CPU"}, 10.0, "for another machine or probe"),
        ({"shape": [1, 2]}, {}, MAX_AGE_S + 1.0, "was 24.0 h old"),
        ({"shape": [1, 2]}, {}, -5.0, "old"),  # from the future: a clock that went back
    ],
)
def test_a_foreign_or_stale_verdict_is_probed_again(
    tmp_path: Path, settings: dict[str, object], machine: dict[str, object], age: float, why: str
) -> None:
    path = tmp_path / "probes.json"
    stored = ProbeCache(path, now=lambda: 0.0)
    stored.machine = {**stored.machine, **machine}
    stored.answer("q", {"shape": [1, 2]}, Probe(1.0))
    stored.save()
    probe = Probe(3.0)
    cache = ProbeCache(path, now=lambda: age)
    verdict, note = cache.answer("q", settings, probe)
    assert (verdict, probe.calls) == (3.0, 1)
    assert note.startswith("probed; the verdict in") and why in note
    cache.save()  # the new verdict replaces the old one
    assert ProbeCache(path, now=lambda: age).answer("q", settings, Probe(9.0))[0] == 3.0


@pytest.mark.parametrize("text", ["{not json", '{"format": 99, "verdicts": {}}', "[1, 2]"])
def test_an_unreadable_file_is_named_and_replaced(tmp_path: Path, text: str) -> None:
    path = tmp_path / "probes.json"
    path.write_text(text)
    cache = ProbeCache(path)
    verdict, note = cache.answer("q", {}, Probe(None))
    assert verdict is None and note.startswith("probed; ") and str(path) in note
    cache.save()
    assert json.loads(path.read_text())["verdicts"]["q"]["verdict"] is None


def test_save_keeps_the_other_questions(tmp_path: Path) -> None:
    path = tmp_path / "probes.json"
    for question in ("a", "b"):
        cache = ProbeCache(path)
        cache.answer(question, {}, Probe(question))
        cache.save()
    assert sorted(json.loads(path.read_text())["verdicts"]) == ["a", "b"]
    assert [p.name for p in tmp_path.iterdir()] == ["probes.json"]  # no temporary left


def test_the_environment_names_a_shared_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(probe_cache.CACHE_VAR, raising=False)
    assert cache_path(tmp_path) == tmp_path / "probes.json"
    monkeypatch.setenv(probe_cache.CACHE_VAR, str(tmp_path / "study" / "probes.json"))
    assert cache_path(tmp_path / "run") == tmp_path / "study" / "probes.json"


def test_autocast_and_compile_reasons_say_where_the_verdict_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, cpu = tmp_path / "probes.json", torch.device("cpu")
    monkeypatch.setattr("nanoshampoo.train.hardware.probe_cpu_bf16_speedup", lambda: 0.25)
    monkeypatch.setattr("nanoshampoo.train.compile_choice.probe_inductor", lambda _: "no C++")
    first = ProbeCache(path)
    assert not resolve_autocast("auto", cpu, first).enabled
    assert not resolve_compile("auto", cpu, 1, 300, first).enabled
    first.save()
    monkeypatch.setattr("nanoshampoo.train.hardware.probe_cpu_bf16_speedup", lambda: 4.0)
    again = ProbeCache(path)
    autocast = resolve_autocast("auto", cpu, again)
    compiled = resolve_compile("auto", cpu, 1, 300, again)
    assert not autocast.enabled and f"cached in {path}" in autocast.reason
    assert "0.25x float32's speed" in autocast.reason
    assert compiled.reason.startswith("auto: off, inductor cannot compile here (no C++; probe ")
    assert f"cached in {path}" in compiled.reason
