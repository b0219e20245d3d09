"""The base of every event payload schema and the table its subclasses fill: (type, schema
version) -> pydantic model. Read the table through :mod:`kiln.events.registry`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class EventSchema(BaseModel):
    """Base of every payload schema; subclasses set ``event_type``, ``schema_version`` and
    ``category`` and are registered in :data:`SCHEMAS` by being defined (``kiln.events.types``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    event_type: ClassVar[str]
    schema_version: ClassVar[int] = 1
    category: ClassVar[str]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "event_type" in cls.__dict__:
            SCHEMAS.setdefault(cls.event_type, {})[cls.schema_version] = cls

    def to_json(self) -> bytes:
        """The payload as compact UTF-8 JSON."""
        return self.model_dump_json().encode()


SCHEMAS: dict[str, dict[int, type[EventSchema]]] = {}
"""Event type -> schema version -> payload model, of every subclass defined so far."""
