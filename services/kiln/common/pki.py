"""The deployment's certificate authority and the certificates it issues (docs/design/security.md).

Layout of a PKI directory (``KILN_PKI_DIR``, default ``KILN_STATE_DIR/pki``)::

    ca.pem  ca.key                     the CA (EC P-256, ~10 years; the key mode 0600)
    services/<name>/  teams/<name>/  operators/<name>/
        ca.pem  cert.pem  key.pem      one identity: the CA, its certificate, its key (0600)

A leaf certificate (EC P-256, :data:`LEAF_DAYS` days) names its principal in one SAN URI,
``spiffe://kiln/<kind>/<name>``; a service's also carries the DNS names and IP addresses its
clients dial (:data:`SERVICE_HOSTS` plus its compose name and any given), so clients verify the
server too. Team and operator certificates are for clients only (extended key usage clientAuth).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import tempfile
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kiln.common.identity import Principal, PrincipalKind, parse_principal
from kiln.common.settings import SERVICE_NAMES, KilnSettings, ServiceName, split_host_port

CA_DAYS = 3650
"""Validity of the CA certificate, days."""
LEAF_DAYS = 397
"""Validity of a leaf certificate, days (about a year, the longest browsers accept)."""
SERVICE_HOSTS = ("localhost", "127.0.0.1", "::1")
"""Names every service certificate carries, besides its own service name (the host name
docker-compose gives it)."""

KIND_DIRS: dict[PrincipalKind, str] = {
    "team": "teams",
    "service": "services",
    "operator": "operators",
}
CA_CERT, CA_KEY = "ca.pem", "ca.key"
CERT, KEY = "cert.pem", "key.pem"


class PkiError(RuntimeError):
    """Missing or unusable PKI material; the message names the path and the fix."""


@dataclass(frozen=True)
class Issued:
    """One identity's certificate as found on disk (or just written)."""

    principal: Principal
    path: Path
    """Its directory (``ca.pem``, ``cert.pem``, ``key.pem``)."""
    not_after: dt.datetime
    serial: int
    hosts: tuple[str, ...]
    """The DNS names and IP addresses it is valid for as a server (empty for clients)."""


