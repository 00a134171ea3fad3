"""fedpeft: federated, parameter-efficient fine-tuning of language models.

``fedpeft.load_export(path)`` loads what a run exported (``runs/<name>/adapter`` or a
client's ``adapter/clients/<cid>``) and predicts with it: :mod:`fedpeft.exported`.
Imported on first use, so that ``import fedpeft.<module>`` stays as light as it was.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fedpeft.exported import ExportedModel, ExportError, load_export

__all__ = ["ExportError", "ExportedModel", "load_export"]


def __getattr__(name: str):
    if name in __all__:
        from fedpeft import exported

        return getattr(exported, name)
    raise AttributeError(f"module 'fedpeft' has no attribute {name!r}")
