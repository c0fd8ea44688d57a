import io
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


def test_state_dict_layout_drops_empty_and_non_tensors() -> None:
    module = _Outer()
    state = module.state_dict()
    assert set(state) == {"weight", "inner", "by_index", "blocks", "pair"}
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
    assert "empty_list" not in state and "empty_module" not in state


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
    ("mutate", "missing"),
    [
        (lambda s: s.pop("weight"), "weight"),
        (lambda s: s["inner"].pop("factor"), "inner.factor"),
        (lambda s: s["blocks"].pop(1), "blocks.1"),
        (lambda s: s["by_index"].pop(5), "by_index.5"),
    ],
)
def test_load_state_dict_missing_key_raises_key_error_naming_it(mutate, missing: str) -> None:
    state = _Outer().state_dict()
    mutate(state)
    with pytest.raises(KeyError, match=rf"missing key\(s\) \['{missing}'\]"):
        _Outer().load_state_dict(state)


@pytest.mark.parametrize(
    ("mutate", "unexpected"),
    [
        (lambda s: s.__setitem__("bias", torch.zeros(1)), "bias"),
        (lambda s: s["blocks"].__setitem__(2, torch.zeros(1)), "blocks.2"),
        (lambda s: s["inner"].__setitem__("extra", torch.zeros(1)), "inner.extra"),
        (lambda s: s.__setitem__("empty_list", {0: torch.zeros(1)}), "empty_list"),
        (lambda s: s["by_index"].__setitem__("x", torch.zeros(1)), "by_index.x"),
    ],
)
def test_load_state_dict_unexpected_key_raises_key_error_naming_it(mutate, unexpected: str) -> None:
    state = _Outer().state_dict()
    mutate(state)
    with pytest.raises(KeyError, match=rf"unexpected key '{unexpected}'"):
        _Outer().load_state_dict(state)


def test_load_state_dict_requires_non_tensors_when_asked() -> None:
    state = _Outer().state_dict()
    with pytest.raises(KeyError, match=r"missing key\(s\) \[.*'name'"):
        _Outer().load_state_dict(state, store_non_tensors=True)


@pytest.mark.parametrize(
    ("replacement", "message"),
    [
        (torch.zeros(4), r"'weight': shape mismatch, module has \(3,\), state_dict has \(4,\)"),
        (
            torch.zeros(3, dtype=torch.float64),
            r"'weight': dtype mismatch, module has torch.float32",
        ),
        (3.0, r"'weight': expected a tensor, got float"),
    ],
)
def test_load_state_dict_value_mismatch_raises_value_error(
    replacement: object, message: str
) -> None:
    state = _Outer().state_dict()
    state["weight"] = replacement
    with pytest.raises(ValueError, match=message):
        _Outer().load_state_dict(state)


def test_load_state_dict_container_given_a_tensor_raises_value_error() -> None:
    state = _Outer().state_dict()
    state["blocks"] = torch.zeros(2)
    with pytest.raises(ValueError, match=r"'blocks': expected a mapping, got Tensor"):
        _Outer().load_state_dict(state)


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
    with pytest.raises(KeyError, match="unexpected key 'cache'"):
        module.load_state_dict({"value": torch.zeros(2), "cache": torch.zeros(2)})
