"""Transport security of kiln's gRPC: which certificate a process presents, and gRPC credentials
made from it (docs/design/security.md, "Identity").

A process has one role: a service presents ``services/<name>``, the CLI ``teams/<KILN_TEAM>`` or,
for operator commands, ``operators/<KILN_OPERATOR>``, all under ``settings.pki_path``. Explicit
files (``KILN_TLS_CA_FILE``, ``KILN_TLS_CERT_FILE``, ``KILN_TLS_KEY_FILE``) replace the role's.
``KILN_TLS=off`` gives None everywhere: plaintext, no identities, no policy (development only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from kiln.common.errors import Unauthenticated
from kiln.common.identity import Principal
from kiln.common.logging import get_logger
from kiln.common.pki import CA_CERT, CERT, KEY, PkiError, certificate_principal, identity_dir
from kiln.common.settings import KilnSettings

log = get_logger("kiln.tls")

INSECURE_WARNING = (
    "KILN_TLS=off: plaintext gRPC, no verified identities, no authorization policy; the "
    "kiln-team header is trusted as sent (development only)"
)


class TlsUnavailable(Unauthenticated):
    """No usable certificate for this process's role; the message names the files and the fix.
    A :class:`~kiln.common.errors.Unauthenticated`, so a client without credentials fails as the
    server would refuse it."""


@dataclass(frozen=True)
class TlsMaterial:
    """A CA and one identity's certificate and key, PEM; ``origin`` says where they came from."""

    ca: bytes
    cert: bytes
    key: bytes
    origin: str

    @property
    def principal(self) -> Principal:
        """The principal the certificate names (TlsUnavailable when it names none)."""
        try:
            return certificate_principal(x509.load_pem_x509_certificate(self.cert))
        except (PkiError, ValueError) as exc:
            raise TlsUnavailable(f"{self.origin}: {exc}") from None

    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials requiring a client certificate signed by the CA."""
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Channel credentials presenting the certificate and verifying the server by the CA."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def load_material(ca_file: Path, cert_file: Path, key_file: Path, fix: str) -> TlsMaterial:
    """Read the three PEM files. Raises TlsUnavailable naming a missing file and ``fix``."""
    parts = []
    for path in (ca_file, cert_file, key_file):
        try:
            parts.append(path.read_bytes())
        except OSError as exc:
            raise TlsUnavailable(f"cannot read {path} ({exc.strerror or exc}): {fix}") from None
    ca, cert, key = parts
    return TlsMaterial(ca, cert, key, origin=str(cert_file))


def _explicit(settings: KilnSettings) -> tuple[Path, Path, Path] | None:
    files = (settings.tls_ca_file, settings.tls_cert_file, settings.tls_key_file)
    if not any(files):
        return None
    if not all(files):
        raise TlsUnavailable(
            "set all of KILN_TLS_CA_FILE, KILN_TLS_CERT_FILE and KILN_TLS_KEY_FILE, or none"
        )
    return files  # type: ignore[return-value]


def material_for(settings: KilnSettings, principal: Principal) -> TlsMaterial | None:
    """What a process acting as ``principal`` presents: None with ``KILN_TLS=off``, the explicit
    files when set, else ``principal``'s directory under ``settings.pki_path``.

    Raises:
        TlsUnavailable: a file is missing or unreadable (the message names the fix).
    """
    if settings.tls == "off":
        return None
    explicit = _explicit(settings)
    if explicit is not None:
        return load_material(*explicit, fix="check KILN_TLS_CA_FILE/CERT_FILE/KEY_FILE")
    path = identity_dir(settings.pki_path, principal)
    issue = {"service": "--service", "team": "--team", "operator": "--operator"}[principal.kind]
    fix = (
        f"no credentials for {principal.uri}; run `kiln up` (the embedded default issues them) "
        f"or `kiln credentials issue {issue} {principal.name}`, set KILN_TLS_CA_FILE, "
        "KILN_TLS_CERT_FILE and KILN_TLS_KEY_FILE, or KILN_TLS=off for development"
    )
    return load_material(path / CA_CERT, path / CERT, path / KEY, fix)


def client_principal(settings: KilnSettings, operator: str | None = None) -> Principal:
    """The CLI's principal: the operator ``operator`` (or ``KILN_OPERATOR``) if one is named,
    else the team ``KILN_TEAM``."""
    name = operator or settings.operator
    return Principal("operator", name) if name else Principal("team", settings.team)


def client_material(settings: KilnSettings, operator: str | None = None) -> TlsMaterial | None:
    """:func:`material_for` the CLI's principal (:func:`client_principal`)."""
    return material_for(settings, client_principal(settings, operator))


def warn_if_insecure(settings: KilnSettings, who: str) -> None:
    """Log :data:`INSECURE_WARNING` when TLS is off."""
    if settings.tls == "off":
        log.warning(INSECURE_WARNING, process=who)
