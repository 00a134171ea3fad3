"""fedpeft's plain data in Flower records, and the size of what Flower puts on the wire.

Tensors travel as an :class:`~flwr.app.ArrayRecord` of two arrays: every tensor's bytes
one after another (:data:`PACKED`), and an index of their names, dtypes and shapes
(:data:`INDEX`); bit-exact. One array per tensor would make each message as many Flower
objects, and a node pulls or pushes every object in a request of its own. Small figures
travel as a :class:`~flwr.app.MetricRecord`. A received tensor dict is checked against
the names, shapes and dtypes the receiver expects before anything uses it, so a
malformed or truncated reply is refused whole and never half-aggregated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedpeft.methods.base import Tensors

PACKED, INDEX = "packed", "index"


class ReplyError(ValueError):
    """A message whose content is not what the protocol says it must be."""


def to_record(tensors: Tensors) -> ArrayRecord:
    """``tensors`` as two arrays: their bytes, concatenated, and the index to cut them."""
    index, parts, offset = [], [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        index.append(
            [name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset, data.numel()]
        )
        parts.append(data)
        offset += data.numel()
    packed = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)
    meta = np.frombuffer(json.dumps(index).encode(), dtype=np.uint8)
    return ArrayRecord({PACKED: Array(packed.numpy()), INDEX: Array(meta.copy())})


def from_record(record: ArrayRecord) -> Tensors:
    """The tensors of :func:`to_record`'s record (copies: the arrays Flower decodes are
    read-only views of the message buffer); :class:`ReplyError` if it is not one."""
    if set(record) != {PACKED, INDEX}:
        raise ReplyError(f"a tensor record holds arrays {PACKED!r} and {INDEX!r}, not {sorted(record)[:4]}")
    packed = torch.from_numpy(record[PACKED].numpy().copy())
    try:
        index = json.loads(record[INDEX].numpy().tobytes())
        tensors = {}
        for name, dtype, shape, offset, size in index:
            if not (
                isinstance(getattr(torch, dtype, None), torch.dtype)
                and 0 <= offset <= offset + size <= len(packed)
            ):
                raise ReplyError(
                    f"tensor {name!r}: dtype {dtype!r}, bytes {offset}..{offset + size} of {len(packed)}"
                )
            tensors[name] = packed[offset : offset + size].clone().view(getattr(torch, dtype)).reshape(shape)
    except (ValueError, TypeError, RuntimeError) as err:  # JSON, unpacking, a size that is no shape
        raise ReplyError(f"a tensor record's index does not describe its bytes: {err}") from None
    return tensors


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


@dataclass(frozen=True)
class Orders:
    """What a training message tells its node besides the tensors: the round and, where
    the run has them, the round's clip bound (``privacy.mode``), its rate
    (``train.lr_schedule``), DP-SGD's noise multiplier (``privacy.mode sample``) and, with
    SCAFFOLD, the last round whose control update of this client the server applied."""

    round: int
    clip: float | None = None
    lr: float | None = None
    sigma: float | None = None
    control_applied: int | None = None

    #: the config keys they travel under (a node of another fedpeft version reads the same)
    KEYS = {"clip": "clip", "lr": "lr", "sigma": "dp_sigma", "control_applied": "control_applied"}

    def as_config(self) -> dict[str, int | float]:
        given = {key: getattr(self, field) for field, key in self.KEYS.items()}
        return {"round": self.round, **{k: v for k, v in given.items() if v is not None}}

    @classmethod
    def read(cls, config) -> Orders:
        """The orders in a message's config (a ConfigRecord or a legacy FitIns config)."""
        given = {field: config[key] for field, key in cls.KEYS.items() if key in config}
        applied = given.pop("control_applied", None)
        return cls(
            int(config["round"]),
            **{field: float(v) for field, v in given.items()},
            control_applied=None if applied is None else int(applied),
        )


def to_metrics(figures: dict[str, float]) -> MetricRecord:
    return MetricRecord({k: float(v) for k, v in figures.items()})


def wire_bytes(message: Message | RecordDict) -> int:
    """Bytes Flower serialises for ``message``: the sum of its deflated objects (message,
    records, arrays, array chunks), each of which a node pushes or pulls separately."""
    return sum(len(obj.deflate()) for obj in get_all_nested_objects(message).values())
