"""Methods set on one model instance (`model.save_pretrained = ...`) that survive pickling.

hfquant gives the models it returns a few methods of their own (staged saving, the model card, parameter counts, peft
merges). A bound method (`types.MethodType`) pickles as `getattr(instance, function.__name__)`, which fails on an
unpickled model (`torch.save(model)`, multiprocessing): the instance has no attribute of that name. A
`functools.partial` over a module-level function pickles the function by name and the instance by reference, and
`copy.deepcopy` binds the copy's to the copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["bind", "is_bound"]


def bind(function: Callable, instance: Any) -> functools.partial:
    """`function` with `instance` as its first argument, to set as an attribute of `instance`."""
    return functools.partial(function, instance)


def is_bound(attribute: Any, function: Callable) -> bool:
    """Whether `attribute` (an instance's attribute) is `function` bound by `bind`."""
    return isinstance(attribute, functools.partial) and attribute.func is function
