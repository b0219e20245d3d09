"""A service whose RPCs are not built yet, but whose process is real.

Health, reflection, metrics, team identity and graceful shutdown work, so ``kiln serve NAME``,
``kiln up`` and docker-compose run every service now; each RPC answers ``UNIMPLEMENTED`` with a
message that says when it arrives.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

from kiln.common.errors import Unimplemented
from kiln.common.settings import KilnSettings


def _unimplemented_servicer(base: type, service: ServiceDescriptor, arrives: str) -> Any:
    """An instance of ``base`` (a generated Servicer) whose every method raises Unimplemented
    ("<Service>.<Method> is not implemented yet: <arrives>")."""
    methods: dict[str, Any] = {}
    for method in service.methods:
        message = f"{service.name}.{method.name} is not implemented yet: {arrives}"

        if method.server_streaming:

            async def stream(
                self: Any, request: Any, context: Any, _m: str = message
            ) -> AsyncIterator[Any]:
                raise Unimplemented(_m)
                yield  # an async generator, like the generated streaming methods

            methods[method.name] = stream
        else:

            async def unary(self: Any, request: Any, context: Any, _m: str = message) -> Any:
                raise Unimplemented(_m)

            methods[method.name] = unary
    return type(f"Placeholder{base.__name__}", (base,), methods)()


class PlaceholderApp:
    """``ServiceApp`` for a service that is not built yet (always ready).

    Args:
        name: the service's name ("engine-pool", ...).
        service: the proto service descriptor (``<module>_pb2.DESCRIPTOR.services_by_name[...]``).
        servicer_base: the generated ``<Service>Servicer`` class.
        add_to_server: the generated ``add_<Service>Servicer_to_server``.
        arrives: when it will be built, for the UNIMPLEMENTED message.
    """

    def __init__(
        self,
        name: str,
        service: ServiceDescriptor,
        servicer_base: type,
        add_to_server: Callable[[Any, grpc.aio.Server], None],
        arrives: str,
    ) -> None:
        self.name = name
        self.grpc_service_names = (service.full_name,)
        self._servicer = _unimplemented_servicer(servicer_base, service, arrives)
        self._add = add_to_server

    async def start(self, server: grpc.aio.Server) -> None:
        """Register the servicer."""
        self._add(self._servicer, server)

    async def is_ready(self) -> bool:
        """Always True: nothing to wait for."""
        return True

    async def stop(self) -> None:
        """Nothing to release."""


def placeholder_factory(
    name: str,
    service: ServiceDescriptor,
    servicer_base: type,
    add_to_server: Callable[[Any, grpc.aio.Server], None],
    arrives: str,
) -> Callable[[KilnSettings], PlaceholderApp]:
    """A ``create_app(settings)`` for :class:`PlaceholderApp`."""

    def create_app(settings: KilnSettings) -> PlaceholderApp:
        return PlaceholderApp(name, service, servicer_base, add_to_server, arrives)

    return create_app
