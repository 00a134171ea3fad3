"""Atomic round checkpoints: the server state, every client's personal state, the records.

A checkpoint is one file written to a temporary name and moved over the previous one
with ``os.replace`` (atomic on POSIX), so an interrupted write never corrupts the last
good checkpoint. Clients' personal states held in a :class:`ClientStore` with a
directory stay in its files: the checkpoint holds the store's index (client -> file),
and the files it names are kept until a later checkpoint no longer names them.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fedpeft.engines.store import ClientStore
from fedpeft.methods.base import ServerState, Tensors

STORE_DIR = "clients"  # the client store's directory, beside the checkpoint file


@dataclass
class Checkpoint:
    round: int  # the last completed round
    fingerprint: str  # of the resolved config, so a resume cannot mix experiments
    server: ServerState
    personal: MutableMapping[int, Tensors]  # a ClientStore, or a plain dict
    records: list[dict]
    joined: list[int]  # clients that have received the method's join message


class ResumeError(RuntimeError):
    """A checkpoint that cannot be resumed; the message says why."""


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    store = ckpt.personal if isinstance(ckpt.personal, ClientStore) and ckpt.personal.directory else None
    payload = {
        "round": ckpt.round,
        "fingerprint": ckpt.fingerprint,
        "server": {"tensors": ckpt.server.tensors, "extras": ckpt.server.extras},
        "personal": {} if store else dict(ckpt.personal),
        "personal_index": store.commit() if store else None,
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
        store.collect()  # the files only the previous checkpoint named


def load_checkpoint(path: Path, fingerprint: str, budget: int | None = None) -> Checkpoint:
    """The checkpoint at ``path``; clients' states in a store (the files beside it, read
    lazily, within ``budget`` bytes of memory) when it was written from one."""
    if not path.is_file():
        raise ResumeError(f"{path}: no checkpoint to resume from")
    try:
        payload = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as err:  # a truncated or foreign file
        raise ResumeError(f"{path}: unreadable checkpoint: {err}") from err
    if payload["fingerprint"] != fingerprint:
        raise ResumeError(
            f"{path}: written by a different config; resume needs the same config as the "
            "interrupted run (or use a new output_dir)"
        )
    server = ServerState(payload["server"]["tensors"], payload["server"]["extras"])
    personal = payload["personal"]
    if payload.get("personal_index") is not None:
        try:
            personal = ClientStore.open(path.parent / STORE_DIR, payload["personal_index"], budget)
        except FileNotFoundError as err:
            raise ResumeError(f"{path}: {err}") from err
    return Checkpoint(payload["round"], fingerprint, server, personal, payload["records"], payload["joined"])
