"""Atomic round checkpoints, the last few kept: server state, clients' states, records.

A checkpoint is one file written to a temporary name, flushed to disk and moved into
place with ``os.replace`` (atomic on POSIX), so an interrupted write never corrupts a
checkpoint already there. :class:`Checkpoints` keeps the last ``checkpoint.keep`` of a
run: the newest is ``checkpoint.pt``, the earlier ones ``checkpoint.round<N>.pt``. A
resume reads the newest that can be read (saying which it skipped and why), or the round
it is asked for.

Clients' personal states held in a :class:`ClientStore` with a directory stay in its
files: a checkpoint names the commit of the store's index (client -> file and checksum,
on disk beside the files) that it resumes with; a file is deleted once no kept
checkpoint's commit names it.

Nothing non-finite is ever checkpointed: :func:`save_checkpoint` refuses a server state
with a NaN or infinite value (the engines drop diverged clients before they aggregate,
so this is the last line, not the rule).
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fedpeft.engines.guard import nonfinite_tensor
from fedpeft.engines.store import ClientStore
from fedpeft.engines.store_index import StoreIndex
from fedpeft.methods.base import ServerState, Tensors

STORE_DIR = "clients"  # the client store's directory, beside the checkpoint file
KEPT = re.compile(r"\.round(\d+)\.pt$")  # checkpoint.round<N>.pt: an earlier kept checkpoint


@dataclass
class Checkpoint:
    round: int  # the last completed round
    fingerprint: str  # of the resolved config, so a resume cannot mix experiments
    server: ServerState
    personal: MutableMapping[int, Tensors]  # a ClientStore, or a plain dict
    records: list[dict]
    joined: list[int]  # clients that have received the method's join message
    resets: dict[int, str] | None = None  # clients whose stored state was unreadable and reset


class ResumeError(RuntimeError):
    """A checkpoint that cannot be resumed; the message says why."""


def save_checkpoint(path: Path, ckpt: Checkpoint, keep: int = 1) -> None:
    """Write ``ckpt`` to ``path`` atomically (``keep``: checkpoints kept, this one
    included, whose clients' files the store must keep)."""
    tensors = {**ckpt.server.tensors, **{k: v for k, v in ckpt.server.extras.items() if torch.is_tensor(v)}}
    if (bad := nonfinite_tensor(tensors)) is not None:
        raise ValueError(
            f"{path}: refusing to checkpoint round {ckpt.round}: server tensor {bad!r} is not finite"
        )
    store = ckpt.personal if isinstance(ckpt.personal, ClientStore) and ckpt.personal.index else None
    payload = {
        "round": ckpt.round,
        "fingerprint": ckpt.fingerprint,
        "server": {"tensors": ckpt.server.tensors, "extras": ckpt.server.extras},
        "personal": {} if store else dict(ckpt.personal),
        "personal_commit": store.commit() if store else None,  # synced before this file is written
        "records": ckpt.records,
        "joined": ckpt.joined,
    }
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    if store:
        store.collect(keep)  # the files no kept checkpoint names any more


def load_checkpoint(
    path: Path,
    fingerprint: str,
    budget: int | None = None,
    on_corrupt_state: str = "stop",
    owner: bool = True,
) -> Checkpoint:
    """The checkpoint at ``path``; clients' states in a store (the files beside it, each
    checked against its checksum now and read lazily later, within ``budget`` bytes of
    memory) when it was written from one. A client's missing or corrupt file is a
    :class:`~fedpeft.engines.store.StoreError`, or with ``on_corrupt_state="reset"`` drops
    that client's state (listed in ``Checkpoint.resets``). ``owner``: this process owns the
    store's index (brings it back to the checkpoint's commit, deletes the files no kept
    checkpoint names); the ranks other than 0 leave that to rank 0."""
    if not path.is_file():
        raise ResumeError(f"{path}: no checkpoint to resume from")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # a truncated or foreign file
        raise ResumeError(f"{path}: unreadable checkpoint: {_why_unreadable(path, err)}") from err
    if (wrong := _not_a_checkpoint(payload)) is not None:
        raise ResumeError(f"{path}: unreadable checkpoint: {wrong}")
    if payload["fingerprint"] != fingerprint:
        raise ResumeError(
            f"{path}: written by a different config; resume needs the same config as the "
            "interrupted run (or use a new output_dir)"
        )
    server = ServerState(payload["server"]["tensors"], payload["server"]["extras"])
    personal, resets = payload["personal"], None
    commit, legacy = payload.get("personal_commit"), payload.get("personal_index")
    if legacy is not None and owner:  # written before the index was on disk
        commit = import_index(path.parent / STORE_DIR, legacy, payload["personal_checksums"])
    if commit is not None or legacy is not None:
        personal, resets = ClientStore.open(
            path.parent / STORE_DIR, commit or 0, budget, on_corrupt_state, durable=owner
        )
    return Checkpoint(
        payload["round"], fingerprint, server, personal, payload["records"], payload["joined"], resets
    )


#: what a checkpoint file holds (save_checkpoint): a mapping with these keys
PAYLOAD_KEYS = ("round", "fingerprint", "server", "personal", "records", "joined")


def _why_unreadable(path: Path, err: Exception) -> str:
    """Why ``torch.load`` could not read the checkpoint at ``path``, in a few words."""
    try:
        size = path.stat().st_size
    except OSError as gone:
        return f"cannot be read: {gone.strerror or gone}"
    if size == 0:
        return "the file is empty (0 bytes)"
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive
        return (
            f"not a torch checkpoint: no whole zip archive in its {size} bytes (truncated, or another file)"
        )
    text = str(err)
    if "WeightsUnpickler error:" in text:  # torch's advice around it is about other files than ours
        detail = text.split("WeightsUnpickler error:", 1)[1].strip().split("\n\n")[0]
        return f"it holds more than tensors and plain values ({' '.join(detail.split())})"
    return f"{type(err).__name__}: {' '.join(text.split())}" if text.strip() else type(err).__name__


def _not_a_checkpoint(payload: object) -> str | None:
    """What is wrong with a loaded checkpoint's contents (None: it has what one holds)."""
    expected = f"a mapping of {', '.join(PAYLOAD_KEYS)}"
    if not isinstance(payload, dict):
        return f"expected {expected}, got {type(payload).__name__ if payload is not None else 'None'}"
    if missing := [key for key in PAYLOAD_KEYS if key not in payload]:
        return f"expected {expected}; it has no {', '.join(missing)}"
    server = payload["server"]
    parts = ("tensors", "extras")
    if not isinstance(server, dict) or not all(isinstance(server.get(k), dict) for k in parts):
        return f"expected 'server' to be a mapping of tensors and extras, got {type(server).__name__}"
    if not isinstance(payload["round"], int):
        return f"expected 'round' to be a number, got {type(payload['round']).__name__}"
    return None


def import_index(directory: Path, index: dict[int, str], checksums: dict[str, str] | None) -> int:
    """A checkpoint's index of an earlier version (client -> file, in the checkpoint) as
    the one commit of a new on-disk index; its number."""
    store = StoreIndex(directory)
    store.rollback(0)
    version = store.commit({cid: (name, (checksums or {}).get(name, "")) for cid, name in index.items()})
    store.close()
    return version


def peek_round(path: Path) -> int | None:
    """The round of the checkpoint at ``path`` (None: it cannot be read)."""
    try:
        return int(torch.load(path, weights_only=True, map_location="cpu")["round"])
    except Exception:  # noqa: BLE001 -- truncated, foreign or missing: no round to offer
        return None


class Checkpoints:
    """The kept checkpoints of one run: ``checkpoint.pt`` (the newest) and up to
    ``keep - 1`` earlier ones, ``checkpoint.round<N>.pt``, beside it."""

    def __init__(self, path: Path, keep: int = 2, say: Callable[[str], None] | None = None):
        self.path, self.keep = path, keep
        self.next = path.with_name(path.name + ".next")  # the newest while it is moved into place
        self.say = say or (lambda line: None)  # where a resume reports what it skipped
        self.newest: int | None = None  # the round in self.path, once known

    def of_round(self, rnd: int) -> Path:
        return self.path.with_name(f"{self.path.stem}.round{rnd}.pt")

    def earlier(self) -> list[tuple[int, Path]]:
        """The earlier kept checkpoints on disk, newest first."""
        found = [(int(m.group(1)), p) for p in self.path.parent.glob(f"{self.path.stem}.round*.pt")
                 if (m := KEPT.search(p.name))]  # fmt: skip
        return sorted(found, reverse=True)

    def candidates(self) -> list[Path]:
        """Every checkpoint on disk, newest first."""
        newest = [p for p in (self.next, self.path) if p.is_file()]
        return newest + [p for _, p in self.earlier()]

    def clear(self) -> None:
        """Remove every checkpoint of an earlier run in this directory (a fresh start)."""
        for p in self.candidates():
            p.unlink()
        self.newest = None

    def save(self, ckpt: Checkpoint) -> None:
        """Write ``ckpt`` as the newest; the one it replaces becomes ``checkpoint.round<N>.pt``
        and the oldest beyond ``keep`` is deleted. A crash at any point leaves the last
        completed checkpoint readable (as the newest, or as the newest earlier one)."""
        save_checkpoint(self.next, ckpt, self.keep)  # written, flushed and complete, under a side name
        self._adopt(self.next, ckpt.round)

    def _adopt(self, path: Path, rnd: int) -> None:
        """Make ``path`` (round ``rnd``) the newest checkpoint; the newest until now, if it is
        another file, becomes an earlier kept one."""
        if path == self.path:
            self.newest = rnd
            return
        if self.path.is_file():
            previous = self.newest if self.newest is not None else peek_round(self.path)
            if self.keep > 1 and previous is not None and previous < rnd:
                os.replace(self.path, self.of_round(previous))
        os.replace(path, self.path)
        self.newest = rnd
        for _, p in self.earlier()[self.keep - 1 :]:  # beyond the kept ones
            p.unlink()

    def load(
        self,
        fingerprint: str,
        budget: int | None = None,
        rnd: int | None = None,
        on_corrupt_state: str = "stop",
    ) -> Checkpoint:
        """The newest checkpoint that can be read, or round ``rnd``'s (the kept ones newer
        than it are deleted: the run goes on from ``rnd``). A newer one that cannot be read
        is renamed ``*.unreadable``, and said."""
        candidates = self.candidates()
        if not candidates:
            raise ResumeError(f"{self.path}: no checkpoint to resume from")
        if rnd is not None:
            rounds = {p: peek_round(p) for p in candidates}
            if rnd not in rounds.values():
                kept = ", ".join(str(r) for r in rounds.values() if r is not None) or "none that reads"
                raise ResumeError(
                    f"--resume-from {rnd}: no kept checkpoint of round {rnd} in {self.path.parent} "
                    f"(kept: {kept})"
                )
            path = next(p for p, r in rounds.items() if r == rnd)
            ckpt = load_checkpoint(path, fingerprint, budget, on_corrupt_state)
            for newer, r in rounds.items():
                if newer != path and (r is None or r > rnd):
                    newer.unlink()
            self._adopt(path, rnd)
            return ckpt
        failures = []
        for path in candidates:
            try:
                ckpt = load_checkpoint(path, fingerprint, budget, on_corrupt_state)
            except ResumeError as err:
                if "different config" in str(err):
                    raise
                failures.append((path, err))
                continue
            for bad, err in failures:
                bad.rename(bad.with_name(bad.name + ".unreadable"))
                self.say(f"{bad.name} could not be read ({err}); kept aside as {bad.name}.unreadable")
            if failures:
                self.say(f"resuming from the previous checkpoint, {path.name} (round {ckpt.round})")
            self._adopt(path, ckpt.round)
            return ckpt
        raise ResumeError("; ".join(str(err) for _, err in failures) + " (no kept checkpoint can be read)")
