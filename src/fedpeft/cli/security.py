"""Who may take part in a deployment: the TLS options every deployment command shares,
certificates (certs: the CA, the SuperLink's, the operator's), node key pairs (keys), and a
running SuperLink's nodes (enrol, revoke: the operator's alone)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fedpeft.cli import common
from fedpeft.cli.common import fail

app = typer.Typer()

CaOpt = Annotated[Path | None, typer.Option("--ca", help="CA certificate every party trusts (TLS).")]  # noqa: UP007
InsecureOpt = Annotated[
    bool, typer.Option("--insecure", help="Plain HTTP, no TLS (loopback and trials only).")
]
PLAINTEXT_FLAG = "--plaintext-on-network"
PlaintextOpt = Annotated[
    bool,
    typer.Option(
        PLAINTEXT_FLAG,
        help="With --insecure on an address other than loopback: send everything (tensors, configs, "
        "node keys' requests) unencrypted and unauthenticated over the network, to anyone on the path.",
    ),
]
OperatorOpt = Annotated[
    Path | None,  # noqa: UP007
    typer.Option(
        "--operator",
        help="The operator's key (operator.key, with operator.pem beside it, from `fedpeft certs`): "
        "what enrols, revokes and submits runs. Default: operator.key beside --ca.",
    ),
]


def tls_setting(
    ca: Path | None,
    insecure: bool,
    cert: Path | None = None,
    key: Path | None = None,
    operator: Path | None = None,
):
    """The TLS setting, its paths made absolute (Flower's processes run in other folders)."""
    from fedpeft.flower.tls import DeployError, Tls

    if insecure == (ca is not None):
        fail(ValueError("give either --ca (TLS, the default for a deployment) or --insecure"))
    if insecure:
        for flag, path in (("--cert", cert), ("--key", key), ("--operator", operator)):
            if path is not None:
                fail(ValueError(f"{flag} {path}: a certificate with --insecure; give --ca too, or drop it"))
        return None
    if operator is not None and not operator.is_file():
        fail(FileNotFoundError(f"--operator {operator}: no such file"))
    tls = Tls(ca, cert, key, operator)
    try:
        tls.check()
    except DeployError as err:
        fail(err)
    return tls


def plaintext_check(insecure: bool, host: str, plaintext: bool, flag: str) -> None:
    """Refuse --insecure for an address off this machine unless the user said, with
    :data:`PLAINTEXT_FLAG`, that plaintext over the network is what they want."""
    from fedpeft.flower.connect import LOOPBACK

    if insecure and host.strip("[]") not in LOOPBACK and not plaintext:
        fail(
            ValueError(
                f"--insecure with {flag} {host}: without TLS everything crosses the network in the clear "
                "and no node can be authenticated. Use TLS (--ca; `fedpeft certs`), a loopback address "
                f"(127.0.0.1), or add {PLAINTEXT_FLAG} if that is really what you want"
            )
        )


@app.command()
def certs(
    out: Annotated[Path, typer.Argument(help="Directory for ca.crt, ca.key, server.pem, server.key.")],
    host: Annotated[
        list[str],
        typer.Option("--host", help="Name or IP address clients use for the SuperLink (repeatable)."),
    ] = ["127.0.0.1", "localhost"],  # noqa: B006 - typer reads the default, never mutates it
    nodes: Annotated[
        int, typer.Option(min=0, help="Also a key pair per node, OUT/nodes/node-<i>.key and .pub, i < N.")
    ] = 0,
    overwrite_ca: Annotated[
        bool,
        typer.Option(
            "--overwrite-ca",
            help="Replace the CA already in OUT (every node that trusts the old one is locked out).",
        ),
    ] = False,
) -> None:
    """Make a local certificate authority, a SuperLink certificate for TLS and the
    operator's certificate (operator.pem, operator.key: enrolling, revoking and submitting
    runs take it; it stays with the operator, like ca.key).

    With --nodes N, also the key pairs nodes sign with: the SuperLink enrols the .pub
    files, node i joins with --key OUT/nodes/node-<i>.key. A CA already in OUT is kept:
    the command refuses to replace it unless --overwrite-ca."""
    from fedpeft.flower.certs import CertificateError, make_certificates, make_node_keys

    try:
        made = make_certificates(out, host, overwrite_ca=overwrite_ca)
    except CertificateError as err:
        fail(err)
    for name, path in made.items():
        common.console.print(f"{name}: {path}")
    for i, (private, public) in make_node_keys(out / "nodes", range(nodes)).items():
        common.console.print(f"node {i}: {private} (its own), {public} (the SuperLink's)")


LinkOpt = Annotated[str, typer.Option("--superlink", help="The SuperLink's address, HOST:PORT.")]
RegistryOpt = Annotated[
    Path, typer.Option(help="The flwr CLI's files and which key got which node id (the SuperLink's workdir).")
]


@app.command()
def enrol(
    public_key: Annotated[Path, typer.Argument(help="The node's public key (node-<i>.pub).")],
    superlink: LinkOpt,
    ca: CaOpt = None,
    operator: OperatorOpt = None,
    workdir: RegistryOpt = Path("runs/superlink"),
    client: Annotated[
        int | None,  # noqa: UP007
        typer.Option(
            min=0,
            help="The client id this node is to hold: it takes the id from whichever node held it, "
            "and no other node may claim it (default: the first node to claim an id holds it).",
        ),
    ] = None,
) -> None:
    """Admit a node to a running SuperLink that authenticates nodes (the operator's
    credential, --operator, is required: the SuperLink refuses anyone else).

    Prints the node id it will hold, which 'fedpeft revoke' takes (or the key file)."""
    from fedpeft.flower import control

    tls = tls_setting(ca, False, operator=operator)
    try:
        node = control.enrol(
            superlink, public_key, tls, workdir.resolve(), name=public_key.stem, client=client
        )
    except control.DeployError as err:
        fail(err)
    common.console.print(f"enrolled {public_key} as node {node}", soft_wrap=True)


@app.command()
def revoke(
    node: Annotated[str, typer.Argument(help="The node: the public key file enrolled, or its node id.")],
    superlink: LinkOpt,
    ca: CaOpt = None,
    operator: OperatorOpt = None,
    workdir: RegistryOpt = Path("runs/superlink"),
) -> None:
    """Remove a node from a running SuperLink: it is refused from its next request on, and
    runs go on with the other nodes (the operator's credential, --operator, is required);
    the client ids it held are free again."""
    from fedpeft.flower import control

    tls = tls_setting(ca, False, operator=operator)
    work = workdir.resolve()
    try:
        node_id = int(node) if node.isdigit() else control.enrolled_node(Path(node), work)
        control.revoke(superlink, node_id, tls, work)
    except control.DeployError as err:
        fail(err)
    common.console.print(f"revoked node {node_id}", soft_wrap=True)


@app.command()
def keys(
    out: Annotated[Path, typer.Argument(help="Directory for node-<i>.key and node-<i>.pub.")],
    ids: Annotated[list[int], typer.Argument(help="The nodes (client ids) to make a key pair for.")],
) -> None:
    """Make nodes' key pairs for a SuperLink that admits enrolled nodes only.

    Node i joins with --key OUT/node-<i>.key, the SuperLink's operator enrols
    OUT/node-<i>.pub ('fedpeft certs --nodes N' makes those of nodes 0..N-1 too). An
    existing pair is kept."""
    from fedpeft.flower.certs import make_node_keys

    new = [i for i in ids if not (out / f"node-{i}.key").exists()]
    for i in sorted(set(ids) - set(new)):
        common.console.print(f"node {i}: {out / f'node-{i}.key'} exists; kept")
    for i, (private, public) in make_node_keys(out, new).items():
        common.console.print(f"node {i}: {private} (its own), {public} (the SuperLink's)")
