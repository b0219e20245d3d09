"""Server reflection v1 and v1alpha on kiln's service runtime, over real gRPC with the
deployment's mutual TLS (one server for the module): grpcio-reflection's v1alpha client
(ProtoReflectionDescriptorDatabase), raw v1 calls, and ``buf curl`` (a third-party v1 client)
where buf is installed."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection_pb2
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from kiln.common import reflection
from kiln.common.client import channel, wait_healthy
from kiln.common.server import serve
from kiln.common.settings import KilnSettings

from ..buf import require_buf
from ..pki import DEFAULT_TEAM, team_tls
from .runtime_app import RuntimeTestApp, free_port

V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"
COMPILER_METHODS = {"Submit", "Watch", "Get", "List", "Cancel"}


class DescribedApp(RuntimeTestApp):
    """The runtime test app listing only services with a descriptor (its echo service is a
    bare generic handler, which a client that describes every listed service would trip on)."""

    grpc_service_names = ("kiln.v1.CostModel", "kiln.v1.Compiler")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def addr(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[str]:
    address = f"127.0.0.1:{free_port()}"
    settings = KilnSettings(
        metrics_port=0, grace_period_s=0.5, state_dir=tmp_path_factory.mktemp("refl")
    )
    started = asyncio.Event()
    task = asyncio.create_task(
        serve(DescribedApp(), settings, listen=address, started=started, handle_signals=False)
    )
    await asyncio.wait_for(started.wait(), 5)
    await wait_healthy(address, 5)
    yield address
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def v1_call(
    addr: str, *requests: reflection_pb2.ServerReflectionRequest
) -> list[reflection_pb2.ServerReflectionResponse]:
    """Raw calls of the v1 method (v1 and v1alpha messages are the same bytes)."""
    async with channel(addr) as ch:  # the test team's client certificate
        call = ch.stream_stream(
            V1_METHOD,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        return [r async for r in call(iter(requests), timeout=5)]


def files_of(
    reply: reflection_pb2.ServerReflectionResponse,
) -> dict[str, descriptor_pb2.FileDescriptorProto]:
    protos = {}
    for raw in reply.file_descriptor_response.file_descriptor_proto:
        proto = descriptor_pb2.FileDescriptorProto.FromString(raw)
        protos[proto.name] = proto
    return protos


async def test_v1_lists_services(addr: str) -> None:
    (reply,) = await v1_call(addr, reflection_pb2.ServerReflectionRequest(list_services=""))
    names = {s.name for s in reply.list_services_response.service}
    assert {
        "kiln.v1.Compiler",
        "kiln.v1.CostModel",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


async def test_v1_file_containing_compiler(addr: str) -> None:
    (reply,) = await v1_call(
        addr, reflection_pb2.ServerReflectionRequest(file_containing_symbol="kiln.v1.Compiler")
    )
    assert not reply.HasField("error_response"), reply.error_response
    files = files_of(reply)
    # the file and its transitive imports, so a client can build the pool from one answer
    assert {"kiln/v1/compiler.proto", "kiln/v1/common.proto"} <= files.keys()
    assert "google/protobuf/timestamp.proto" in files
    pool = descriptor_pool.DescriptorPool()
    for name in _dependency_order(files):
        pool.Add(files[name])
    service = pool.FindServiceByName("kiln.v1.Compiler")
    assert {m.name for m in service.methods} == COMPILER_METHODS
    assert service.methods_by_name["Watch"].output_type.full_name == "kiln.v1.CompilationEvent"


async def test_v1_describes_itself_as_v1alpha_renamed(addr: str) -> None:
    """The v1 service resolves (grpcurl's `describe` needs every listed service to) and its
    messages are v1alpha's, field for field."""
    (reply,) = await v1_call(
        addr,
        reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="grpc.reflection.v1.ServerReflection"
        ),
    )
    (v1,) = files_of(reply).values()
    assert (v1.name, v1.package) == ("grpc/reflection/v1/reflection.proto", "grpc.reflection.v1")
    v1alpha = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(v1alpha)

    def shape(f: descriptor_pb2.FileDescriptorProto, pkg: str) -> list[tuple[object, ...]]:
        return [
            (m.name, f2.name, f2.number, f2.type, f2.label, f2.type_name.replace(pkg, "P"))
            for m in f.message_type
            for f2 in m.field
        ]

    assert shape(v1, "grpc.reflection.v1.") == shape(v1alpha, "grpc.reflection.v1alpha.")
    (method,) = v1.service[0].method
    assert (method.name, method.input_type, method.client_streaming) == (
        "ServerReflectionInfo",
        ".grpc.reflection.v1.ServerReflectionRequest",
        True,
    )


