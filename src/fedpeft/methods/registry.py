"""The method registry: ``method.name`` -> the class that runs it.

A method is registered once, by its class, with the config class that holds its options
(``@register_method(FedLRConfig)``, as HF PEFT's ``register_peft_method(name=...,
config_cls=..., model_cls=...)``): the decorator gives the class its ``name`` (the config's
``name`` field, written in the config's leaf alone) and its ``config_cls``. What else the
method is (its ``kind`` of trainable tensors, what it ``refuses``, whether it is
``pooled``) is its class's. :data:`REGISTRY`, ``fedpeft methods`` and every test's list of
methods are read from here; ``fedpeft.methods`` imports every module of its package, so a
new method is one module (and its config leaf) that registers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from fedpeft.config.methods.registry import method_configs

if TYPE_CHECKING:
    from fedpeft.config.methods.base import MethodConfig
    from fedpeft.methods.base import Method

#: method.name -> its class, in the order of the method configs (their ``order``:
#: ``fedpeft methods`` and the tables follow it), then any registered later
REGISTRY: dict[str, type[Method]] = {}

M = TypeVar("M", bound="type[Method]")


def register_method(config_cls: type[MethodConfig]) -> Callable[[M], M]:
    """Class decorator: the class runs ``method.name: <name>``, where ``<name>`` is
    ``config_cls``'s (a registered method config: :func:`fedpeft.config.methods.
    register_method_config`); it gets ``name`` and ``config_cls`` from here."""
    name = config_cls.model_fields["name"].default
    if method_configs().get(name) is not config_cls:
        raise ValueError(f"{config_cls.__name__} is not the registered config of a method {name!r}")

    def register(cls: M) -> M:
        if REGISTRY.get(name, cls) is not cls:
            raise ValueError(f"method {name!r}: {REGISTRY[name].__name__} is registered already")
        cls.name, cls.config_cls = name, config_cls
        REGISTRY[name] = cls
        return cls

    return register


def unregister_method(name: str) -> None:
    """Forget method ``name`` and its config (a method registered for a while: a test's)."""
    from fedpeft.config.methods import registry

    REGISTRY.pop(name, None)
    registry._registered.pop(name, None)
    registry._order.pop(name, None)
    registry._options.cache_clear()


def order_registry() -> None:
    """:data:`REGISTRY` in the order of the method configs; every built-in config (a leaf of
    ``fedpeft.config.methods``) has its method."""
    configs = method_configs()
    missing = [n for n, cls in configs.items() if n not in REGISTRY and cls.__module__.startswith("fedpeft.")]
    if missing:
        raise RuntimeError(f"method config(s) {missing} have no method registered (@register_method)")
    ordered = {n: REGISTRY[n] for n in configs if n in REGISTRY}
    ordered.update(REGISTRY)
    REGISTRY.clear()
    REGISTRY.update(ordered)
