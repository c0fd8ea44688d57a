"""Optimizer setups, registered by name (see ``registry``): ``adamw``, ``distadam``,
``shampoo``, ``soap``, ``muon`` (each also ``*-distadam``), ``normuon``, ``muon-cwd``,
``schedule-free`` (Schedule-Free AdamW), ``lion``, ``kl-shampoo`` and ``custom`` (a user's class).

Importing the package registers the built-in setups and their hyper-parameter tables.
"""

from nanoshampoo.train.setups import (  # noqa: F401 - registers
    adam,
    custom,
    kl_shampoo,
    muon_variants,
    schedule_free,
    shampoo_family,
    sign_descent,
)
from nanoshampoo.train.setups.registry import (
    BuildContext,
    OptimizerPart,
    SetupArguments,
    SetupInputs,
    SetupSpec,
    get_setup,
    register_setup,
    register_table,
    setup_names,
    table_classes,
    table_name,
)

__all__ = [
    "BuildContext",
    "OptimizerPart",
    "SetupArguments",
    "SetupInputs",
    "SetupSpec",
    "get_setup",
    "register_setup",
    "register_table",
    "setup_names",
    "table_classes",
    "table_name",
]