def identity_dir(pki_dir: Path, principal: Principal) -> Path:
    """Where ``principal``'s material lives under ``pki_dir``."""
    return pki_dir / KIND_DIRS[principal.kind] / principal.name


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` atomically with ``mode`` (a reader never sees half a key)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _san_entries(principal: Principal, hosts: Iterable[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(principal.uri)]
    for host in dict.fromkeys(hosts):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def certificate_principal(cert: x509.Certificate) -> Principal:
    """The principal of the one ``spiffe://kiln/`` SAN URI of ``cert``; PkiError otherwise."""
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise PkiError("certificate has no subject alternative names") from None
    uris = [u for u in san.get_values_for_type(x509.UniformResourceIdentifier)]
    found = []
    for uri in uris:
        try:
            found.append(parse_principal(uri))
        except ValueError:
            continue
    if len(found) != 1:
        raise PkiError(f"certificate names {len(found)} kiln principals (SAN URIs {uris}), not 1")
    return found[0]


def _hosts(cert: x509.Certificate) -> tuple[str, ...]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = san.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    return (*dns, *ips)


def describe(path: Path) -> Issued:
    """The identity whose ``cert.pem`` is in directory ``path``; PkiError when unreadable."""
    try:
        cert = x509.load_pem_x509_certificate((path / CERT).read_bytes())
    except (OSError, ValueError) as exc:
        raise PkiError(f"cannot read certificate {path / CERT}: {exc}") from None
    return Issued(
        certificate_principal(cert),
        path,
        cert.not_valid_after_utc,
        cert.serial_number,
        _hosts(cert),
    )


class CertificateAuthority:
    """The CA under ``pki_dir``: issue and list identities. Build with :meth:`open` or
    :meth:`open_or_create`."""

    def __init__(self, pki_dir: Path, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey):
        self.pki_dir = pki_dir
        self.cert = cert
        self._key = key

    @classmethod
    def open(cls, pki_dir: Path) -> CertificateAuthority:
        """The existing CA. Raises PkiError (naming the fix) when it is missing or unreadable."""
        try:
            cert = x509.load_pem_x509_certificate((pki_dir / CA_CERT).read_bytes())
            key = serialization.load_pem_private_key((pki_dir / CA_KEY).read_bytes(), None)
        except FileNotFoundError:
            raise PkiError(
                f"no CA in {pki_dir}: run `kiln up` (the embedded default creates it) or "
                f"`kiln credentials init`, or set KILN_PKI_DIR to the deployment's PKI"
            ) from None
        except (OSError, ValueError) as exc:
            raise PkiError(f"cannot read the CA in {pki_dir}: {exc}") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(f"{pki_dir / CA_KEY} is not an EC private key")
        return cls(pki_dir, cert, key)

    @classmethod
    def open_or_create(cls, pki_dir: Path) -> CertificateAuthority:
        """The CA of ``pki_dir``, created first (mode 0700 directory, 0600 key) if absent."""
        if (pki_dir / CA_CERT).exists() or (pki_dir / CA_KEY).exists():
            return cls.open(pki_dir)
        pki_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(pki_dir, 0o700)
        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kiln"),
                x509.NameAttribute(NameOID.COMMON_NAME, f"kiln CA {uuid.uuid4().hex[:8]}"),
            ]
        )
        now = dt.datetime.now(dt.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
            .sign(key, hashes.SHA256())
        )
        _write(pki_dir / CA_KEY, _key_pem(key), 0o600)  # the key first: a cert alone is useless
        _write(pki_dir / CA_CERT, _cert_pem(cert), 0o644)
        return cls(pki_dir, cert, key)

    @property
    def ca_pem(self) -> bytes:
        """The CA certificate, PEM."""
        return _cert_pem(self.cert)

    def issue(
        self, principal: Principal, hosts: Sequence[str] = (), out_dir: Path | None = None
    ) -> Issued:
        """Issue (or re-issue) ``principal``'s certificate with a new key into ``out_dir``
        (default its directory under the PKI). A service's certificate carries
        :data:`SERVICE_HOSTS`, its own name and ``hosts``; others carry only the URI.
        """
        key = ec.generate_private_key(ec.SECP256R1())
        server = principal.kind == "service"
        names = [*SERVICE_HOSTS, principal.name, *hosts] if server else []
        usages = [ExtendedKeyUsageOID.CLIENT_AUTH]
        if server:
            usages.insert(0, ExtendedKeyUsageOID.SERVER_AUTH)
        now = dt.datetime.now(dt.UTC)
        ca_public = self.cert.public_key()
        assert isinstance(ca_public, ec.EllipticCurvePublicKey)
        cert = (
            x509.CertificateBuilder()
            .subject_name(
                x509.Name(
                    [
                        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kiln"),
                        x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, principal.kind),
                        x509.NameAttribute(NameOID.COMMON_NAME, principal.name),
                    ]
                )
            )
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(x509.SubjectAlternativeName(_san_entries(principal, names)), False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public), critical=False
            )
            .sign(self._key, hashes.SHA256())
        )
        path = out_dir or identity_dir(self.pki_dir, principal)
        _write(path / KEY, _key_pem(key), 0o600)
        _write(path / CERT, _cert_pem(cert), 0o644)
        _write(path / CA_CERT, self.ca_pem, 0o644)
        return describe(path)

    def valid_here(self, path: Path) -> bool:
        """Whether ``path`` holds a key and a certificate of this CA that has not expired."""
        try:
            cert = x509.load_pem_x509_certificate((path / CERT).read_bytes())
            cert.verify_directly_issued_by(self.cert)
        except (OSError, ValueError, TypeError, InvalidSignature):
            return False
        return (path / KEY).exists() and cert.not_valid_after_utc > dt.datetime.now(dt.UTC)

    def ensure(self, principal: Principal, hosts: Sequence[str] = ()) -> Issued | None:
        """Issue ``principal``'s certificate unless a valid one of this CA is there; the issued
        one, or None when the existing material was kept."""
        if self.valid_here(identity_dir(self.pki_dir, principal)):
            return None
        return self.issue(principal, hosts)

    def identities(self) -> list[Issued]:
        """Every identity under the PKI directory, by kind then name (unreadable ones skipped)."""
        found = []
        for kind_dir in KIND_DIRS.values():
            for path in sorted((self.pki_dir / kind_dir).glob("*/")):
                try:
                    found.append(describe(path))
                except PkiError:
                    continue
        return found


def ensure_deployment(
    pki_dir: Path,
    services: Sequence[str],
    *,
    teams: Sequence[str] = ("default",),
    operators: Sequence[str] = ("admin",),
    hosts: dict[str, Sequence[str]] | None = None,
) -> list[Issued]:
    """The CA and one certificate per service, team and operator named, created where missing
    (existing valid material is kept); ``hosts`` adds server names per service. Returns what was
    issued now.
    """
    ca = CertificateAuthority.open_or_create(pki_dir)
    wanted = [
        *(Principal("service", s) for s in services),
        *(Principal("team", t) for t in teams),
        *(Principal("operator", o) for o in operators),
    ]
    extra = hosts or {}
    issued = [ca.ensure(p, extra.get(p.name, ()) if p.kind == "service" else ()) for p in wanted]
    return [i for i in issued if i is not None]


_WILDCARDS = ("0.0.0.0", "::", "*", "")


def ensure_pki(settings: KilnSettings) -> list[Issued]:
    """What ``kiln up`` needs (:func:`ensure_deployment` under ``settings.pki_path``): the four
    services (each also valid for the host of its configured address), the team
    ``settings.team`` and the operator ``settings.operator`` (default ``admin``). Nothing with
    TLS off."""
    if settings.tls == "off":
        return []
    hosts: dict[str, Sequence[str]] = {}
    for name in SERVICE_NAMES:
        try:
            host, _ = split_host_port(settings.service_addr(cast(ServiceName, name)))
        except ValueError:  # unix: and other port-less addresses
            continue
        if host not in _WILDCARDS:
            hosts[name] = (host,)
    return ensure_deployment(
        settings.pki_path,
        SERVICE_NAMES,
        teams=(settings.team,),
        operators=(settings.operator or "admin",),
        hosts=hosts,
    )
