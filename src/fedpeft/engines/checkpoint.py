"""Atomic round checkpoints: the server state, every client's personal state, the records.

A checkpoint is one file written to a temporary name and moved over the previous one
with ``os.replace`` (atomic on POSIX), so an interrupted write never corrupts the last
good checkpoint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from fedpeft.methods.base import ServerState, Tensors


@dataclass
class Checkpoint:
    round: int  # the last completed round
    fingerprint: str  # of the resolved config, so a resume cannot mix experiments
    server: ServerState
    personal: dict[int, Tensors]
    records: list[dict]
    joined: list[int]  # clients that have received the method's join message


class ResumeError(RuntimeError):
    """A checkpoint that cannot be resumed; the message says why."""


def save_checkpoint(path: Path, ckpt: Checkpoint) -> None:
    payload = {
        "round": ckpt.round,
        "fingerprint": ckpt.fingerprint,
        "server": {"tensors": ckpt.server.tensors, "extras": ckpt.server.extras},
        "personal": ckpt.personal,
        "records": ckpt.records,
        "joined": ckpt.joined,
    }
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        torch.save(payload, fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, fingerprint: str) -> Checkpoint:
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
    return Checkpoint(
        payload["round"], fingerprint, server, payload["personal"], payload["records"], payload["joined"]
    )
