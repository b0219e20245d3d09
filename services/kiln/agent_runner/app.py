"""The agent runner service process, host of the Compiler API (a placeholder until built)."""

from kiln.common.placeholder import placeholder_factory
from kiln.v1 import compiler_pb2, compiler_pb2_grpc

create_app = placeholder_factory(
    "agent-runner",
    compiler_pb2.DESCRIPTOR.services_by_name["Compiler"],
    compiler_pb2_grpc.CompilerServicer,
    compiler_pb2_grpc.add_CompilerServicer_to_server,
    "the agent runner (Compiler API) arrives with issue 3",
)
