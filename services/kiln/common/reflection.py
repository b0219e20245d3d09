"""gRPC server reflection under both protocol names, ``grpc.reflection.v1`` and
``grpc.reflection.v1alpha``.

grpcio-reflection (1.85) implements only ``grpc.reflection.v1alpha``, while grpcurl, ``buf curl``
and newer clients ask for ``grpc.reflection.v1`` first. v1 is v1alpha promoted unchanged: the
same messages, field for field and number for number, so the bytes on the wire are identical.
kiln therefore serves v1 with the library's own asyncio servicer and v1alpha message classes,
registered under the v1 service name, and adds to the default descriptor pool a v1 file
descriptor derived from the library's v1alpha one (only the package and its options renamed), so
that a v1 client can describe the v1 service like any other. When grpcio-reflection gains a v1
module, :func:`enable_server_reflection` can use it instead; callers do not change.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection as v1alpha
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2

V1ALPHA_SERVICE_NAME: str = v1alpha.SERVICE_NAME
"""``grpc.reflection.v1alpha.ServerReflection``."""
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
"""The path upstream gRPC gives v1's proto (grpc/grpc, src/proto/grpc/reflection/v1)."""
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES: tuple[str, str] = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)
METHOD = "ServerReflectionInfo"


def _renamed(type_name: str, old: str, new: str) -> str:
    return new + type_name[len(old) :] if type_name.startswith(old) else type_name


def _rename_message(message: descriptor_pb2.DescriptorProto, old: str, new: str) -> None:
    for field in message.field:
        if field.HasField("type_name"):  # set only where set: scalars have none
            field.type_name = _renamed(field.type_name, old, new)
    for nested in message.nested_type:
        _rename_message(nested, old, new)


def v1_file_descriptor() -> descriptor_pb2.FileDescriptorProto:
    """v1's file descriptor: the library's v1alpha descriptor with the package renamed."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old, new = f".{proto.package}.", f".{V1_PACKAGE}."
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.options.java_package = "io.grpc.reflection.v1"
    proto.options.go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1"
    proto.options.ClearField("deprecated")  # v1alpha is deprecated in favour of v1
    for message in proto.message_type:
        _rename_message(message, old, new)
    for service in proto.service:
        for method in service.method:
            method.input_type = _renamed(method.input_type, old, new)
            method.output_type = _renamed(method.output_type, old, new)
    return proto


def register_v1_descriptor(pool: descriptor_pool.DescriptorPool | None = None) -> None:
    """Add v1's file to ``pool`` (the default pool) unless a file of that name is there
    already (idempotent; another library may have registered the real one)."""
    pool = pool or descriptor_pool.Default()
    try:
        pool.FindFileByName(V1_FILE)
    except KeyError:
        pool.AddSerializedFile(v1_file_descriptor().SerializeToString())


def enable_server_reflection(
    service_names: Iterable[str],
    server: grpc.aio.Server,
    pool: descriptor_pool.DescriptorPool | None = None,
) -> None:
    """Serve reflection v1 and v1alpha on ``server``, listing ``service_names`` and both
    reflection services. One servicer (grpcio-reflection's asyncio one) answers both names.
    """
    register_v1_descriptor(pool)
    names = tuple(dict.fromkeys((*service_names, *SERVICE_NAMES)))
    aio = v1alpha.aio  # type: ignore[attr-defined]  # public (its __all__), untyped
    servicer = aio.ReflectionServicer(names, pool=pool)
    handlers = {
        METHOD: grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
        )
    }
    for name in SERVICE_NAMES:
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
