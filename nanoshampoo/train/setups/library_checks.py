"""Ask the optimizer's own configs to validate a setup's values, and name the trainer's flag.

A setup that builds ``DistributedShampoo`` turns its tables into the library's config dataclasses
and group entries. Their rules (a storage dtype that cannot hold an EMA, a first root before the
precondition frequency, epsilons, betas, solver tolerances) live in the library, once; the
trainer checks them at config time by building those objects, and re-raises the library's
``ValueError`` with the trainer's field and flag in front::

    shampoo.grafting_dtype (--shampoo.grafting-dtype): AdamPreconditionerConfig.second_moment_dtype
    torch.bfloat16 cannot hold this EMA: ...

``labels`` map the library's field names (the first word of its message: ``"epsilon"``,
``"betas[0]"``) to the trainer's labels (``field_label``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any


def with_trainer_label(err: ValueError, owner: str, labels: Mapping[str, str]) -> ValueError:
    """``err`` (a library ``ValueError`` naming its field: ``config_checks.error_field``) re-made
    with the trainer label of that field in front, and ``owner`` before the library's field name
    (``"owner.field: <message>"`` where the message starts with the reference library's
    sentence). A field ``labels`` does not know is blamed on every trainer field that reaches
    ``owner``."""
    from nanoshampoo.optim.shampoo.config_checks import error_field

    message = str(err)
    name = error_field(err)
    label = labels.get(name) or labels.get(name.split("[", 1)[0])
    if label is None:
        label = ", ".join(dict.fromkeys(labels.values()))
    text = message if message.startswith(name) else f"{name}: {message}"
    # Keep the library's class (UnsupportedConfigError is a ValueError too).
    return type(err)(f"{label}: {owner}.{text}")


def library_config(cls: type, labels: Mapping[str, str], **kwargs: Any) -> Any:
    """``cls(**kwargs)``, a library config validated by its ``__post_init__``; its
    ``ValueError`` names the trainer field of the offending argument."""
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise with_trainer_label(err, cls.__name__, labels) from err


def check_shampoo_group(kwargs: Mapping[str, Any], labels: Mapping[str, str]) -> None:
    """Validate ``kwargs`` (``DistributedShampoo`` arguments, without the parameters) by the
    optimizer's own group rules: the group it would hold is the constructor's defaults with
    ``kwargs`` over them."""
    from nanoshampoo.optim.shampoo import DistributedShampoo
    from nanoshampoo.optim.shampoo.group_validation import (
        FIXED_GROUP_KEYS,
        STEP_GROUP_KEYS,
        validate_group,
    )

    parameters = inspect.signature(DistributedShampoo.__init__).parameters
    group = {
        name: parameters[name].default
        for name in (*FIXED_GROUP_KEYS, *STEP_GROUP_KEYS)
        if name in parameters
    }
    unknown = set(kwargs) - set(group)
    if unknown:
        raise TypeError(f"not DistributedShampoo group entries: {sorted(unknown)}")
    group.update(kwargs)
    # As add_param_group does: a group without its own peak_lr gets its lr.
    group.setdefault("peak_lr", group["lr"])
    try:
        validate_group(group)
    except ValueError as err:
        raise with_trainer_label(err, "DistributedShampoo", labels) from err
