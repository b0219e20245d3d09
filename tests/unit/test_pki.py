"""The deployment's CA and its certificates (kiln.common.pki) and how a process finds its own
(kiln.common.tls): real keys and certificates in a temporary directory."""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from kiln.common.identity import Principal
from kiln.common.pki import (
    CertificateAuthority,
    PkiError,
    certificate_principal,
    ensure_deployment,
    ensure_pki,
    identity_dir,
)
from kiln.common.settings import SERVICE_NAMES, KilnSettings
from kiln.common.tls import TlsUnavailable, material_for


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate((path / "cert.pem").read_bytes())


def test_the_ca_is_created_once_with_a_private_key(tmp_path: Path) -> None:
    ca = CertificateAuthority.open_or_create(tmp_path / "pki")
    assert (tmp_path / "pki" / "ca.key").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "pki").stat().st_mode & 0o777 == 0o700
    again = CertificateAuthority.open_or_create(tmp_path / "pki")
    assert again.ca_pem == ca.ca_pem
    constraints = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert constraints.ca and constraints.path_length == 0


def test_a_service_certificate_names_its_principal_and_its_hosts(tmp_path: Path) -> None:
    ca = CertificateAuthority.open_or_create(tmp_path)
    issued = ca.issue(Principal("service", "ledger"), hosts=["ledger.internal", "10.0.0.7"])
    cert = _cert(issued.path)
    cert.verify_directly_issued_by(ca.cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://kiln/service/ledger"
    ]
    assert set(san.get_values_for_type(x509.DNSName)) == {"localhost", "ledger", "ledger.internal"}
    assert set(san.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "10.0.0.7")
    }
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages and ExtendedKeyUsageOID.CLIENT_AUTH in usages
    assert (issued.path / "key.pem").stat().st_mode & 0o777 == 0o600
    assert (issued.path / "ca.pem").read_bytes() == ca.ca_pem
    assert issued.path == identity_dir(tmp_path, Principal("service", "ledger"))


def test_a_team_certificate_is_for_clients_only(tmp_path: Path) -> None:
    ca = CertificateAuthority.open_or_create(tmp_path)
    out = tmp_path / "handed-out"
    issued = ca.issue(Principal("team", "alpha"), out_dir=out)
    assert issued.path == out and issued.hosts == ()
    cert = _cert(out)
    assert certificate_principal(cert) == Principal("team", "alpha")
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert (issued.not_after - cert.not_valid_before_utc).days in range(390, 400)


def test_ensure_keeps_valid_material_and_replaces_a_foreign_one(tmp_path: Path) -> None:
    ca = CertificateAuthority.open_or_create(tmp_path / "pki")
    team = Principal("team", "alpha")
    first = ca.issue(team)
    assert ca.ensure(team) is None  # kept
    assert _cert(first.path).serial_number == first.serial
    other = CertificateAuthority.open_or_create(tmp_path / "other")
    foreign = other.issue(team)
    shutil.copy(foreign.path / "cert.pem", first.path / "cert.pem")
    replaced = ca.ensure(team)
    assert replaced is not None and replaced.serial != foreign.serial
    _cert(first.path).verify_directly_issued_by(ca.cert)


def test_ensure_deployment_issues_what_is_missing_only(tmp_path: Path) -> None:
    issued = ensure_deployment(tmp_path, SERVICE_NAMES, teams=("default",))
    assert {i.principal.uri for i in issued} == {
        *(f"spiffe://kiln/service/{s}" for s in SERVICE_NAMES),
        "spiffe://kiln/team/default",
        "spiffe://kiln/operator/admin",
    }
    (identity_dir(tmp_path, Principal("service", "ledger")) / "cert.pem").unlink()
    again = ensure_deployment(tmp_path, SERVICE_NAMES, teams=("default",))
    assert [i.principal.uri for i in again] == ["spiffe://kiln/service/ledger"]
    listed = CertificateAuthority.open(tmp_path).identities()
    assert len(listed) == len(SERVICE_NAMES) + 2


def test_ensure_pki_follows_the_settings(tmp_path: Path) -> None:
    settings = KilnSettings(
        state_dir=tmp_path,
        pki_dir=None,
        team="ads",
        operator="root",
        ledger_addr="ledger.internal:50051",
        cost_model_addr="0.0.0.0:50054",
    )
    issued = {i.principal.uri: i for i in ensure_pki(settings)}
    assert "spiffe://kiln/team/ads" in issued and "spiffe://kiln/operator/root" in issued
    assert "ledger.internal" in issued["spiffe://kiln/service/ledger"].hosts
    assert "0.0.0.0" not in issued["spiffe://kiln/service/cost-model"].hosts
    assert (tmp_path / "pki" / "ca.pem").is_file()
    assert ensure_pki(settings.model_copy(update={"tls": "off"})) == []


def test_opening_a_missing_ca_names_the_fix(tmp_path: Path) -> None:
    with pytest.raises(PkiError, match=r"kiln up.*kiln credentials init"):
        CertificateAuthority.open(tmp_path)


def test_a_process_finds_its_material_by_role_or_explicit_files(tmp_path: Path) -> None:
    ensure_deployment(tmp_path / "pki", ("ledger",), teams=("alpha",))
    settings = KilnSettings(state_dir=tmp_path, pki_dir=None)
    material = material_for(settings, Principal("service", "ledger"))
    assert material is not None and material.principal == Principal("service", "ledger")
    assert material_for(settings.model_copy(update={"tls": "off"}), material.principal) is None
    with pytest.raises(TlsUnavailable, match="kiln credentials issue --team beta"):
        material_for(settings, Principal("team", "beta"))
    alpha = tmp_path / "pki" / "teams" / "alpha"
    explicit = settings.model_copy(
        update={
            "tls_ca_file": alpha / "ca.pem",
            "tls_cert_file": alpha / "cert.pem",
            "tls_key_file": alpha / "key.pem",
        }
    )
    found = material_for(explicit, Principal("service", "ledger"))  # the files win
    assert found is not None and found.principal == Principal("team", "alpha")
    partial = settings.model_copy(update={"tls_cert_file": alpha / "cert.pem"})
    with pytest.raises(TlsUnavailable, match="all of KILN_TLS_CA_FILE"):
        material_for(partial, Principal("team", "alpha"))


def test_the_credentials_commands(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_STATE_DIR=str(tmp_path), COLUMNS="200")

    def kiln(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kiln", "credentials", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    missing = kiln("issue", "--team", "alpha")
    assert missing.returncode == 1 and "no CA in" in missing.stderr
    assert kiln("init").returncode == 0
    again = kiln("init")
    assert again.returncode == 0 and "every certificate is there already" in again.stdout
    issued = kiln("issue", "--team", "alpha", "--out", str(tmp_path / "alpha"))
    assert issued.returncode == 0, issued.stderr
    assert f"KILN_TLS_CERT_FILE={tmp_path / 'alpha' / 'cert.pem'}" in issued.stdout
    assert certificate_principal(_cert(tmp_path / "alpha")) == Principal("team", "alpha")
    listed = kiln("list")
    assert "spiffe://kiln/operator/admin" in listed.stdout
    assert "spiffe://kiln/service/engine-pool" in listed.stdout
    bad = kiln("issue", "--team", "alpha", "--host", "x")
    assert bad.returncode == 2 and "only a service certificate" in bad.stderr
