"""fedpeft's plain data in Flower records, and the size of what Flower puts on the wire.

Tensors travel as an :class:`~flwr.app.ArrayRecord` of two arrays: every tensor's bytes
one after another (:data:`PACKED`), and an index of their names, dtypes and shapes
(:data:`INDEX`); bit-exact. One array per tensor would make each message as many Flower
objects, and a node pulls or pushes every object in a request of its own. Small figures
travel as a :class:`~flwr.app.MetricRecord`. A received tensor dict is checked against
the names, shapes and dtypes the receiver expects before anything uses it, so a
malformed or truncated reply is refused whole and never half-aggregated. A record is
read without trusting what it claims: its arrays' headers are checked against the bytes
they carry (and against a size cap, when the receiver gives one) before anything is
copied, and each tensor's bytes are copied once, at the size its index says and the
packed bytes hold.
"""

from __future__ import annotations

import io
import json
import math
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


def npy_layout(data: bytes, what: str) -> tuple[np.dtype, tuple[int, ...], int]:
    """The dtype, shape and data offset that the ``.npy`` bytes ``data`` (how Flower
    carries an array) declare, read from their header alone; :class:`ReplyError` when the
    header is not one or its data are not exactly the declared size. ``np.load`` would
    allocate the declared size first, whatever the bytes hold."""
    buffer = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buffer)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(buffer)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(buffer)
        else:
            raise ValueError(f"npy version {version}")
    except (ValueError, TypeError, SyntaxError) as err:
        raise ReplyError(f"array {what!r}: not an npy array ({err})") from None
    offset = buffer.tell()
    if dtype.hasobject or fortran and len(shape) > 1:
        raise ReplyError(
            f"array {what!r}: dtype {dtype}{' in Fortran order' if fortran else ''} is not plain data"
        )
    declared = math.prod(shape) * dtype.itemsize
    if declared != len(data) - offset:
        raise ReplyError(
            f"array {what!r}: its header declares {declared} bytes, it holds {len(data) - offset}"
        )
    return dtype, tuple(shape), offset


def packed_bytes(array: Array, what: str, max_bytes: int | None = None) -> np.ndarray:
    """A tensor record's byte array as a read-only view of the message's own buffer (no
    copy): a one-dimensional uint8 array, at most ``max_bytes`` long (None: any length);
    :class:`ReplyError` otherwise."""
    if array.stype != "numpy.ndarray":
        raise ReplyError(f"array {what!r}: serialised as {array.stype!r}, not numpy.ndarray")
    if max_bytes is not None and len(array.data) > max_bytes + 1024:  # before parsing anything
        raise ReplyError(f"array {what!r}: {len(array.data)} bytes, at most {max_bytes} expected")
    dtype, shape, offset = npy_layout(array.data, what)
    if dtype != np.uint8 or len(shape) != 1:
        raise ReplyError(f"array {what!r}: {dtype} {shape}, expected uint8 bytes in one dimension")
    if max_bytes is not None and shape[0] > max_bytes:
        raise ReplyError(f"array {what!r}: {shape[0]} bytes, at most {max_bytes} expected")
    return np.frombuffer(array.data, dtype=np.uint8, count=shape[0], offset=offset)


#: the most bytes a record's index may take per tensor it lists, and in all besides
INDEX_BYTES_PER_TENSOR, INDEX_BYTES = 2048, 4096


def read_index(record: ArrayRecord, max_tensors: int | None = None) -> tuple[np.ndarray, list[tuple]]:
    """A tensor record's packed bytes (a view, see :func:`packed_bytes`) and its checked
    index: ``(name, torch dtype, shape, offset, size)`` per tensor, each tensor's bytes
    within the packed bytes and of exactly its shape's size. ``max_tensors``: caps the
    record at that many tensors' index and bytes as large as it could need (None: no
    cap); the caller checks the names, shapes and dtypes themselves."""
    if set(record) != {PACKED, INDEX}:
        raise ReplyError(f"a tensor record holds arrays {PACKED!r} and {INDEX!r}, not {sorted(record)[:4]}")
    index_cap = None if max_tensors is None else INDEX_BYTES + INDEX_BYTES_PER_TENSOR * max_tensors
    raw = packed_bytes(record[INDEX], INDEX, index_cap)
    try:
        index = json.loads(raw.tobytes())
    except ValueError as err:
        raise ReplyError(f"a tensor record's index is not JSON: {err}") from None
    if not isinstance(index, list) or (max_tensors is not None and len(index) > max_tensors):
        raise ReplyError(f"a tensor record's index is not a list of at most {max_tensors} tensors")
    return raw, index


def _entries(index: list, packed_size: int) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """``index``'s entries, each checked: a name, a torch dtype, a shape of whole
    non-negative sizes, and an ``offset``, ``size`` within ``packed_size`` bytes that are
    exactly the shape's bytes."""
    out, seen = [], set()
    for entry in index:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise ReplyError(
                f"a tensor record's index entry is not [name, dtype, shape, offset, size]: {entry!r:.80}"
            )
        name, dtype, shape, offset, size = entry
        if not isinstance(name, str) or name in seen:
            raise ReplyError(f"a tensor record's index names {name!r:.80} twice or not as a string")
        seen.add(name)
        dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
        if not isinstance(dt, torch.dtype):
            raise ReplyError(f"tensor {name!r}: dtype {dtype!r:.40}")
        whole = lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0  # noqa: E731
        if not (isinstance(shape, list) and len(shape) <= 16 and all(map(whole, shape))):
            raise ReplyError(f"tensor {name!r}: shape {shape!r:.80} is not a list of sizes")
        if not (whole(offset) and whole(size) and offset + size <= packed_size):
            raise ReplyError(
                f"tensor {name!r}: dtype {dtype!r}, bytes {offset}..{offset + size} of {packed_size}"
            )
        if size != math.prod(shape) * dt.itemsize:
            raise ReplyError(f"tensor {name!r}: {size} bytes for a {dtype} tensor of shape {tuple(shape)}")
        out.append((name, dt, tuple(shape), offset, size))
    return out


def describe(record: ArrayRecord, max_bytes: int | None = None, max_tensors: int | None = None) -> dict:
    """What a tensor record claims to hold, ``{name: (torch dtype, shape)}``, read from its
    index and headers without copying a tensor (``max_bytes``, ``max_tensors``: caps on
    its packed bytes and its tensors; None: none); :class:`ReplyError` if it is not a
    record of :func:`to_record`."""
    raw, index = read_index(record, max_tensors)
    packed = packed_bytes(record[PACKED], PACKED, max_bytes)
    return {name: (dtype, shape) for name, dtype, shape, _, _ in _entries(index, len(packed))}


def from_record(record: ArrayRecord, max_bytes: int | None = None, max_tensors: int | None = None) -> Tensors:
    """The tensors of :func:`to_record`'s record (writable copies, made once: the arrays
    Flower decodes are read-only views of the message buffer); :class:`ReplyError` if it
    is not one, or holds more than ``max_bytes`` bytes or ``max_tensors`` tensors."""
    _, index = read_index(record, max_tensors)
    packed = packed_bytes(record[PACKED], PACKED, max_bytes)
    tensors = {}
    for name, dtype, shape, offset, size in _entries(index, len(packed)):
        data = torch.from_numpy(packed[offset : offset + size].copy())
        tensors[name] = data.view(dtype).reshape(shape) if size else torch.zeros(shape, dtype=dtype)
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
