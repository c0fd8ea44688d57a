import pytest

from nanoshampoo.optim.shampoo.utils.dict_zip_iterator import DictZipIterator


def test_yields_one_dict_per_step_with_the_same_keys() -> None:
    data = {"grad": [1, 2, 3], "param": iter("abc"), "lr": (0.1, 0.01, 0.001)}
    assert list(DictZipIterator(data)) == [
        {"grad": 1, "param": "a", "lr": 0.1},
        {"grad": 2, "param": "b", "lr": 0.01},
        {"grad": 3, "param": "c", "lr": 0.001},
    ]


# Ids by hand: str() of the iterator holds its address, which differs between the processes
# of a parallel run (pytest-xdist then refuses the collection).
@pytest.mark.parametrize(
    "data",
    [{}, {"a": []}, {"a": [], "b": iter(())}],
    ids=["no-keys", "empty-list", "empty-list-and-iterator"],
)
def test_empty_inputs_yield_nothing(data: dict) -> None:
    assert list(DictZipIterator(data)) == []


def test_is_its_own_iterator_and_stays_exhausted() -> None:
    iterator = DictZipIterator({"a": [1]})
    assert iter(iterator) is iterator
    assert next(iterator) == {"a": 1}
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(iterator)


def test_partially_exhausted_names_exhausted_and_active_keys() -> None:
    iterator = DictZipIterator({"a": [1], "b": [1, 2], "c": [1], "d": [1, 2, 3]})
    assert next(iterator) == {"a": 1, "b": 1, "c": 1, "d": 1}
    with pytest.raises(
        ValueError,
        match=r"Iterators have different lengths\. Exhausted: \['a', 'c'\]\. "
        r"Still active: \['b', 'd'\]",
    ):
        next(iterator)
