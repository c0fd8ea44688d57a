import io
import logging
from collections import namedtuple

import pytest
import torch

from nanoshampoo.optim.shampoo.utils.optimizer_modules import OptimizerModule

_Pair = namedtuple("_Pair", ["left", "right"])


class _Inner(OptimizerModule):
    def __init__(self) -> None:
        self.factor = torch.zeros(2, 2)
        self.count = 0


class _Outer(OptimizerModule):
    def __init__(self) -> None:
        self.weight = torch.zeros(3, requires_grad=True)
        self.inner = _Inner()
        self.by_index = {0: torch.zeros(1), 5: torch.zeros(2)}
        self.blocks = [torch.zeros(2), torch.zeros(4)]
        self.pair = _Pair(torch.zeros(1), torch.zeros(1))
        self.empty_list: list[torch.Tensor] = []
        self.empty_module = OptimizerModule()
        self.name = "outer"
        self.maybe: torch.Tensor | None = None


def _fill(module: _Outer, value: float) -> None:
    with torch.no_grad():
        for tensor in [module.weight, module.inner.factor, *module.by_index.values(),
                       *module.blocks, *module.pair]:  # fmt: skip
            tensor.fill_(value)
    module.inner.count = int(value)
    module.name = f"outer{value}"


def test_state_dict_layout_keeps_empty_modules_and_drops_empty_containers() -> None:
    module = _Outer()
    state = module.state_dict()
    # As the reference library: a module that holds nothing is still an entry, ``{}``.
    assert set(state) == {"weight", "inner", "by_index", "blocks", "pair", "empty_module"}
    assert state["empty_module"] == {}
    assert set(state["inner"]) == {"factor"}
    assert set(state["by_index"]) == {0, 5}
    assert set(state["blocks"]) == {0, 1}
    assert set(state["pair"]) == {0, 1}
    assert not state["weight"].requires_grad
    assert state["weight"].data_ptr() == module.weight.data_ptr()  # detached, not copied


def test_state_dict_keep_vars_and_non_tensors_and_destination() -> None:
    module = _Outer()
    destination: dict = {"already": 1}
    state = module.state_dict(destination=destination, keep_vars=True, store_non_tensors=True)
    assert state is destination and state["already"] == 1
    assert state["weight"] is module.weight
    assert state["name"] == "outer" and state["maybe"] is None and state["inner"]["count"] == 0
    assert "empty_list" not in state and state["empty_module"] == {}


def test_state_dict_keeps_an_empty_module_inside_a_list() -> None:
    module = OptimizerModule()
    module.items = [OptimizerModule(), torch.tensor(1.0), 3.0]  # type: ignore[attr-defined]
    module.only_numbers = (1.0, 2.0)  # type: ignore[attr-defined]
    assert module.state_dict() == {"items": {0: {}, 1: torch.tensor(1.0)}}


def test_sets_are_expanded_by_position() -> None:
    module = OptimizerModule()
    module.tags = {3}  # type: ignore[attr-defined]
    assert module.state_dict(store_non_tensors=True) == {"tags": {0: 3}}
    module.load_state_dict({"tags": {"0": 7}}, store_non_tensors=True)
    assert module.tags == {7}  # type: ignore[attr-defined]


def test_load_state_dict_restores_in_place() -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 2.0)
    blocks_list, factor = target.blocks, target.inner.factor
    target.load_state_dict(source.state_dict(store_non_tensors=True), store_non_tensors=True)
    assert target.blocks is blocks_list and target.inner.factor is factor
    assert torch.equal(factor, torch.full((2, 2), 2.0))
    assert torch.equal(target.by_index[5], torch.full((2,), 2.0))
    assert isinstance(target.pair, _Pair) and torch.equal(target.pair.right, torch.full((1,), 2.0))
    assert (target.name, target.inner.count) == ("outer2.0", 2)


def test_load_state_dict_without_non_tensors_leaves_them_alone() -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 3.0)
    target.load_state_dict(source.state_dict(store_non_tensors=True))
    assert torch.equal(target.weight, torch.full((3,), 3.0))
    assert (target.name, target.inner.count) == ("outer", 0)


def _stringify_keys(state: object) -> object:
    """What PyTorch's flattening / a JSON round trip does to container keys."""
    if isinstance(state, dict):
        return {str(k): _stringify_keys(v) for k, v in state.items()}
    return state


def test_load_state_dict_converts_string_keys_back_to_ints() -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 4.0)
    target.load_state_dict(_stringify_keys(source.state_dict()))  # type: ignore[arg-type]
    assert torch.equal(target.blocks[1], torch.full((4,), 4.0))
    assert torch.equal(target.by_index[0], torch.full((1,), 4.0))
    assert set(target.by_index) == {0, 5}