async def test_v1_unknown_symbol_is_not_found(addr: str) -> None:
    (reply,) = await v1_call(
        addr, reflection_pb2.ServerReflectionRequest(file_containing_symbol="kiln.v1.Nope")
    )
    assert reply.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def _dependency_order(files: dict[str, descriptor_pb2.FileDescriptorProto]) -> Iterator[str]:
    done: set[str] = set()

    def visit(name: str) -> Iterator[str]:
        if name in done:
            return
        done.add(name)
        for dep in files[name].dependency:
            yield from visit(dep)
        yield name

    for name in sorted(files):
        yield from visit(name)


def _v1alpha_client(addr: str) -> tuple[list[str], set[str]]:
    """grpcio-reflection's own (synchronous) client: services and Compiler's methods."""
    credentials = team_tls(DEFAULT_TEAM).channel_credentials()
    with grpc.secure_channel(addr, credentials) as ch:
        database = ProtoReflectionDescriptorDatabase(ch)
        services = list(database.get_services())
        pool = descriptor_pool.DescriptorPool(database)
        methods = {m.name for m in pool.FindServiceByName("kiln.v1.Compiler").methods}
    return services, methods


async def test_v1alpha_descriptor_database(addr: str) -> None:
    services, methods = await asyncio.to_thread(_v1alpha_client, addr)  # the loop serves
    assert {"kiln.v1.Compiler", "grpc.reflection.v1alpha.ServerReflection"} <= set(services)
    assert "grpc.reflection.v1.ServerReflection" in services
    assert methods == COMPILER_METHODS


async def test_reflection_needs_a_client_certificate(addr: str) -> None:
    """Reflection is not behind the policy, but it is behind the deployment's mutual TLS."""
    ca = team_tls(DEFAULT_TEAM).ca
    async with grpc.aio.secure_channel(addr, grpc.ssl_channel_credentials(ca)) as ch:
        call = ch.stream_stream(
            V1_METHOD,
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            _ = [r async for r in call(iter([request]), timeout=3)]
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_register_v1_descriptor_is_idempotent() -> None:
    reflection.register_v1_descriptor()
    reflection.register_v1_descriptor()
    found = descriptor_pool.Default().FindServiceByName(reflection.V1_SERVICE_NAME)
    assert found.file.name == reflection.V1_FILE


async def _buf_curl(buf: str, pem: Path, addr: str, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        buf,
        "curl",
        "--protocol",
        "grpc",
        "--reflect-protocol",
        "grpc-v1",  # v1 only: no fallback to v1alpha
        "--cacert",
        str(pem / "ca.pem"),
        "--cert",
        str(pem / "cert.pem"),
        "--key",
        str(pem / "key.pem"),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_buf_curl_over_v1(addr: str, tmp_path: Path) -> None:
    buf = require_buf()
    material = team_tls(DEFAULT_TEAM)
    for name, data in (("ca", material.ca), ("cert", material.cert), ("key", material.key)):
        (tmp_path / f"{name}.pem").write_bytes(data)
    listed = await _buf_curl(buf, tmp_path, addr, "--list-methods", f"https://{addr}")
    assert {f"kiln.v1.Compiler/{m}" for m in COMPILER_METHODS} <= set(listed.split())
    reply = await _buf_curl(
        buf,
        tmp_path,
        addr,
        "-d",
        '{"service": "liveness"}',
        f"https://{addr}/grpc.health.v1.Health/Check",
    )
    assert json.loads(reply) == {"status": "SERVING"}
