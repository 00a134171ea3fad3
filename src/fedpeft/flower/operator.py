"""The operator of a deployment: who may enrol and revoke nodes and submit runs.

A deployment trusts one certificate authority (``ca.crt``, handed to every node). Holding
that certificate proves nothing: every node has it. The operator holds something a node
does not: an **operator certificate**, issued by the same CA with fedpeft's operator
extended key usage (:data:`OPERATOR_USAGE`), and its private key (``fedpeft certs`` writes
``operator.pem`` and ``operator.key`` beside the CA's files). With it the operator

- **speaks to the Control API**: every request to the SuperLink's Control API carries a
  short-lived bearer token (:func:`mint_token`): the operator certificate, the time it was
  made and a random nonce, signed with the operator key. The SuperLink (started by
  :mod:`fedpeft.flower.superlink`) accepts a request only if the token's certificate
  chains to its own CA, carries the operator usage, is within its validity, and the
  signature holds and is at most :data:`TOKEN_SECONDS` old (:class:`TokenCheck`);
- **signs each run it submits** (:func:`sign_app`): the app's components and run config
  (the whole experiment) signed with the operator key. A node runs an app only if the
  signature holds and the certificate chains to the CA the node was given with ``--ca``
  (:func:`check_app`), so a SuperLink that was reached some other way still cannot make
  the nodes run anything the operator did not send.

The key is elliptic-curve P-256 (ECDSA with SHA-256); the CA may sign with any algorithm
``cryptography`` verifies.
"""

from __future__ import annotations

import base64
import datetime as dt
import io
import json
import os
import secrets
import time
import tomllib
import zipfile
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

#: fedpeft's "operator" extended key usage: an OID under the 2.25 (UUID) arc, which
#: anyone may mint without registration (ITU-T X.667). An organisation whose own PKI
#: issues the operator certificate adds this usage to it.
OPERATOR_USAGE = x509.ObjectIdentifier("2.25.211370883062187905417925813914387341617")
TOKEN_SECONDS = 900  # how long a Control API token is good for (a command mints a new one per call)
CLOCK_SKEW = 120  # seconds a token may come from the future (clocks of two machines)
SIGNATURE_KEY, CERTIFICATE_KEY = "operator-signature", "operator-certificate"
#: what a fedpeft app holds (``deploy.write_app``): its pyproject, and the manifest Flower adds
APP_FILES = {"pyproject.toml", ".info/CONTENT"}
MAX_APP_BYTES = 16 * 2**20  # its pyproject holds the experiment's config: kilobytes, never this
#: the components a fedpeft app may name: fedpeft's own, from the installed package
SERVER_APPS = {"fedpeft.flower.apps:server_app"}
CLIENT_APPS = {"fedpeft.flower.relay:client_app", "fedpeft.flower.apps:client_app"}


class OperatorError(ValueError):
    """A missing or unusable operator credential (on the operator's side)."""


class Untrusted(ValueError):
    """A token or an app that does not come from the deployment's operator."""


