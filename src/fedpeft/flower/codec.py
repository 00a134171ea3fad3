"""fedpeft's plain data in Flower records, and the size of what Flower puts on the wire.

Tensors travel as an :class:`~flwr.app.ArrayRecord` (numpy arrays, bit-exact), small
figures as a :class:`~flwr.app.MetricRecord`. A received tensor dict is checked against
the names, shapes and dtypes the receiver expects before anything uses it, so a
malformed or truncated reply is refused whole and never half-aggregated.
"""

from __future__ import annotations

import torch
from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedpeft.methods.base import Tensors


class ReplyError(ValueError):
    """A message whose content is not what the protocol says it must be."""


def to_record(tensors: Tensors) -> ArrayRecord:
    return ArrayRecord.from_torch_state_dict(tensors)


def from_record(record: ArrayRecord) -> Tensors:
    # clone: the arrays Flower decodes are read-only views of the message buffer
    return {k: v.clone() for k, v in record.to_torch_state_dict().items()}


def check_tensors(tensors: Tensors, like: Tensors, what: str) -> Tensors:
    """``tensors`` if it has exactly the names, shapes and dtypes of ``like`` and only
    finite values; otherwise :class:`ReplyError` naming the first difference."""
    if set(tensors) != set(like):
        missing, extra = sorted(set(like) - set(tensors)), sorted(set(tensors) - set(like))
        raise ReplyError(f"{what}: missing tensors {missing[:3]}, unexpected {extra[:3]}")
    for name, ref in like.items():
        got = tensors[name]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            raise ReplyError(
                f"{what}: tensor {name!r} is {got.dtype} {tuple(got.shape)}, "
                f"expected {ref.dtype} {tuple(ref.shape)}"
            )
        if got.is_floating_point() and not torch.isfinite(got).all():
            raise ReplyError(f"{what}: tensor {name!r} has non-finite values")
    return tensors


def to_metrics(figures: dict[str, float]) -> MetricRecord:
    return MetricRecord({k: float(v) for k, v in figures.items()})


def wire_bytes(message: Message | RecordDict) -> int:
    """Bytes Flower serialises for ``message``: the sum of its deflated objects (message,
    records, arrays, array chunks), each of which a node pushes or pulls separately."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
