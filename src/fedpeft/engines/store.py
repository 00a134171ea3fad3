"""Every simulated client's personal state, in RAM up to a budget and on disk beyond it.

A client's personal state (its personal adapter, a kept optimizer state, ...) is small,
but 100,000 of them are not. :class:`ClientStore` is a mapping ``cid -> tensors`` that
keeps the most recently used states in memory while their total size stays within
``budget`` bytes, and writes the least recently used ones to safetensors files (read
back bit for bit when a client comes up again).

Files are immutable: a client's newer state goes to a new file, and a superseded file is
deleted only once a checkpoint no longer names it. A checkpoint therefore holds the
store's *index* (client -> file), not the tensors: :meth:`commit` writes the states that
are only in memory, and the files of the last good checkpoint survive a crash in the
middle of the next round, so a resume reads exactly that round's states (lazily, one
client at a time, as they are used).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

Tensors = dict[str, torch.Tensor]
ALIGN = 16  # bytes
TRIM_EVERY = 256  # evictions between two hand-backs of freed heap memory


def release_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; elsewhere a no-op).
    A personal state is many small tensors, freed in least-recently-used order: without
    this the heap keeps the holes and resident memory drifts above the budget."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def state_bytes(state: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


@dataclass
class Packed:
    """A state in one byte buffer (one allocation per client, not one per tensor: a
    state is many small tensors, and each costs as much again in allocator overhead)."""

    buffer: torch.Tensor  # uint8
    layout: tuple[tuple[str, torch.dtype, tuple[int, ...], int, int], ...]  # name, dtype, shape, start, stop


_LAYOUTS: dict[tuple, tuple] = {}  # one copy of each layout: clients of a method share theirs


def pack(state: Tensors) -> Packed:
    parts, layout, start = [], [], 0
    for name, t in state.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
        layout.append((name, t.dtype, tuple(t.shape), start, start + raw.numel()))
        pad = -raw.numel() % ALIGN  # every tensor starts aligned for any dtype's view
        parts += [raw, torch.zeros(pad, dtype=torch.uint8)]
        start += raw.numel() + pad
    layout = _LAYOUTS.setdefault(tuple(layout), tuple(layout))
    return Packed(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8), layout)


def unpack(packed: Packed) -> Tensors:
    """The state's tensors: views of the packed buffer (the store never writes into it)."""
    return {name: packed.buffer[a:b].view(dtype).view(shape) for name, dtype, shape, a, b in packed.layout}


class ClientStore(MutableMapping[int, Tensors]):
    """``cid -> personal state``; in memory within ``budget`` bytes (None: no limit), the
    rest as files under ``directory`` (needed when there is a budget or a checkpoint)."""

    def __init__(
        self, directory: Path | None = None, budget: int | None = None, index: dict[int, str] | None = None
    ):
        if budget is not None and directory is None:
            raise ValueError("a client store with a memory budget needs a directory to spill to")
        self.directory, self.budget = directory, budget
        self.memory: OrderedDict[int, Tensors] = OrderedDict()  # least recently used first
        self.files: dict[int, str] = dict(index or {})  # cid -> its newest file, relative
        self.dirty: set[int] = set()  # in memory and newer than its file (or without one)
        self.superseded: set[str] = set()  # files replaced since the last commit
        self.bytes = 0  # of the states in memory
        self.serial = 1 + max((int(f.split(".")[1]) for f in self.files.values() if f), default=0)
        self.spilled = self.loaded = 0  # counts, for benchmarks and tests
        self.since_trim = 0  # states evicted since memory was last handed back

    @classmethod
    def open(cls, directory: Path, index: dict[int, str], budget: int | None = None) -> ClientStore:
        """The store a checkpoint's ``index`` describes; files under ``directory`` that it
        does not name (written after that checkpoint, before an interruption) are deleted."""
        named = {directory / f for f in index.values() if f}
        missing = sorted(str(p) for p in named if not p.is_file())
        if missing:
            raise FileNotFoundError(
                f"client store {directory}: files of the checkpoint are missing: {missing[:3]}"
            )
        for path in directory.glob("*/*"):
            if path not in named:
                path.unlink()
        return cls(directory, budget, index)

    # ----- the mapping
    def __getitem__(self, cid: int) -> Tensors:
        if cid in self.memory:
            self.memory.move_to_end(cid)
            return unpack(self.memory[cid])
        if cid not in self.files:
            raise KeyError(cid)
        name = self.files[cid]
        state = load_file(str(self.directory / name)) if name else {}
        self.loaded += 1
        self._hold(cid, state)
        return unpack(self.memory[cid])

    def __setitem__(self, cid: int, state: Tensors) -> None:
        self._drop(cid)
        self._hold(cid, state)
        self.dirty.add(cid)
        self._evict()

    def __delitem__(self, cid: int) -> None:
        if cid not in self:
            raise KeyError(cid)
        self._drop(cid)
        if cid in self.files:
            self.superseded.add(self.files.pop(cid))

    def __contains__(self, cid: object) -> bool:
        return cid in self.memory or cid in self.files

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(set(self.memory) | set(self.files)))

    def __len__(self) -> int:
        return len(set(self.memory) | set(self.files))

    # ----- checkpoints
    def commit(self) -> dict[int, str]:
        """Write every state that is only in memory; returns the index a checkpoint holds."""
        for cid in sorted(self.dirty):
            self._write(cid, unpack(self.memory[cid]))
        self.dirty.clear()
        return dict(self.files)

    def collect(self) -> None:
        """Delete the files superseded since the last commit (call once the checkpoint that
        holds the new index is safely written)."""
        for name in self.superseded - {""}:
            (self.directory / name).unlink(missing_ok=True)
        self.superseded.clear()

    def disk_bytes(self) -> int:
        return (
            sum((self.directory / f).stat().st_size for f in self.files.values() if f)
            if self.directory
            else 0
        )

    # ----- internals
    def _hold(self, cid: int, state: Tensors) -> None:
        packed = self.memory[cid] = pack(state)
        self.memory.move_to_end(cid)
        self.bytes += packed.buffer.numel()

    def _drop(self, cid: int) -> None:
        packed = self.memory.pop(cid, None)
        if packed is not None:
            self.bytes -= packed.buffer.numel()
        self.dirty.discard(cid)

    def _evict(self) -> None:
        """Spill the least recently used states until the rest fits the budget."""
        evicted = 0
        while self.budget is not None and self.bytes > self.budget and len(self.memory) > 1:
            cid, packed = next(iter(self.memory.items()))
            if cid in self.dirty:
                self._write(cid, unpack(packed))
                self.spilled += 1
            self._drop(cid)
            evicted += 1
        self.since_trim += evicted
        if self.since_trim >= TRIM_EVERY:
            release_freed_memory()
            self.since_trim = 0

    def _write(self, cid: int, state: Tensors) -> None:
        """A new file for ``cid``'s state (an empty state needs none: its name is "")."""
        name = ""
        if state:
            name = f"{cid // 1000}/{cid}.{self.serial}.safetensors"  # a folder per 1,000 clients
            self.serial += 1
            path = self.directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            save_file({k: v.contiguous() for k, v in state.items()}, str(tmp))
            os.replace(tmp, path)
        if cid in self.files:
            self.superseded.add(self.files[cid])
        self.files[cid] = name
        self.dirty.discard(cid)
