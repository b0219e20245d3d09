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

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

SERVICE_NAMES = ("ledger", "engine-pool", "agent-runner", "cost-model")
"""The four services, as named on the command line (``kiln serve NAME``)."""

ServiceName = Literal["ledger", "engine-pool", "agent-runner", "cost-model"]

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class KilnSettings(BaseSettings):
    """All settings; each field maps to ``KILN_<FIELD>`` in upper case."""

    model_config = SettingsConfigDict(env_prefix="KILN_", extra="ignore")

    # --- identity ----------------------------------------------------------------------
    team: str = Field("default", description="Team identity sent on every call the CLI makes.")

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
        None, description="Prometheus /metrics port; unset = 9400 + the service's index; 0 = off."
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

    @field_validator("subject_prefix")
    @classmethod
    def _check_prefix(cls, v: str) -> str:
        if not _PREFIX_RE.match(v):
            raise ValueError("subject_prefix must match [a-z][a-z0-9_]{0,31}")
        return v

    # ------------------------------------------------------------------------------------
    def service_addr(self, service: ServiceName) -> str:
        """The address clients dial for ``service``."""
        return str(getattr(self, service.replace("-", "_") + "_addr"))

    def service_metrics_port(self, service: ServiceName) -> int:
        """The metrics port of ``service`` (0 = disabled)."""
        if self.metrics_port is not None:
            return self.metrics_port
        return 9400 + SERVICE_NAMES.index(service) + 1

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

    def require_nats_url(self) -> str:
        """The NATS URL; raises RuntimeError with a hint when none is configured."""
        url = self.with_embedded_endpoints().nats_url
        if not url:
            raise RuntimeError(
                "no NATS: set KILN_NATS_URL or start the embedded default with `kiln up`"
            )
        return url


def load_settings(**overrides: object) -> KilnSettings:
    """Settings from the environment, then ``overrides`` (CLI flags; None values ignored)."""
    given = {k: v for k, v in overrides.items() if v is not None}
    return KilnSettings(**given)  # type: ignore[arg-type]
