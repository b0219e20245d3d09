"""Which ``ServiceApp`` runs under each service name (``kiln serve NAME``).

Imports are lazy, so starting one service never imports the others (nor their dependencies).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from kiln.common.settings import SERVICE_NAMES, KilnSettings

if TYPE_CHECKING:
    from kiln.common.server import ServiceApp

_MODULES = {
    "ledger": "kiln.ledger.app",
    "engine-pool": "kiln.engine_pool.app",
    "agent-runner": "kiln.agent_runner.app",
    "cost-model": "kiln.cost_model.app",
}
assert set(_MODULES) == set(SERVICE_NAMES)


def app_factory(name: str) -> Callable[[KilnSettings], ServiceApp]:
    """The ``create_app(settings)`` of service ``name``, imported on first use.

    Raises:
        ValueError: ``name`` is not one of ``SERVICE_NAMES``.
    """
    module = _MODULES.get(name)
    if module is None:
        raise ValueError(f"unknown service {name!r}: choose one of {', '.join(SERVICE_NAMES)}")

    def create_app(settings: KilnSettings) -> ServiceApp:
        factory = importlib.import_module(module).create_app
        return cast("ServiceApp", factory(settings))

    create_app.__name__ = f"create_{name.replace('-', '_')}_app"
    create_app.__doc__ = f"Import {module} and build its ServiceApp from settings."
    return create_app
