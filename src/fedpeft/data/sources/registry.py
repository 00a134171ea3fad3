"""The source registry: ``data.source`` name -> the function that reads that source.

A source module registers its reader with :func:`source`; the package's ``__init__``
imports every source module, so the registry is full once ``fedpeft.data.sources`` is."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpeft.config import DataConfig
    from fedpeft.data.sources.build import Tables

Reader = Callable[["DataConfig"], "Tables"]

#: ``data.source`` -> its reader
SOURCES: dict[str, Reader] = {}


def source(name: str) -> Callable[[Reader], Reader]:
    """Register the decorated function as the reader of ``data.source: name``."""

    def register(read: Reader) -> Reader:
        if name in SOURCES:
            raise ValueError(f"data source {name!r} is registered twice")
        SOURCES[name] = read
        return read

    return register
