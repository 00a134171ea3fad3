"""Every simulated client's personal state, in RAM up to a budget and on disk beyond it.

A client's personal state (its personal adapter, a kept optimizer state, ...) is small,
but 100,000 of them are not. :class:`ClientStore` is a mapping ``cid -> tensors`` that
keeps the most recently used states in memory while their total size stays within
``budget`` bytes, and writes the least recently used ones to safetensors files (read
back bit for bit when a client comes up again).

Files are immutable: a client's newer state goes to a new file, and a superseded file is
deleted only once no kept checkpoint names it. A checkpoint therefore holds the store's
*index* (client -> file) and each file's checksum, not the tensors: :meth:`commit` writes
the states that are only in memory, and the files of the kept checkpoints survive a crash
in the middle of the next round, so a resume reads exactly that round's states (lazily,
one client at a time, as they are used). Every read checks the file against its checksum,
and :meth:`ClientStore.open` checks every file of the index before a resumed run trains:
a truncated, changed or missing file is a :class:`StoreError` naming the client and the
file, or, when asked, that client's state is dropped (it starts again from the method's
initial personal state) and the reset reported.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

Tensors = dict[str, torch.Tensor]
ALIGN = 16  # bytes
TRIM_EVERY = 256  # evictions between two hand-backs of freed heap memory


def release_freed_memory() -> None:
    """Hand freed heap memory back to the system (glibc's ``malloc_trim``; elsewhere a no-op).
    A personal state is many small tensors, freed in least-recently-used order: without
    this the heap keeps the holes and resident memory drifts above the budget."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class StoreError(RuntimeError):
    """A client's stored state that cannot be read back as written; the message names the
    client and the file."""


def checksum(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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
    """``state`` in one buffer, its tensors in name order: a state reads back in the same
    order whether it was held in memory or read from a file (a safetensors file does not
    keep the order), so that sums over a state's tensors do not change on a resume."""
    parts, layout, start = [], [], 0
    for name, t in sorted(state.items(), key=lambda item: item[0]):
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
        self,
        directory: Path | None = None,
        budget: int | None = None,
        index: dict[int, str] | None = None,
        checksums: dict[str, str] | None = None,
        retained: list[set[str]] | None = None,
    ):
        if budget is not None and directory is None:
            raise ValueError("a client store with a memory budget needs a directory to spill to")
        self.directory, self.budget = directory, budget
        self.memory: OrderedDict[int, Tensors] = OrderedDict()  # least recently used first
        self.files: dict[int, str] = dict(index or {})  # cid -> its newest file, relative
        self.checksums: dict[str, str] = dict(checksums or {})  # file -> checksum of its bytes
        self.dirty: set[int] = set()  # in memory and newer than its file (or without one)
        self.superseded: set[str] = set()  # files replaced since the last commit
        # per earlier commit still kept (oldest first): the files only its checkpoint names
        self.retained: list[set[str]] = [set(r) for r in retained or []]
        self.committed: set[str] = set(self.files.values())  # files the newest checkpoint names
        self.bytes = 0  # of the states in memory
        self.serial = 1 + max((int(f.split(".")[1]) for f in self.files.values() if f), default=0)
        self.spilled = self.loaded = 0  # counts, for benchmarks and tests
        self.since_trim = 0  # states evicted since memory was last handed back

    @classmethod
    def open(
        cls,
        directory: Path,
        index: dict[int, str],
        budget: int | None = None,
        checksums: dict[str, str] | None = None,
        retained: list[set[str]] | None = None,
        on_corrupt: str = "stop",
        tidy: bool = True,
    ) -> tuple[ClientStore, dict[int, str]]:
        """The store a checkpoint's ``index`` describes, every file checked against its
        checksum (``checksums``; a checkpoint written before checksums existed has none:
        then only that the file exists), and the clients whose state was reset, with why.
        A missing or corrupt file is a :class:`StoreError` or, with ``on_corrupt="reset"``,
        drops that client's state. Files under ``directory`` that neither the index nor the
        earlier kept checkpoints (``retained``) name, written after that checkpoint before an
        interruption, are deleted (``tidy``; not by the ranks other than 0, which share it)."""
        store = cls(directory, budget, index, checksums, retained)
        resets: dict[int, str] = {}
        for cid, name in sorted(index.items()):
            if not name:
                continue
            try:
                store.verify(cid)
            except StoreError as err:
                if on_corrupt != "reset":
                    raise
                resets[cid] = str(err)
                del store.files[cid]
        keep = {directory / f for f in set(store.files.values()).union(*store.retained) if f}
        for path in directory.glob("*/*") if tidy else ():
            if path not in keep:
                path.unlink(missing_ok=True)
        return store, resets

    def verify(self, cid: int) -> None:
        """Check client ``cid``'s file (it exists and matches its checksum)."""
        self._read(cid, self.files[cid])

    # ----- the mapping
    def __getitem__(self, cid: int) -> Tensors:
        if cid in self.memory:
            self.memory.move_to_end(cid)
            return unpack(self.memory[cid])
        if cid not in self.files:
            raise KeyError(cid)
        name = self.files[cid]
        state = self._read(cid, name) if name else {}
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
        """Write every state that is only in memory; returns the index a checkpoint holds
        (its files' checksums: :meth:`checksums_of`)."""
        for cid in sorted(self.dirty):
            self._write(cid, unpack(self.memory[cid]))
        self.dirty.clear()
        return dict(self.files)

    # ----- several stores on one directory (ranks: fedpeft.engines.ranks)
    def publish(self, cids: list[int]) -> dict[int, tuple[str, str] | None]:
        """The index entries of clients ``cids`` (their file and its checksum; None: no
        state), their states written first: what another store on this directory needs
        to read them (:meth:`adopt`)."""
        for cid in sorted(self.dirty & set(cids)):
            self._write(cid, unpack(self.memory[cid]))
        return {
            cid: (name, self.checksums.get(name, "")) if (name := self.files.get(cid)) is not None else None
            for cid in cids
        }

    def adopt(self, entries: dict[int, tuple[str, str] | None]) -> None:
        """Take another store's newer entries (:meth:`publish`) for its clients: a copy of
        their states held here is dropped, their files read from now on."""
        for cid, entry in entries.items():
            self._drop(cid)
            old = self.files.pop(cid, None)
            if entry is None:
                if old is not None:
                    self.superseded.add(old)
                continue
            name, digest = entry
            if old is not None and old != name:
                self.superseded.add(old)
            self.files[cid] = name
            if name:
                self.checksums[name] = digest
                self.serial = max(self.serial, int(name.split(".")[1]) + 1)

    def checksums_of(self, index: dict[int, str]) -> dict[str, str]:
        return {name: self.checksums[name] for name in index.values() if name}

    def collect(self, keep: int = 1, delete: bool = True) -> None:
        """Call once the checkpoint holding the index of the last :meth:`commit` is safely
        written, ``keep`` checkpoints being kept (that one and ``keep - 1`` earlier ones):
        deletes the files that no kept checkpoint names any more (``delete=False``: only
        forgets them, where another store on the directory deletes them)."""
        named_before, self.committed = self.committed, set(self.files.values())
        self.retained.append(self.superseded & named_before)  # only the earlier checkpoints name them
        self._delete(self.superseded - named_before, delete)  # written and superseded between two commits
        self.superseded = set()
        while len(self.retained) > keep - 1:
            self._delete(self.retained.pop(0), delete)

    def _delete(self, names: set[str], delete: bool = True) -> None:
        for name in names - {""}:
            if delete:
                (self.directory / name).unlink(missing_ok=True)
            self.checksums.pop(name, None)

    def disk_bytes(self) -> int:
        return (
            sum((self.directory / f).stat().st_size for f in self.files.values() if f)
            if self.directory
            else 0
        )

    # ----- internals
    def _read(self, cid: int, name: str) -> Tensors:
        """Client ``cid``'s state from its file ``name``, checked against its checksum."""
        path = self.directory / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"client {cid}: its state file {path} is missing") from None
        expected = self.checksums.get(name)
        if expected is not None and checksum(data) != expected:
            raise StoreError(
                f"client {cid}: its state file {path} is corrupt ({len(data)} bytes that do not match "
                "the checksum the checkpoint recorded: truncated or changed since)"
            )
        try:
            return load(data)
        except SafetensorError as err:
            raise StoreError(f"client {cid}: its state file {path} is unreadable ({err})") from None

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
            data = save({k: v.contiguous() for k, v in state.items()})
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            self.checksums[name] = checksum(data)
        if cid in self.files:
            self.superseded.add(self.files[cid])
        self.files[cid] = name
        self.dirty.discard(cid)
