"""Reaching a SuperLink, and saying plainly why it cannot be reached.

``fedpeft join`` and ``fedpeft serve --superlink`` check the address first
(:func:`probe`: one ``GET /health``, the request Flower's own health check answers) instead
of leaving Flower to retry forever with "Connection attempt failed". A failure is
classified as:

- **lasting** (retrying cannot help): TLS against a plain-HTTP SuperLink or the reverse, a
  certificate the CA does not vouch for or that does not name the host, something other
  than a SuperLink on the port;
- **passing** (worth retrying until ``--max-wait``): nothing listening yet, no answer,
  a host name that does not resolve (yet).

:func:`local_address` is how this machine reaches a SuperLink it started itself: with
TLS the name must be one the certificate is valid for.
"""

from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedpeft.flower.tls import DeployError, Tls

WILDCARDS = ("0.0.0.0", "::", "")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class Problem:
    """Why a SuperLink address does not answer; ``lasting``: retrying cannot help."""

    why: str
    lasting: bool


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT`` for IPv6) -> (host, port); a clear error otherwise."""
    host, colon, port = address.rpartition(":")
    host = host.strip("[]")
    if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise DeployError(f"--superlink {address!r}: expected HOST:PORT, e.g. 127.0.0.1:9092")
    return host, int(port)


def join_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def certificate_names(cert: Path) -> list[str]:
    """The DNS names and IP addresses a certificate is valid for (its subject alternative names)."""
    from cryptography import x509

    loaded = x509.load_pem_x509_certificate(Path(cert).read_bytes())
    try:
        san = loaded.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return [*ips, *san.get_values_for_type(x509.DNSName)]


def local_address(host: str, port: int, tls: Tls | None) -> str:
    """The address this machine uses for a SuperLink it started on ``host:port``.

    A wildcard host (0.0.0.0) is reached on loopback; with TLS, by a name the SuperLink's
    certificate lists (loopback if it lists one, else its first name, e.g. the server's
    own DNS name), because the connection is refused for a name the certificate lacks."""
    if host not in WILDCARDS:
        return join_address(host, port)
    if tls is None or tls.cert is None:
        return join_address("127.0.0.1", port)
    names = certificate_names(tls.cert)
    for name in LOOPBACK:
        if name in names:
            return join_address(name, port)
    return join_address(names[0] if names else "127.0.0.1", port)


def _speaks_tls(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` completes a TLS handshake (certificate not checked)."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw, server_hostname=host),
        ):
            return True
    except (OSError, ssl.SSLError):
        return False


def _speaks_http(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` answers a plain-HTTP request."""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", "/health")
        conn.getresponse()
        return True
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()


def probe(address: str, tls: Tls | None, timeout: float = 5.0) -> Problem | None:
    """None if a Flower SuperLink answers at ``address`` with this TLS setting, else why not."""
    host, port = split_address(address)
    if tls is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection(host, port, timeout=timeout)
    else:
        context = ssl.create_default_context(cafile=str(tls.ca))
        conn = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    try:
        conn.request("GET", "/health")
        status = conn.getresponse().status
    except socket.gaierror as err:
        return Problem(f"the host name {host!r} does not resolve ({err.strerror})", lasting=False)
    except ConnectionRefusedError:
        return Problem("nothing is listening there (connection refused)", lasting=False)
    except TimeoutError:
        return Problem(f"no answer within {timeout:g} s (the wrong host, or a firewall?)", lasting=False)
    except ssl.SSLCertVerificationError as err:
        said = err.verify_message or str(err)
        if "mismatch" in said.lower() or "hostname" in said.lower():
            return Problem(
                f"its TLS certificate is not valid for the name {host!r} ({said}); connect with a name "
                "the certificate lists (fedpeft certs --host NAME)",
                lasting=True,
            )
        return Problem(
            f"its TLS certificate does not verify against --ca {tls.ca if tls else ''} ({said}): is "
            "that the CA that signed the SuperLink's certificate?",
            lasting=True,
        )
    except ssl.SSLError as err:
        if _speaks_http(host, port, timeout):
            return Problem(
                f"it answers without TLS ({err.reason or err}), but --ca was given: that SuperLink "
                "runs with --insecure; use --insecure here too, or restart it with --ca/--cert/--key",
                lasting=True,
            )
        return Problem(f"the TLS handshake failed ({err.reason or err})", lasting=False)
    except (http.client.HTTPException, ConnectionError) as err:
        if tls is None and _speaks_tls(host, port, timeout):
            return Problem(
                "it speaks TLS but --insecure was given: use --ca CA_FILE (the CA certificate that "
                "signed the SuperLink's) instead",
                lasting=True,
            )
        return Problem(f"the connection failed ({type(err).__name__}: {err})", lasting=False)
    except OSError as err:
        return Problem(f"cannot connect ({err.strerror or err})", lasting=False)
    finally:
        conn.close()
    if status != 200:
        return Problem(
            f"something answers there, but not a Flower SuperLink (HTTP {status} at /health)", True
        )
    return None


def wait_for_superlink(
    address: str, tls: Tls | None, max_wait: float, say: Callable[[str], None] = print
) -> None:
    """Return once a SuperLink answers at ``address``; :class:`DeployError` with the address
    and the reason at once for a lasting problem, or after ``max_wait`` seconds."""
    deadline, told = time.monotonic() + max_wait, None
    while True:
        problem = probe(address, tls)
        if problem is None:
            return
        if problem.lasting:
            raise DeployError(f"the SuperLink at {address}: {problem.why}")
        if time.monotonic() >= deadline:
            port = split_address(address)[1]
            raise DeployError(
                f"no SuperLink at {address} after {max_wait:g} s (--max-wait): {problem.why}. "
                f"Is `fedpeft serve` or `fedpeft superlink` running there, with --port {port}?"
            )
        if problem.why != told:
            say(f"waiting for the SuperLink at {address}: {problem.why}; retrying for up to {max_wait:g} s")
            told = problem.why
        time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
