"""``flower-superlink`` with a gate in front of everything but the nodes' API.

Flower 1.41's SuperLink serves three APIs on one port: the **Fleet API** (the SuperNodes:
messages and heartbeats, each request signed by the node's enrolled key when SuperNode
authentication is on), the **Control API** (``flwr run``, ``ls``, ``log``, ``stop``, and
``supernode register``/``unregister``: who takes part and what runs) and the **Runtime
API** (the SuperLink's own SuperExec and ServerApps). Without an account system (Flower's
is OIDC, in its enterprise edition) the Control API answers anyone who reaches the port,
and the Runtime API hands the next ServerApp task to whoever asks first. This entry point
runs Flower's own SuperLink with :class:`Gate` as its outermost middleware:

- the Fleet API and ``/health`` pass untouched (the nodes' own authentication applies);
- the **Control API** answers this machine only (loopback, or a connection to one of this
  machine's addresses from that same address), unless ``--remote-operator`` is given;
  with TLS every request must also carry a current operator token (a bearer token signed
  with the operator key, whose certificate the SuperLink's CA issued with fedpeft's
  operator usage: :mod:`fedpeft.flower.operator`). Without TLS there is no credential to
  check, so the Control API then answers this machine only, whatever the flags;
- everything else (the Runtime API, Flower's API documentation) answers this machine only.

A refused request gets HTTP 401 (no token) or 403 with the reason, and the SuperLink's log
a line naming the caller and the path.

    python -m fedpeft.flower.superlink [--remote-operator] <flower-superlink's flags>
"""

from __future__ import annotations

import ipaddress
import json
import sys
from collections.abc import Callable
from logging import WARNING

from fedpeft.flower.operator import TokenCheck, Untrusted, load_ca
from fedpeft.flower.tls import flag_value

FLEET, CONTROL, HEALTH = "/v1/fleet/", "/v1/control/", "/health"
REMOTE_FLAG = "--remote-operator"


def same_host(scope: dict) -> bool:
    """Whether the connection comes from this machine: a loopback peer, or a peer whose
    address is the very address it reached us on (only this machine can be both ends)."""
    client, server = scope.get("client"), scope.get("server")
    if not client:
        return False
    try:
        peer = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    mapped = getattr(peer, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    if peer.is_loopback or (mapped is not None and mapped.is_loopback):
        return True
    return bool(server) and client[0] == server[0]


def _bearer(scope: dict) -> str | None:
    values = [v for k, v in scope.get("headers", []) if k.lower() == b"authorization"]
    if len(values) != 1:
        return None
    scheme, _, token = values[0].decode("latin-1").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


class Gate:
    """An ASGI middleware: which caller may use which of the SuperLink's APIs (above).
    ``check``: the operator-token check (TLS), or None (no TLS: no credential exists);
    ``remote``: the Control API also answers other machines (with the token);
    ``say``: where a refusal is logged."""

    def __init__(self, app, check: Callable[[str], None] | None, remote: bool, say: Callable[[str], None]):
        self.app, self.check, self.remote, self.say = app, check, remote and check is not None, say

    def refusal(self, scope: dict) -> tuple[int, str] | None:
        """(HTTP status, reason) for a request the gate refuses; None to let it through."""
        path = scope.get("path", "")
        if path.startswith(FLEET) or path == HEALTH:
            return None
        local = same_host(scope)
        if not path.startswith(CONTROL):
            return None if local else (403, "this API answers the SuperLink's own machine only")
        if not local and not self.remote:
            return 403, (
                "the Control API (enrol, revoke, runs) answers the SuperLink's own machine only; "
                f"its operator may open it to others, with TLS, by starting it with {REMOTE_FLAG}"
            )
        if self.check is None:
            return None
        token = _bearer(scope)
        if token is None:
            return 401, (
                "enrolling, revoking and submitting runs take the operator's credential (operator.key "
                "and operator.pem from `fedpeft certs`, given with --operator); none was sent"
            )
        try:
            self.check(token)
        except Untrusted as err:
            return 403, f"not the operator: {err}"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (refused := self.refusal(scope)) is None:
            return await self.app(scope, receive, send)
        status, why = refused
        client = scope.get("client") or ("?", 0)
        self.say(f"refused {scope.get('method')} {scope.get('path')} from {client[0]}: {why}")
        body = json.dumps({"detail": why}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def install_gate(argv: list[str]) -> list[str]:
    """Put :class:`Gate` in front of Flower's SuperLink app for a SuperLink started with
    ``argv`` (flower-superlink's flags, plus :data:`REMOTE_FLAG`); returns Flower's flags."""
    from flwr.common.logger import log
    from flwr.superlink import extensions
    from starlette.middleware import Middleware

    remote = REMOTE_FLAG in argv
    argv = [a for a in argv if a != REMOTE_FLAG]
    insecure = "--insecure" in argv
    ca = flag_value(argv, "--ssl-ca-certfile")
    if remote and (insecure or ca is None):
        raise SystemExit(f"{REMOTE_FLAG}: the operator's credential needs TLS (--ssl-ca-certfile)")
    check = None if insecure or ca is None else TokenCheck(load_ca(ca))
    say = lambda line: log(WARNING, "fedpeft gate: %s", line)  # noqa: E731
    gate = Middleware(Gate, check=check, remote=remote, say=say)
    own = extensions.get_middleware
    extensions.get_middleware = lambda: (gate, *own())
    return argv


def main() -> None:
    from flwr.superlink.cli.flower_superlink import flower_superlink

    sys.argv = ["flower-superlink", *install_gate(sys.argv[1:])]
    flower_superlink()


if __name__ == "__main__":
    main()
