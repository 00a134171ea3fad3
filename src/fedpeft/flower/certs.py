"""A local certificate authority for a deployment's TLS (``fedpeft certs``).

Writes ``ca.crt``/``ca.key`` (the CA every node trusts), ``server.pem``/``server.key``
(the SuperLink's certificate, valid for the given host names and IP addresses) and
``operator.pem``/``operator.key`` (the operator's credential: enrolling, revoking, submitting
runs; :mod:`fedpeft.flower.operator`). Private keys are readable by their owner alone from
the moment they exist, and an existing CA is never replaced unless asked: every node
trusts it. An organisation with its own PKI uses its own certificates instead; these are
for trying a deployment and for closed networks.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from fedpeft.flower.operator import issue_operator, write_private


class CertificateError(FileExistsError):
    """A certificate authority that would be replaced without being asked to."""


def _key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _write_key(key: rsa.RSAPrivateKey, path: Path) -> None:
    write_private(
        path,
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
    )


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def make_certificates(
    out: Path, hosts: list[str], days: int = 365, *, overwrite_ca: bool = False
) -> dict[str, Path]:
    """A CA, a SuperLink certificate for ``hosts`` and the operator's certificate;
    returns the written paths. :class:`CertificateError` if ``out`` already holds a CA
    key and ``overwrite_ca`` is not set (the nodes trust that CA)."""
    out.mkdir(parents=True, exist_ok=True)
    if (out / "ca.key").exists() and not overwrite_ca:
        raise CertificateError(
            f"{out / 'ca.key'} exists: a new CA would replace the one every node of this deployment "
            "trusts (and lock them out). Give another folder, or --overwrite-ca to replace it"
        )
    now = dt.datetime.now(dt.UTC)
    ca_key, server_key = _key(), _key()
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpeft local CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {name: out / name for name in ("ca.crt", "ca.key", "server.pem", "server.key")}
    paths["ca.crt"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    _write_key(ca_key, paths["ca.key"])
    paths["server.pem"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(server_key, paths["server.key"])
    return paths | issue_operator(out, ca, ca_key, days)


def make_node_keys(out: Path, nodes: list[int] | range) -> dict[int, tuple[Path, Path]]:
    """One elliptic-curve key pair (P-384) per node, for SuperNode authentication: node
    ``i`` signs with ``node-<i>.key`` (OpenSSH private key, readable by its owner only;
    ``fedpeft join --key``) and the SuperLink registers ``node-<i>.pub`` (``fedpeft enrol``).
    Returns ``{i: (private key, public key)}``."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i in nodes:
        key = ec.generate_private_key(ec.SECP384R1())
        private, public = out / f"node-{i}.key", out / f"node-{i}.pub"
        write_private(
            private,
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
            ),
        )
        public.write_bytes(
            key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
            + b"\n"
        )
        paths[i] = (private, public)
    return paths
