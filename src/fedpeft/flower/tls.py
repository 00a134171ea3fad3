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
    """Certificates for TLS: the CA every party trusts, the SuperLink's own pair, and the
    operator's key (``operator``, with ``operator.pem`` beside it: the credential that
    enrols, revokes and submits runs; default ``operator.key`` beside the CA, where
    ``fedpeft certs`` writes it, if it is there)."""

    ca: Path
    cert: Path | None = None
    key: Path | None = None
    operator: Path | None = None

    def __post_init__(self) -> None:
        # absolute from here on: the SuperLink, the nodes and the ``flwr`` CLI run in other
        # working directories than the command that was given the paths
        self.ca = Path(self.ca).expanduser().resolve()
        self.cert = None if self.cert is None else Path(self.cert).expanduser().resolve()
        self.key = None if self.key is None else Path(self.key).expanduser().resolve()
        if self.operator is None and (self.ca.parent / "operator.key").is_file():
            self.operator = self.ca.parent / "operator.key"
        self.operator = None if self.operator is None else Path(self.operator).expanduser().resolve()

    def check(self) -> None:
        """:class:`DeployError` naming the first of the given files that does not exist."""
        for flag, path in (("--ca", self.ca), ("--cert", self.cert), ("--key", self.key)):
            if path is not None and not path.is_file():
                raise DeployError(f"{flag} {path}: no such file")


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` in a command line (``--flag VALUE`` or ``--flag=VALUE``)."""
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
