"""The endpoints file ``state_dir/endpoints.json``: what ``kiln up`` started and where.

Later commands read it back (:meth:`kiln.common.settings.KilnSettings.with_embedded_endpoints`
reads ``nats_url`` and ``database_url``), so they find the same servers and services. Only
its owner reads it (0600): the embedded PostgreSQL's URL holds the superuser's password.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kiln.embedded.private import write_private


@dataclass
class Endpoints:
    """URLs of the backing servers, whether each is embedded, and the services' addresses."""

    nats_url: str
    database_url: str
    embedded: dict[str, bool] = field(default_factory=dict)
    """``{"nats": bool, "postgres": bool}``: which servers ``kiln up`` runs itself."""
    services: dict[str, str] = field(default_factory=dict)
    """Service name -> the address its clients dial."""

    def write(self, path: Path) -> None:
        """Write atomically (a reader never sees half a file), mode 0600: the embedded
        database URL carries its password."""
        path.parent.mkdir(parents=True, exist_ok=True)
        write_private(path, json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> Endpoints | None:
        """The recorded endpoints, or None when the file is missing or unreadable."""
        try:
            raw = json.loads(path.read_text())
            return cls(
                nats_url=str(raw["nats_url"]),
                database_url=str(raw["database_url"]),
                embedded={str(k): bool(v) for k, v in dict(raw.get("embedded", {})).items()},
                services={str(k): str(v) for k, v in dict(raw.get("services", {})).items()},
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None
