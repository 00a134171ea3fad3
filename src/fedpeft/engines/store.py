"""Every simulated client's personal state, in RAM up to a budget and on disk beyond it.

A client's personal state (its personal adapter, a kept optimizer state, ...) is small,
but 100,000 of them are not. :class:`ClientStore` is a mapping ``cid -> tensors`` that
keeps the most recently used states in memory while their total size stays within
``budget`` bytes, and writes the least recently used ones to safetensors files (read
back bit for bit when a client comes up again).

Files are immutable: a client's newer state goes to a new file, and a superseded file is
deleted only once no kept checkpoint names it. Which file holds a client's state is the
store's *index*, kept on disk commit by commit (:mod:`fedpeft.engines.store_index`): a
round writes the rows of the clients it trained, never the whole index, and a checkpoint
names a commit, not the tensors. :meth:`ClientStore.commit` writes the states that are
only in memory and commits their rows; the files of the kept checkpoints survive a crash
in the middle of the next round, so a resume reads exactly that round's states (lazily,
one client at a time, as they are used). Every read checks the file against its checksum,
and :meth:`ClientStore.open` checks every file of the view before a resumed run trains:
a truncated, changed or missing file is a :class:`StoreError` naming the client and the
file, or, when asked, that client's state is dropped (it starts again from the method's
initial personal state) and the reset reported.

A store with a directory but no index of its own (``durable=False``: the ranks of a run
other than 0) reads and writes states in the same directory and knows only the entries it
is handed (:meth:`adopt`) or writes itself.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
from collections import OrderedDict
from collections.abc import Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save

from fedpeft.engines.store_index import Entry, StoreIndex
from fedpeft.tensors import Tensors

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
    rest as files under ``directory`` (needed when there is a budget or a checkpoint),
    indexed there (``durable``) or by another process's store (see the module)."""

    def __init__(self, directory: Path | None = None, budget: int | None = None, durable: bool = True):
        if budget is not None and directory is None:
            raise ValueError("a client store with a memory budget needs a directory to spill to")
        self.directory, self.budget = directory, budget
        self.index = StoreIndex(directory) if directory is not None and durable else None
        self.memory: OrderedDict[int, Packed] = OrderedDict()  # least recently used first
        self.written: dict[int, Entry] = {}  # entries since the last commit (or handed over)
        self.fresh: set[str] = set()  # files this store wrote since the last commit
        self.orphans: set[str] = set()  # ... and replaced before it: no checkpoint names them
        self.dirty: set[int] = set()  # in memory and newer than its file (or without one)
        self.kept: list[int] = []  # the commits the kept checkpoints name, oldest first
        self.bytes = 0  # of the states in memory
        self.serial = self.index.get("serial", 1) if self.index is not None else 1  # of the next file
        self.spilled = self.loaded = 0  # counts, for benchmarks and tests
        self.since_trim = 0  # states evicted since memory was last handed back

    @classmethod
    def open(
        cls,
        directory: Path,
        commit: int = 0,
        budget: int | None = None,
        on_corrupt: str = "stop",
        durable: bool = True,
    ) -> tuple[ClientStore, dict[int, str]]:
        """The store as commit ``commit`` of its index left it (0: empty, a fresh run), every
        file of that view checked against its checksum, and the clients whose state was
        reset, with why. The commits after it and every file they alone named, or no row
        names (written after that commit before an interruption), are deleted. A missing or
        corrupt file is a :class:`StoreError` or, with ``on_corrupt="reset"``, drops that
        client's state. ``durable=False`` (the ranks other than 0): a store on the same
        directory that leaves the index and the tidying to the one that owns it."""
        store = cls(directory, budget, durable)
        if store.index is None:
            return store, {}
        try:
            store.index.rollback(commit)
        except LookupError as err:
            raise StoreError(str(err)) from None
        store.kept = [commit] if commit else []
        resets: dict[int, str] = {}
        for cid, name, digest in list(store.index.view()) if commit else ():
            if not name:
                continue
            try:
                store._read(cid, name, digest)
            except StoreError as err:
                if on_corrupt != "reset":
                    raise
                resets[cid] = str(err)
                store.written[cid] = None
        named = store.index.files()
        for path in directory.glob("*/*"):
            if str(path.relative_to(directory)) not in named:
                path.unlink(missing_ok=True)
        return store, resets

    def close(self) -> None:
        if self.index is not None:
            self.index.close()

    def entry(self, cid: int) -> Entry:
        """Client ``cid``'s entry (its file and checksum; None: no state)."""
        if cid in self.written:
            return self.written[cid]
        return self.index.entry(cid) if self.index is not None else None

    # ----- the mapping
    def __getitem__(self, cid: int) -> Tensors:
        if cid in self.memory:
            self.memory.move_to_end(cid)
            return unpack(self.memory[cid])
        entry = self.entry(cid)
        if entry is None:
            raise KeyError(cid)
        state = self._read(cid, *entry) if entry[0] else {}
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
        self._replace(cid, None)

    def __contains__(self, cid: object) -> bool:
        return cid in self.memory or (isinstance(cid, Integral) and self.entry(int(cid)) is not None)

    def __iter__(self) -> Iterator[int]:
        """Every client with a state (reads the whole index: not for a round's work)."""
        cids = {cid for cid, _, _ in self.index.view()} if self.index is not None else set()
        cids |= {cid for cid, entry in self.written.items() if entry is not None}
        cids -= {cid for cid, entry in self.written.items() if entry is None}
        return iter(sorted(cids | set(self.memory)))

    def __len__(self) -> int:
        return sum(1 for _ in self)

    # ----- checkpoints
    def commit(self) -> int:
        """Write every state that is only in memory and commit the entries written since the
        last commit; returns the commit's number, which a checkpoint names."""
        for cid in sorted(self.dirty):
            self._write(cid, unpack(self.memory[cid]))
        if self.index is None:
            raise RuntimeError("a store without an index of its own has no commits")
        version = self.index.commit(self.written, serial=self.serial)
        self.written, self.fresh = {}, set()
        return version

    def collect(self, keep: int = 1, delete: bool = True) -> None:
        """Call once the checkpoint naming the last commit is safely written (``keep``
        checkpoints being kept: that one and ``keep - 1`` earlier ones): deletes the files
        that no kept checkpoint names any more. A store without an index of its own deletes
        only what it wrote and replaced since the last call (``delete=False``: forgets)."""
        gone, self.orphans = self.orphans, set()
        if self.index is not None:
            if self.index.newest not in self.kept:
                self.kept = [*self.kept, self.index.newest][-keep:]
            gone |= set(self.index.collect(self.kept[0]))
        for name in gone if delete else ():
            (self.directory / name).unlink(missing_ok=True)

    # ----- several stores on one directory (ranks: fedpeft.engines.distributed)
    def publish(self, cids: Iterable[int]) -> dict[int, Entry]:
        """The entries of clients ``cids``, their states written first: what another store
        on this directory needs to read them (:meth:`adopt`)."""
        cids = sorted(cids)
        for cid in sorted(self.dirty.intersection(cids)):
            self._write(cid, unpack(self.memory[cid]))
        return {cid: self.entry(cid) for cid in cids}

    def adopt(self, entries: dict[int, Entry]) -> None:
        """Take another store's entries (:meth:`publish`) for its clients: a copy of their
        states held here is dropped unless it is that entry's, their files read from now on."""
        for cid, entry in entries.items():
            if cid in self.memory and cid not in self.dirty and self.entry(cid) == entry:
                continue
            self._drop(cid)
            self.written[cid] = entry
            if entry is not None and entry[0]:
                self.serial = max(self.serial, int(entry[0].split(".")[1]) + 1)

    def forget(self) -> None:
        """Drop the entries of the states not held in memory (a store without an index of
        its own, between two rounds: what it needs next is handed over again)."""
        self.written = {cid: e for cid, e in self.written.items() if cid in self.memory}
        self.fresh = set()

    def disk_bytes(self) -> int:
        """The size of the files under the store's directory (the index included)."""
        files = self.directory.rglob("*") if self.directory else ()
        return sum(p.stat().st_size for p in files if p.is_file())

    # ----- internals
    def _read(self, cid: int, name: str, expected: str) -> Tensors:
        """Client ``cid``'s state from its file ``name``, checked against its checksum
        (``expected``; "": a state adopted before checksums were kept, not checked)."""
        path = self.directory / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"client {cid}: its state file {path} is missing") from None
        if expected and checksum(data) != expected:
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
        entry: Entry = ("", "")
        if state:
            name = f"{cid // 1000}/{cid}.{self.serial}.safetensors"  # a folder per 1,000 clients
            self.serial += 1
            path = self.directory / name
            path.parent.mkdir(parents=True, exist_ok=True)
            data = save({k: v.contiguous() for k, v in state.items()})
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)
            entry = (name, checksum(data))
            self.fresh.add(name)
        self._replace(cid, entry)
        self.dirty.discard(cid)

    def _replace(self, cid: int, entry: Entry) -> None:
        """``entry`` is client ``cid``'s from now on; a file this store wrote since the last
        commit that it replaces is named by no checkpoint (deleted at :meth:`collect`)."""
        old = self.written.get(cid)
        if old is not None and old[0] in self.fresh:
            self.fresh.discard(old[0])
            self.orphans.add(old[0])
        self.written[cid] = entry
