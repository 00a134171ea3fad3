"""The operator's side of a SuperLink's Control API, through Flower's ``flwr`` CLI.

Every call (``flwr run``, ``ls``, ``log``, ``stop``, ``supernode register``/``unregister``/
``ls``) runs ``flwr`` with its own ``FLWR_HOME`` holding the connection
(:func:`write_connection`) and, with TLS, a fresh operator token in the CLI's credential
store (:func:`flwr`): ``flwr`` sends it as the bearer of every request, and the SuperLink's
gate (:mod:`fedpeft.flower.superlink`) lets the operator alone through. Enrolment lives
here too: which key got which node id (``enrolled.json``) and which node holds which
client id (``clients.json``, read by the runs' ServerApps), both in the SuperLink's
working directory.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import subprocess
from pathlib import Path

import tomli_w
import yaml

from fedpeft.flower import processes
from fedpeft.flower.operator import Operator, OperatorError, mint_token, write_private
from fedpeft.flower.tls import DeployError, Tls

CONNECTION = "fedpeft"


_OPERATORS: dict[Path, tuple[str, Operator]] = {}  # a flwr home -> (its SuperLink, the operator's credential)


def operator_of(tls: Tls | None) -> Operator | None:
    """The operator's credential that goes with ``tls`` (None without TLS: no credential
    exists, and the SuperLink's Control API answers its own machine only);
    :class:`DeployError` if TLS is on and the credential is missing."""
    if tls is None:
        return None
    if tls.operator is None:
        raise DeployError(
            f"no operator credential: with TLS, enrolling, revoking and submitting runs take the operator's "
            f"key and certificate (`fedpeft certs DIR` writes operator.key and operator.pem beside the CA; "
            f"none beside {tls.ca}); give --operator OPERATOR.key"
        )
    try:
        return Operator.at(tls.operator)
    except OperatorError as err:
        raise DeployError(str(err)) from None


def write_connection(home: Path, superlink: str, tls: Tls | None) -> None:
    """The ``flwr`` CLI's connection to the SuperLink's Control API; with TLS, signed
    by the operator (:func:`flwr` gives each call a fresh token)."""
    home.mkdir(parents=True, exist_ok=True)
    conn: dict = {"address": superlink}
    if tls is None:
        conn["insecure"] = True
    else:
        conn["root-certificates"] = str(tls.ca.resolve())
    (home / "config.toml").write_text(tomli_w.dumps({"superlink": {"default": CONNECTION, CONNECTION: conn}}))
    operator = operator_of(tls)
    if operator is not None:
        _OPERATORS[home.resolve()] = (superlink, operator)


def sign_in(home: Path) -> None:
    """A fresh operator token in the ``flwr`` CLI's credential store of ``home`` (it sends
    it as the bearer of every Control API request), when ``home`` has an operator. The
    store is readable by its owner alone, and :func:`sign_out` removes it once the call
    that needed it is over."""
    if (signed := _OPERATORS.get(home.resolve())) is None:
        return
    superlink, operator = signed
    token = mint_token(operator)
    b64 = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731 - the store's encoding
    store = {
        f"flower.account-auth.{superlink}.authn-type": b64("oidc"),  # the CLI's bearer-token plugin
        f"flower.account-auth.{superlink}.oidc-access-token": b64(token),
        f"flower.account-auth.{superlink}.oidc-refresh-token": b64("none"),
    }
    write_private(home / "credentials.yaml", yaml.safe_dump(store).encode())


def sign_out(home: Path) -> None:
    """No operator token left on disk in ``home``."""
    (home / "credentials.yaml").unlink(missing_ok=True)


def flwr(
    home: Path, *args: str, check: bool = True, timeout: float | None = None
) -> subprocess.CompletedProcess:
    """``flwr ARGS`` with ``home``'s connection, signed for this call alone."""
    sign_in(home)
    try:
        proc = subprocess.run(
            [processes.script("flwr"), *args],
            env=processes.flower_env(home),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    finally:
        sign_out(home)
    if check and proc.returncode != 0:
        said = proc.stderr[-1500:] or proc.stdout[-1500:]
        raise DeployError(f"flwr {' '.join(args[:2])} failed ({proc.returncode}): {said}")
    return proc


# ---------------------------------------------------------------- enrolment
def enrol(
    superlink: str,
    public_key: Path,
    tls: Tls,
    workdir: Path,
    name: str | None = None,
    client: int | None = None,
) -> int:
    """Register a node's public key with the authenticating SuperLink whose Control API
    is at ``superlink`` (``flwr supernode register``); returns the node id it will hold.
    A node whose key is not enrolled is refused when it connects. ``client``: the client
    id this node is to hold (the operator's assignment, ``workdir/clients.json``: it
    overrides whichever node claimed that id first)."""
    path = Path(public_key).expanduser().resolve()
    if not path.is_file():
        raise DeployError(f"{public_key}: no such public key file")
    named = ["--name", name] if name else []
    reply = _supernode(superlink, tls, workdir, f"enrolling {public_key}", "register", str(path), *named)
    node = int(reply["node-id"])
    registry = _registry(workdir)
    registry.write_text(json.dumps({**_enrolled(workdir), str(path): node}, indent=1) + "\n")
    _write_json(node_keys(workdir), {**_read_json(node_keys(workdir)), str(node): fingerprint(path)})
    if client is not None:
        held = {c: n for c, n in _assigned(workdir).items() if n != node}
        _write_json(assignments(workdir), {**held, str(client): node})
    return node


def fingerprint(public_key: Path) -> str:
    """A node's key, as the ServerApps know it: the SHA-256 (hex) of its public key (DER)."""
    from cryptography.hazmat.primitives import serialization

    try:
        key = serialization.load_ssh_public_key(Path(public_key).read_bytes())
    except (ValueError, TypeError) as err:
        raise DeployError(f"{public_key}: not an OpenSSH public key ({err})") from None
    der = key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def node_keys(workdir: Path) -> Path:
    """Which key each node id enrolled from ``workdir`` has (``{"<node id>": "<fingerprint>"}``):
    a member keeps its client id when the same key gets a new node id (a new SuperLink)."""
    return workdir / "nodes.json"


def assignments(workdir: Path) -> Path:
    """Which client id the operator gave which node (``fedpeft enrol --client``), beside
    the SuperLink whose ServerApps read it: ``{"<client id>": <node id>}``."""
    return workdir / "clients.json"


def _assigned(workdir: Path) -> dict[str, int]:
    return _read_json(assignments(workdir))


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _write_json(path: Path, content: dict) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(dict(sorted(content.items(), key=lambda kv: int(kv[0]))), indent=1) + "\n")
    os.replace(tmp, path)  # a ServerApp reading it sees the old file or the new one


