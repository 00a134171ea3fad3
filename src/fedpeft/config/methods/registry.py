"""The method config registry: ``method.name`` -> the class that holds its options.

Each method's leaf module (``fedpeft.config.methods.<name>``) registers its class with
:func:`register_method_config`, as HF PEFT's tuners register with ``register_peft_method``.
Nothing imports those modules up front: the first lookup (:func:`method_configs`, which
validating an experiment config makes) imports every module of this package, once; so
``import fedpeft.config`` stays a handful of pydantic classes. A method's name is written
in its leaf alone (the decorator and the ``Literal``), with its place in the lists.

A ``method`` key is validated by :data:`MethodOptions`: its ``name`` picks the class, an
unknown name is refused naming the known ones, and the value dumps as that class does.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, TypeVar, Union

from pydantic import BeforeValidator, Field, SerializeAsAny, TypeAdapter

from fedpeft.config.methods.base import MethodConfig

_registered: dict[str, type[MethodConfig]] = {}
#: method name -> its place in the lists (``order``), of the methods that give one
_order: dict[str, int] = {}

Config = TypeVar("Config", bound=type[MethodConfig])


def register_method_config(name: str, *, order: int | None = None) -> Callable[[Config], Config]:
    """Class decorator: the class holds the options of ``method.name: <name>`` (its ``name``
    field is ``Literal[<name>]`` with that default). ``order``: its place in the lists of
    methods (``fedpeft methods``, the JSON schema, ``fedpeft.methods.REGISTRY``), before every
    method registered without one, which follow in the order they register."""

    def register(cls: Config) -> Config:
        if cls.model_fields["name"].default != name:
            raise TypeError(f"{cls.__name__}: registered as {name!r}, but its name field defaults otherwise")
        if _registered.get(name, cls) is not cls:
            raise ValueError(f"method config {name!r}: {_registered[name].__name__} is registered already")
        taken = [other for other, at in _order.items() if at == order and other != name]
        if order is not None and taken:
            raise ValueError(f"method config {name!r}: order {order} is {taken[0]!r}'s already")
        _registered[name] = cls
        if order is not None:
            _order[name] = order
        _options.cache_clear()
        return cls

    return register


@cache
def _import_leaves() -> None:
    """Import every module of this package, once: each leaf registers its method's config."""
    from fedpeft.config import methods

    for module in pkgutil.iter_modules(methods.__path__):
        importlib.import_module(f"{methods.__name__}.{module.name}")


def method_configs() -> dict[str, type[MethodConfig]]:
    """Every registered config class by method name: the built-in ones (the leaves of this
    package, imported on the first call) and any registered from elsewhere, those with an
    ``order`` by it, then the others as they registered."""
    _import_leaves()
    listed = sorted(_registered, key=lambda name: (name not in _order, _order.get(name, 0)))
    return {name: _registered[name] for name in listed}


def method_config_union() -> Any:
    """``Union`` of every method's config, for a ``method`` key discriminated by ``name``."""
    return Union[tuple(method_configs().values())]  # noqa: UP007


@cache
def _options() -> TypeAdapter:
    return TypeAdapter(Annotated[method_config_union(), Field(discriminator="name")])


def validate_method_config(value: Any) -> MethodConfig:
    """``value`` (a mapping with a ``name``, or a method config) as the config class its name
    registers; an unknown name is a validation error that names it and the known ones."""
    return _options().validate_python(value)


class _UnionSchema:
    """The JSON schema of a ``method`` key: the discriminated union of every method's config."""

    @classmethod
    def __get_pydantic_json_schema__(cls, _core_schema: Any, handler: Any) -> Any:
        return handler(_options().core_schema)


#: the type of a ``method`` key: validated as its method's config class (the registry is
#: read then, not when the field is declared), serialised as that class
MethodOptions = Annotated[SerializeAsAny[MethodConfig], BeforeValidator(validate_method_config), _UnionSchema]
