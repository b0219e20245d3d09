"""kiln's configuration, from environment variables (prefix ``KILN_``) and CLI flags.

Every service and the CLI read one :class:`KilnSettings`. When ``KILN_NATS_URL`` or
``KILN_DATABASE_URL`` is unset, the embedded default applies: ``kiln up`` starts NATS and
PostgreSQL under ``state_dir`` and records their URLs in ``state_dir/endpoints.json``, which
:func:`load_settings` reads back so later commands find the same servers.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SERVICE_NAMES = ("ledger", "engine-pool", "agent-runner", "cost-model")
"""The four services, as named on the command line (``kiln serve NAME``)."""

ServiceName = Literal["ledger", "engine-pool", "agent-runner", "cost-model"]

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")

METRICS_PORT_BASE = 9400
"""A service's default metrics port is this plus its 1-based index in ``SERVICE_NAMES``
(ledger 9401, engine-pool 9402, agent-runner 9403, cost-model 9404)."""

_PORTLESS_SCHEMES = ("unix:", "unix-abstract:", "vsock:")
"""gRPC address schemes that name no TCP port (passed through unchecked)."""


def check_port(port: int, *, allow_zero: bool = False, what: str = "port") -> int:
    """``port`` when it is a TCP port (1..65535, or 0 when ``allow_zero``); else ValueError."""
    low = 0 if allow_zero else 1
    if not low <= port <= 65535:
        raise ValueError(f"{what} {port} is out of range {low}..65535")
    return port


def split_host_port(addr: str, *, allow_zero: bool = False) -> tuple[str, int]:
    """Host and port of a gRPC address ``HOST:PORT`` or ``[IPV6]:PORT`` (a ``dns:///``,
    ``ipv4:`` or ``ipv6:`` prefix is dropped); the port must be 1..65535 (0 too when
    ``allow_zero``: an ephemeral port to bind). Raises ValueError with a readable reason.
    """
    rest = addr.strip()
    if rest.startswith("dns:"):
        rest = rest[len("dns:") :]
        if rest.startswith("//"):  # dns://[authority]/host:port
            rest = rest[2:].split("/", 1)[-1]
    elif rest.startswith(("ipv4:", "ipv6:")):
        rest = rest[len("ipv4:") :]
    host, sep, port_text = rest.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {addr!r}")
    return host, check_port(int(port_text), allow_zero=allow_zero)


def check_addr(addr: str, *, allow_zero: bool = False) -> str:
    """``addr`` when it is a usable gRPC address (see :func:`split_host_port`; ``unix:`` and
    other port-less schemes pass as they are); else ValueError."""
    if addr.startswith(_PORTLESS_SCHEMES):
        return addr
    split_host_port(addr, allow_zero=allow_zero)
    return addr.strip()


class KilnSettings(BaseSettings):
    """All settings; each field maps to ``KILN_<FIELD>`` in upper case."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    # --- identity ----------------------------------------------------------------------
    team: str = Field("default", description="Team identity sent on every call the CLI makes.")

    # --- security (docs/design/security.md; kiln.common.tls, kiln.common.policy) -----------
    tls: Literal["on", "off"] = Field("on", description="off: plaintext, no identities, no policy.")
    tls_ca_file: Path | None = Field(None, description="CA certificate (PEM); unset = by role.")
    tls_cert_file: Path | None = Field(None, description="This process's certificate (PEM).")
    tls_key_file: Path | None = Field(None, description="Its private key (PEM).")
    pki_dir: Path | None = Field(None, description="Material by role; unset = state_dir/pki.")
    operator: str | None = Field(None, description="Operator identity of operator commands.")
    cross_team_reads: bool = Field(False, description="Teams read other teams' records.")
    policy_file: Path | None = Field(None, description="TOML policy overriding the defaults.")

    # --- backing servers ------------------------------------------------------------------
    nats_url: str | None = Field(None, description="NATS server URL; unset = embedded default.")
    database_url: str | None = Field(
        None,
        description="SQLAlchemy URL, e.g. postgresql+psycopg://user@host:5432/kiln; "
        "unset = embedded default.",
    )
    state_dir: Path = Field(Path.home() / ".kiln", description="Embedded servers' data and logs.")
    embedded_nats_port: int = 14222
    embedded_postgres_port: int = 15432

    # --- NATS credentials (docs/design/security.md, "NATS") -------------------------------
    nats_user: str | None = Field(
        None,
        description="NATS user; unset = the `cli` user of `kiln up`'s NATS, else none (an open "
        "server, as CI's).",
    )
    nats_password: SecretStr | None = Field(None, description="The NATS user's password.")
    nats_password_file: Path | None = Field(
        None,
        description="File holding the NATS user's password (what `kiln up` gives its services, "
        "so no secret sits in their environment).",
    )

    # --- NATS naming (tests use a private prefix to share one server) --------------------
    subject_prefix: str = Field(
        "kiln", description="First token of every NATS subject and prefix of stream names."
    )

    # --- service addresses (clients dial these; a service listens on its own by default) --
    ledger_addr: str = "127.0.0.1:50051"
    engine_pool_addr: str = "127.0.0.1:50052"
    agent_runner_addr: str = "127.0.0.1:50053"
    cost_model_addr: str = "127.0.0.1:50054"
    listen_addr: str | None = Field(
        None,
        description="Address a service binds; unset = its *_addr (use 0.0.0.0:PORT in containers).",
    )
    metrics_port: int | None = Field(
        None,
        description="Prometheus /metrics port; unset = ledger 9401, engine-pool 9402, "
        "agent-runner 9403, cost-model 9404; 0 = off. Bound on the host of the listen address.",
    )

    # --- runtime ------------------------------------------------------------------------
    log_level: str = "info"
    log_format: Literal["json", "console"] = "json"
    grace_period_s: float = Field(10.0, description="Seconds in-flight RPCs get on shutdown.")
    max_event_bytes: int = Field(
        1 << 20, description="Largest accepted event payload, bytes (JSON, UTF-8)."
    )
    read_page_size: int = Field(1000, description="Default page size of ledger reads and queries.")
    poll_interval_s: float = Field(
        0.2, description="How often followers poll when no notification arrives, seconds."
    )
    max_follows_per_caller: int = Field(
        32,
        ge=1,
        description="Open follows (Ledger.ReadAll with follow, Compiler.Watch) one team or "
        "operator may hold per service process; more are RESOURCE_EXHAUSTED.",
    )

    @field_validator("subject_prefix")
    @classmethod
    def _check_prefix(cls, v: str) -> str:
        if not _PREFIX_RE.match(v):
            raise ValueError("subject_prefix must match [a-z][a-z0-9_]{0,31}")
        return v

    @field_validator("ledger_addr", "engine_pool_addr", "agent_runner_addr", "cost_model_addr")
    @classmethod
    def _check_service_addr(cls, v: str) -> str:
        return check_addr(v)

    @field_validator("listen_addr")
    @classmethod
    def _check_listen_addr(cls, v: str | None) -> str | None:
        return None if v is None else check_addr(v, allow_zero=True)  # 0 = an ephemeral port

    @field_validator("metrics_port", "embedded_nats_port", "embedded_postgres_port")
    @classmethod
    def _check_ports(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is None:
            return None
        return check_port(v, allow_zero=info.field_name == "metrics_port")  # 0 = off

    # ------------------------------------------------------------------------------------
    def service_addr(self, service: ServiceName) -> str:
        """The address clients dial for ``service``."""
        return str(getattr(self, service.replace("-", "_") + "_addr"))

    def service_metrics_port(self, service: ServiceName) -> int:
        """The metrics port of ``service`` (0 = disabled)."""
        if self.metrics_port is not None:
            return self.metrics_port
        return METRICS_PORT_BASE + SERVICE_NAMES.index(service) + 1

    @property
    def pki_path(self) -> Path:
        """Where certificates are looked up by role and issued (``pki_dir`` or state_dir/pki)."""
        return self.pki_dir or self.state_dir / "pki"

    @property
    def endpoints_file(self) -> Path:
        """Where ``kiln up`` records the embedded servers' URLs."""
        return self.state_dir / "endpoints.json"

    def with_embedded_endpoints(self) -> KilnSettings:
        """Fill unset URLs from a running embedded default's endpoints file, if any."""
        if self.nats_url and self.database_url:
            return self
        try:
            recorded = json.loads(self.endpoints_file.read_text())
        except (OSError, ValueError):
            return self
        update = {}
        if not self.nats_url and recorded.get("nats_url"):
            update["nats_url"] = recorded["nats_url"]
        if not self.database_url and recorded.get("database_url"):
            update["database_url"] = recorded["database_url"]
        return self.model_copy(update=update)

    def require_database_url(self) -> str:
        """The database URL; raises RuntimeError with a hint when none is configured."""
        url = self.with_embedded_endpoints().database_url
        if not url:
            raise RuntimeError(
                "no database: set KILN_DATABASE_URL or start the embedded default with `kiln up`"
            )
        return url

    def nats_credentials(self) -> tuple[str, str] | None:
        """(user, password) for NATS: ``nats_user`` with ``nats_password`` or the first line of
        ``nats_password_file``; with neither set, the `cli` user that `kiln up` generated when
        the NATS in use is the embedded one it records (``state_dir/nats/credentials/cli``);
        else None (connect without credentials).

        Raises:
            RuntimeError: a user without a password (or the reverse), or an unreadable file.
        """
        password_given = self.nats_password is not None or self.nats_password_file is not None
        if self.nats_user is None:
            if password_given:
                raise RuntimeError("KILN_NATS_PASSWORD(_FILE) is set but KILN_NATS_USER is not")
            return self._embedded_cli_credentials()
        if self.nats_password is not None:
            return self.nats_user, self.nats_password.get_secret_value()
        if self.nats_password_file is None:
            raise RuntimeError(
                f"KILN_NATS_USER={self.nats_user} needs KILN_NATS_PASSWORD or "
                "KILN_NATS_PASSWORD_FILE"
            )
        return self.nats_user, _read_secret(self.nats_password_file, "KILN_NATS_PASSWORD_FILE")

    def _embedded_cli_credentials(self) -> tuple[str, str] | None:
        path = self.state_dir / NATS_CREDENTIALS_DIR / "cli"
        try:
            recorded = json.loads(self.endpoints_file.read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(recorded, dict) or not dict(recorded.get("embedded") or {}).get("nats"):
            return None
        url = self.with_embedded_endpoints().nats_url
        if url != recorded.get("nats_url") or not path.is_file():
            return None
        return "cli", _read_secret(path, "the embedded NATS's cli credentials")

    def require_nats_url(self) -> str:
        """The NATS URL; raises RuntimeError with a hint when none is configured."""
        url = self.with_embedded_endpoints().nats_url
        if not url:
            raise RuntimeError(
                "no NATS: set KILN_NATS_URL or start the embedded default with `kiln up`"
            )
        return url


NATS_CREDENTIALS_DIR = Path("nats") / "credentials"
"""Where `kiln up` keeps the embedded NATS's passwords, under ``state_dir``: one file per user
(mode 0600), named after the user."""


def _read_secret(path: Path, what: str) -> str:
    """The first line of ``path``; RuntimeError naming ``what`` when unreadable or empty."""
    try:
        lines = Path(path).expanduser().read_text().splitlines()
    except OSError as exc:
        raise RuntimeError(f"cannot read {what} ({path}): {exc.strerror or exc}") from None
    if not lines or not lines[0].strip():
        raise RuntimeError(f"{what} ({path}) is empty")
    return lines[0].strip()


def load_settings(**overrides: object) -> KilnSettings:
    """Settings from the environment, then ``overrides`` (CLI flags; None values ignored)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return KilnSettings(**given)  # type: ignore[arg-type]