def test_round_trip_through_torch_save_weights_only() -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 5.0)
    buffer = io.BytesIO()
    torch.save(source.state_dict(store_non_tensors=True), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    target.load_state_dict(loaded, store_non_tensors=True)
    for mine, theirs in zip(
        [target.weight, target.inner.factor, *target.blocks, *target.by_index.values()],
        [source.weight, source.inner.factor, *source.blocks, *source.by_index.values()],
        strict=True,
    ):
        assert torch.equal(mine, theirs)
    assert target.name == "outer5.0"


@pytest.mark.parametrize(
    ("mutate", "kept"),
    [
        (lambda s: s.pop("weight"), lambda m: m.weight),
        (lambda s: s["inner"].pop("factor"), lambda m: m.inner.factor),
        (lambda s: s["by_index"].pop(5), lambda m: m.by_index[5]),
        (lambda s: s.pop("inner"), lambda m: m.inner.factor),
    ],
)
def test_load_state_dict_leaves_entries_the_state_dict_lacks(mutate, kept) -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 6.0)
    state = source.state_dict()
    mutate(state)
    target.load_state_dict(state)
    assert torch.equal(kept(target), torch.zeros_like(kept(target)))  # not loaded, untouched
    assert torch.equal(target.blocks[1], torch.full((4,), 6.0))  # everything else loaded


def test_load_state_dict_missing_sequence_element_raises_before_writing() -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 7.0)
    state = source.state_dict()
    state["blocks"].pop(1)
    with pytest.raises(KeyError, match=r"missing element 'blocks.1' in state_dict"):
        target.load_state_dict(state)
    assert torch.equal(target.weight, torch.zeros(3))  # validated first: nothing written


@pytest.mark.parametrize(
    "mutate",
    [
        lambda s: s.__setitem__("bias", torch.zeros(1)),
        lambda s: s["blocks"].__setitem__(2, torch.zeros(1)),
        lambda s: s["inner"].__setitem__("extra", torch.zeros(1)),
        lambda s: s.__setitem__("empty_list", {0: torch.zeros(1)}),
        lambda s: s["by_index"].__setitem__("x", torch.zeros(1)),
    ],
)
def test_load_state_dict_ignores_entries_the_module_lacks(mutate) -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 8.0)
    state = source.state_dict()
    mutate(state)
    target.load_state_dict(state)
    assert torch.equal(target.inner.factor, torch.full((2, 2), 8.0))
    assert target.empty_list == [] and set(target.by_index) == {0, 5} and len(target.blocks) == 2


def test_load_state_dict_restores_the_non_tensors_it_is_given() -> None:
    state = _Outer().state_dict()  # no non-tensors saved
    state["weight"] = torch.full((3,), 2.0)
    target = _Outer()
    target.load_state_dict(state, store_non_tensors=True)
    assert target.name == "outer" and target.inner.count == 0
    assert torch.equal(target.weight, torch.full((3,), 2.0))


@pytest.mark.parametrize(
    ("path", "replacement", "expected"),
    [
        ("weight", 3.0, "'weight': expected a tensor, got float"),
        ("blocks", torch.zeros(2), "'blocks': expected a mapping, got Tensor"),
        ("inner", torch.zeros(2), "'inner': expected a mapping, got Tensor"),
        ("name", 5, "'name': expected a str, got int"),
    ],
)
def test_load_state_dict_skips_values_of_the_wrong_kind_with_a_warning(
    path: str, replacement: object, expected: str, caplog: pytest.LogCaptureFixture
) -> None:
    source, target = _Outer(), _Outer()
    _fill(source, 9.0)
    state = source.state_dict(store_non_tensors=True)
    before = {"weight": target.weight.clone(), "blocks": [b.clone() for b in target.blocks]}
    state[path] = replacement
    with caplog.at_level(logging.WARNING):
        target.load_state_dict(state, store_non_tensors=True)
    assert expected in caplog.text and "keeping the current value" in caplog.text
    if path == "weight":
        assert torch.equal(target.weight, before["weight"])
    else:
        assert torch.equal(target.weight, torch.full((3,), 9.0))
    if path == "blocks":
        assert all(torch.equal(b, old) for b, old in zip(target.blocks, before["blocks"]))
    assert target.name == ("outer" if path == "name" else "outer9.0")


def test_load_state_dict_converts_the_dtype_like_copy() -> None:
    state = _Outer().state_dict()
    state["weight"] = torch.tensor([1.0, 2.0, 1.0 + 2**-30], dtype=torch.float64)
    target = _Outer()
    target.load_state_dict(state)
    assert target.weight.dtype == torch.float32
    assert torch.equal(target.weight, torch.tensor([1.0, 2.0, 1.0]))


def test_load_state_dict_shape_mismatch_raises_before_writing() -> None:
    state = _Outer().state_dict()
    state["inner"]["factor"] = torch.ones(2, 2)
    state["weight"] = torch.zeros(4)
    target = _Outer()
    with pytest.raises(
        ValueError, match=r"'weight': shape mismatch, module has \(3,\), state_dict has \(4,\)"
    ):
        target.load_state_dict(state)
    assert torch.equal(target.inner.factor, torch.zeros(2, 2))


class _WithStructure(OptimizerModule):
    non_state_attributes = frozenset({"cache", "layout"})

    def __init__(self) -> None:
        self.value = torch.zeros(2)
        self.cache = torch.ones(2)
        self.layout = "rows"


def test_non_state_attributes_are_neither_saved_nor_expected() -> None:
    module = _WithStructure()
    assert set(module.state_dict(store_non_tensors=True)) == {"value"}
    module.load_state_dict({"value": torch.full((2,), 3.0)}, store_non_tensors=True)
    assert torch.equal(module.value, torch.full((2,), 3.0)) and torch.equal(
        module.cache, torch.ones(2)
    )
    module.load_state_dict({"value": torch.zeros(2), "cache": torch.zeros(2)})
    assert torch.equal(module.value, torch.zeros(2)) and torch.equal(module.cache, torch.ones(2))