def _registry(workdir: Path) -> Path:
    """The node ids this workdir's enrolments got, by public key file: ``fedpeft revoke KEY.pub``."""
    return workdir / "enrolled.json"


def _enrolled(workdir: Path) -> dict[str, int]:
    path = _registry(workdir)
    return json.loads(path.read_text()) if path.is_file() else {}


def enrolled_node(public_key: Path, workdir: Path) -> int:
    """The node id ``public_key`` was enrolled as (from ``workdir``); :class:`DeployError` if none."""
    path = str(Path(public_key).expanduser().resolve())
    known = _enrolled(workdir)
    if path not in known:
        raise DeployError(
            f"{public_key}: not enrolled from {workdir} (its enrolled.json); revoke by the node id "
            "`fedpeft enrol` printed"
        )
    return known[path]


def revoke(superlink: str, node_id: int, tls: Tls, workdir: Path) -> None:
    """Unregister node ``node_id`` (``flwr supernode unregister``): the SuperLink refuses
    it from its next request on; a run goes on with the other nodes."""
    _supernode(superlink, tls, workdir, f"revoking node {node_id}", "unregister", str(node_id))
    remaining = {k: v for k, v in _enrolled(workdir).items() if v != node_id}
    if _registry(workdir).is_file():
        _registry(workdir).write_text(json.dumps(remaining, indent=1) + "\n")
    if assignments(workdir).is_file():  # the client ids it held are free again
        _write_json(assignments(workdir), {c: n for c, n in _assigned(workdir).items() if n != node_id})


def _supernode(
    superlink: str, tls: Tls, workdir: Path, what: str, command: str, target: str, *options: str
) -> dict:
    """``flwr supernode COMMAND TARGET [OPTIONS]`` against the SuperLink's Control API at
    ``superlink``: its JSON reply, or :class:`DeployError` saying ``what`` failed and why."""
    home = workdir / "home-cli"
    write_connection(home, superlink, tls)
    proc = flwr(home, "supernode", command, target, CONNECTION, *options, "--format", "json", check=False)
    reply = json_tail(proc.stdout)
    if proc.returncode != 0 or not reply.get("success"):
        said = reply.get("error-message") or proc.stderr.strip()[-500:] or proc.stdout.strip()[-500:]
        said = "\n".join(line for line in said.splitlines() if line.strip() and "Using SuperLink" not in line)
        raise DeployError(f"{what} at {superlink}: {said}")
    return reply


def enrolled_nodes(superlink: str, tls: Tls, workdir: Path) -> list[int]:
    """The node ids the SuperLink at ``superlink`` has registered (``flwr supernode ls``)."""
    home = workdir / "home-cli"
    write_connection(home, superlink, tls)
    proc = flwr(home, "supernode", "ls", CONNECTION, "--format", "json", check=False)
    reply = json_tail(proc.stdout)
    if proc.returncode != 0 or not reply.get("success"):
        raise DeployError(f"listing the nodes of {superlink}: {reply.get('error-message') or proc.stderr}")
    gone = ("unregistered", "deleted")
    return sorted(int(node["node-id"]) for node in reply.get("nodes", []) if node.get("status") not in gone)


def json_tail(text: str) -> dict:
    """The JSON object ``flwr ... --format json`` prints last (after any progress lines)."""
    start = text.find("{")
    with contextlib.suppress(json.JSONDecodeError):
        return json.loads(text[start:]) if start >= 0 else {}
    return {}


def run_status(home: Path, run_id: int) -> dict:
    proc = flwr(home, "ls", CONNECTION, "--run-id", str(run_id), "--format", "json", check=False)
    with contextlib.suppress(json.JSONDecodeError, KeyError, IndexError):
        return json.loads(proc.stdout)["runs"][0]
    return {}
