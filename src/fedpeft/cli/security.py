"""Who may take part in a deployment: the TLS options every deployment command shares,
certificates (certs), node key pairs (keys), and a running SuperLink's nodes (enrol,
revoke)."""

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


def tls_setting(ca: Path | None, insecure: bool, cert: Path | None = None, key: Path | None = None):
    """The TLS setting, its paths made absolute (Flower's processes run in other folders)."""
    from fedpeft.flower.tls import DeployError, Tls

    if insecure == (ca is not None):
        fail(ValueError("give either --ca (TLS, the default for a deployment) or --insecure"))
    if insecure:
        for flag, path in (("--cert", cert), ("--key", key)):
            if path is not None:
                fail(ValueError(f"{flag} {path}: a certificate with --insecure; give --ca too, or drop it"))
        return None
    tls = Tls(ca, cert, key)
    try:
        tls.check()
    except DeployError as err:
        fail(err)
    return tls


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
) -> None:
    """Make a local certificate authority and a SuperLink certificate for TLS.

    With --nodes N, also the key pairs nodes sign with: the SuperLink enrols the .pub
    files, node i joins with --key OUT/nodes/node-<i>.key."""
    from fedpeft.flower.certs import make_certificates, make_node_keys

    for name, path in make_certificates(out, host).items():
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
    workdir: RegistryOpt = Path("runs/superlink"),
) -> None:
    """Admit a node to a running SuperLink that authenticates nodes.

    Prints the node id it will hold, which 'fedpeft revoke' takes (or the key file)."""
    from fedpeft.flower import deploy

    tls = tls_setting(ca, False)
    try:
        node = deploy.enrol(superlink, public_key, tls, workdir.resolve(), name=public_key.stem)
    except deploy.DeployError as err:
        fail(err)
    common.console.print(f"enrolled {public_key} as node {node}", soft_wrap=True)


@app.command()
def revoke(
    node: Annotated[str, typer.Argument(help="The node: the public key file enrolled, or its node id.")],
    superlink: LinkOpt,
    ca: CaOpt = None,
    workdir: RegistryOpt = Path("runs/superlink"),
) -> None:
    """Remove a node from a running SuperLink: it is refused from its next request on, and
    runs go on with the other nodes."""
    from fedpeft.flower import deploy

    tls = tls_setting(ca, False)
    work = workdir.resolve()
    try:
        node_id = int(node) if node.isdigit() else deploy.enrolled_node(Path(node), work)
        deploy.revoke(superlink, node_id, tls, work)
    except deploy.DeployError as err:
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