# ---------------------------------------------------------------- files
def write_private(path: Path, data: bytes) -> None:
    """Write a secret readable by its owner only from the moment it exists (no window
    in which the file is open to others). An existing file is replaced whole."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _pem_key(key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def issue_operator(out: Path, ca_cert: x509.Certificate, ca_key, days: int = 365) -> dict[str, Path]:
    """``out/operator.pem`` and ``out/operator.key``: a certificate for the operator,
    signed by the CA (``ca_cert``, ``ca_key``), carrying :data:`OPERATOR_USAGE`."""
    now = dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedpeft operator")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(min(now + dt.timedelta(days=days), ca_cert.not_valid_after_utc))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([OPERATOR_USAGE]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = {"operator.pem": out / "operator.pem", "operator.key": out / "operator.key"}
    paths["operator.pem"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(paths["operator.key"], _pem_key(key))
    return paths


@dataclass(frozen=True)
class Operator:
    """The operator's credential: its certificate and private key (PEM files)."""

    cert: Path
    key: Path

    @classmethod
    def at(cls, key: Path) -> Operator:
        """The credential whose key is ``key`` (``operator.key``), with the certificate
        beside it (``operator.pem``); :class:`OperatorError` naming what is missing."""
        key = Path(key).expanduser().resolve()
        cert = key.with_suffix(".pem")
        for what, path in (("operator key", key), ("operator certificate", cert)):
            if not path.is_file():
                raise OperatorError(
                    f"{path}: no such file (the {what}; `fedpeft certs DIR` writes operator.pem and "
                    "operator.key beside the CA, for the operator alone)"
                )
        return cls(cert, key)

    def _loaded(self):
        cert = x509.load_pem_x509_certificate(self.cert.read_bytes())
        try:
            key = serialization.load_pem_private_key(self.key.read_bytes(), password=None)
        except (ValueError, TypeError) as err:
            raise OperatorError(f"{self.key}: not an unencrypted PEM private key ({err})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise OperatorError(f"{self.key}: not the EC private key of {self.cert}")
        return cert, key

    def sign(self, data: bytes) -> tuple[str, str]:
        """(signature, certificate PEM) for ``data``."""
        cert, key = self._loaded()
        signature = key.sign(data, ec.ECDSA(hashes.SHA256()))
        return _b64(signature), cert.public_bytes(serialization.Encoding.PEM).decode()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


# ---------------------------------------------------------------- the check
def check_certificate(pem: str | bytes, ca: x509.Certificate, now: float | None = None) -> x509.Certificate:
    """The operator certificate ``pem`` if ``ca`` issued it, it is valid at ``now`` and
    carries the operator usage; :class:`Untrusted` saying which check failed."""
    try:
        cert = x509.load_pem_x509_certificate(pem.encode() if isinstance(pem, str) else pem)
    except ValueError:
        raise Untrusted("the operator certificate is not a PEM certificate") from None
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        raise Untrusted("the operator certificate was not issued by this deployment's CA") from None
    when = dt.datetime.fromtimestamp(time.time() if now is None else now, dt.UTC)
    if not cert.not_valid_before_utc <= when <= cert.not_valid_after_utc:
        raise Untrusted("the operator certificate is outside its validity")
    try:
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except x509.ExtensionNotFound:
        usages = []
    if OPERATOR_USAGE not in usages:
        raise Untrusted("the certificate is not an operator's (it lacks fedpeft's operator key usage)")
    return cert


def _verify(cert: x509.Certificate, signature: str, data: bytes) -> None:
    key = cert.public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise Untrusted("the operator certificate's key is not an elliptic-curve key")
    try:
        key.verify(_unb64(signature), data, ec.ECDSA(hashes.SHA256()))
    except (InvalidSignature, ValueError):
        raise Untrusted("the signature does not verify with the operator certificate") from None


def load_ca(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(Path(path).read_bytes())


# ---------------------------------------------------------------- Control API tokens
def mint_token(operator: Operator, now: float | None = None) -> str:
    """A bearer token for the Control API: good for :data:`TOKEN_SECONDS`."""
    claims = {"iat": int(time.time() if now is None else now), "nonce": secrets.token_hex(8)}
    body = json.dumps(claims, sort_keys=True).encode()
    signature, cert = operator.sign(b"fedpeft-control\n" + body)
    return ".".join([_b64(body), signature, _b64(cert.encode())])


class TokenCheck:
    """The SuperLink's side: whether a bearer token is the operator's, checked against the
    CA the SuperLink was started with. A token is good for :data:`TOKEN_SECONDS` (one
    ``flwr`` command may make several requests with it); TLS keeps it from onlookers."""

    def __init__(self, ca: x509.Certificate):
        self.ca = ca

    def __call__(self, token: str, now: float | None = None) -> None:
        """Nothing if ``token`` is good; :class:`Untrusted` with the reason otherwise."""
        now = time.time() if now is None else now
        try:
            body_b64, signature, cert_b64 = token.split(".")
            body, cert_pem = _unb64(body_b64), _unb64(cert_b64)
            iat = int(json.loads(body)["iat"])
        except (ValueError, KeyError, TypeError):
            raise Untrusted("the bearer token is not an operator token") from None
        cert = check_certificate(cert_pem, self.ca, now)
        _verify(cert, signature, b"fedpeft-control\n" + body)
        if not now - TOKEN_SECONDS <= iat <= now + CLOCK_SKEW:
            raise Untrusted("the operator token has expired (or the two machines' clocks differ)")


# ---------------------------------------------------------------- signed apps
def _signed_part(app: dict) -> bytes:
    """The bytes a run's signature covers: the app's publisher, components and run
    config (every value, the experiment whole), signature fields left out."""
    flwr = app["tool"]["flwr"]["app"]
    config = {k: v for k, v in flwr.get("config", {}).items() if k not in (SIGNATURE_KEY, CERTIFICATE_KEY)}
    part = {
        "publisher": flwr.get("publisher"),
        "components": flwr.get("components"),
        "config": config,
        "dependencies": app.get("project", {}).get("dependencies"),
    }
    return b"fedpeft-app\n" + json.dumps(part, sort_keys=True, separators=(",", ":")).encode()


def sign_app(app: dict, operator: Operator) -> dict:
    """``app`` (a ``pyproject.toml`` as a dict) with the operator's signature of its
    components and run config in its run config."""
    signature, cert = operator.sign(_signed_part(app))
    config = app["tool"]["flwr"]["app"].setdefault("config", {})
    config.update({SIGNATURE_KEY: signature, CERTIFICATE_KEY: cert})
    return app


def check_app(fab: bytes, ca: x509.Certificate, now: float | None = None) -> dict:
    """The run config of the Flower app ``fab`` (its zip bytes) if it is a fedpeft app
    signed by the deployment's operator; :class:`Untrusted` with the reason otherwise.
    A fedpeft app holds no code (its components are fedpeft's own, imported from the
    installed package): any other file, or another component, is refused."""
    try:
        with zipfile.ZipFile(io.BytesIO(fab)) as z:
            names = set(z.namelist())
            if extra := sorted(names - APP_FILES):
                raise Untrusted(f"the app holds files a fedpeft app does not: {extra[:3]}")
            if (size := z.getinfo("pyproject.toml").file_size) > MAX_APP_BYTES:
                raise Untrusted(f"the app's pyproject.toml unpacks to {size} bytes (at most {MAX_APP_BYTES})")
            app = tomllib.loads(z.read("pyproject.toml").decode())
    except (zipfile.BadZipFile, KeyError, UnicodeDecodeError, tomllib.TOMLDecodeError) as err:
        raise Untrusted(f"the app is not a fedpeft app ({err})") from None
    try:
        flwr = app["tool"]["flwr"]["app"]
        components, config = flwr["components"], flwr.get("config", {})
        signature, cert_pem = config[SIGNATURE_KEY], config[CERTIFICATE_KEY]
    except (KeyError, TypeError):
        raise Untrusted("the app is not signed by an operator") from None
    if components.get("serverapp") not in SERVER_APPS or components.get("clientapp") not in CLIENT_APPS:
        raise Untrusted(f"the app's components are not fedpeft's: {components}")
    cert = check_certificate(cert_pem, ca, now)
    _verify(cert, signature, _signed_part(app))
    return config
