"""The method config registry: ``method.name`` -> the class that holds its options.

Each method's leaf module (``fedpeft.config.methods.<name>``) registers its class with
:func:`register_method_config`, as HF PEFT's tuners register with ``register_peft_method``.
Nothing imports those modules up front: the first lookup (:func:`method_configs`, which
validating an experiment config makes) imports the built-in ones named in
:data:`BUILTIN`, once; so ``import fedpeft.config`` stays a handful of pydantic classes.

A ``method`` key is validated by :data:`MethodOptions`: its ``name`` picks the class, an
unknown name is refused naming the known ones, and the value dumps as that class does.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, TypeVar, Union

from pydantic import BeforeValidator, Field, SerializeAsAny, TypeAdapter

from fedpeft.config.methods.base import MethodConfig

#: the built-in methods, each the name of its leaf module, in the order they are listed
#: (``fedpeft methods``, ``fedpeft.methods.REGISTRY``)
BUILTIN = (
    "fedft",
    "fedbf",
    "fedap",
    "fedlr",
    "prompt_tuning",
    "compacter",
    "adamix",
    "federa",
    "pf2lora",
    "perfedavg",
    "hetlora",
    "fedmcp",
    "fdlora",
    "c2a",
    "ditto",
    "moon",
    "fedrep",
    "fedrod",
    "fedamp",
    "fedkd",
    "local",
    "centralized",
    "ffalora",
    "fedsalora",
    "rolora",
    "fedexlora",
    "flexlora",
    "lorafair",
    "flora",
    "fedsb",
)

_registered: dict[str, type[MethodConfig]] = {}

Config = TypeVar("Config", bound=type[MethodConfig])


def register_method_config(name: str) -> Callable[[Config], Config]:
    """Class decorator: the class holds the options of ``method.name: <name>`` (its ``name``
    field is ``Literal[<name>]`` with that default)."""

    def register(cls: Config) -> Config:
        if cls.model_fields["name"].default != name:
            raise TypeError(f"{cls.__name__}: registered as {name!r}, but its name field defaults otherwise")
        if _registered.get(name, cls) is not cls:
            raise ValueError(f"method config {name!r}: {_registered[name].__name__} is registered already")
        _registered[name] = cls
        _options.cache_clear()
        return cls

    return register


def method_configs() -> dict[str, type[MethodConfig]]:
    """Every registered config class by method name: the built-in ones (imported on the first
    call) in :data:`BUILTIN`'s order, then any registered from elsewhere."""
    for name in BUILTIN:
        if name not in _registered:
            importlib.import_module(f"fedpeft.config.methods.{name}")
    return {**{name: _registered[name] for name in BUILTIN}, **_registered}


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
