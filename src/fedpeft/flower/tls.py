"""What the deployment modules share: the TLS certificates a command was given, and the
error a deployment step raises. A leaf that ``deploy`` (starting Flower's processes) and
``connect`` (reaching a SuperLink) both import, so that ``deploy`` imports ``connect``
and never the other way round."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class DeployError(RuntimeError):
    """A deployment piece that failed to start or a run that did not complete."""


@dataclass
class Tls:
    """Certificates for TLS: the CA every party trusts, and the SuperLink's own pair."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        # absolute from here on: the SuperLink, the nodes and the ``flwr`` CLI run in other
        # working directories than the command that was given the paths
        self.ca = Path(self.ca).expanduser().resolve()
        self.cert = None if self.cert is None else Path(self.cert).expanduser().resolve()
        self.key = None if self.key is None else Path(self.key).expanduser().resolve()

    def check(self) -> None:
        """:class:`DeployError` naming the first of the given files that does not exist."""
        for flag, path in (("--ca", self.ca), ("--cert", self.cert), ("--key", self.key)):
            if path is not None and not path.is_file():
                raise DeployError(f"{flag} {path}: no such file")
