"""Every usage example in this layer's docstrings runs and prints what it claims."""

import doctest
import importlib

import pytest

_MODULES = [
    "abstract_dataclass",
    "commons",
    "dict_zip_iterator",
    "load_balancing_utils",
    "optimizer_modules",
    "param_redistribution",
    "shampoo_block_info",
    "shampoo_model_utils",
    "shampoo_quantization",
    "shampoo_state_dict_utils",
    "shampoo_utils",
]


@pytest.mark.parametrize("name", _MODULES)
def test_docstring_examples(name: str) -> None:
    module = importlib.import_module(f"nanoshampoo.optim.shampoo.utils.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed"
