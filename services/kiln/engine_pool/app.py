"""The engine pool service process (a placeholder until the engine pool is built)."""

from kiln.common.placeholder import placeholder_factory
from kiln.v1 import engine_pool_pb2, engine_pool_pb2_grpc

create_app = placeholder_factory(
    "engine-pool",
    engine_pool_pb2.DESCRIPTOR.services_by_name["EnginePool"],
    engine_pool_pb2_grpc.EnginePoolServicer,
    engine_pool_pb2_grpc.add_EnginePoolServicer_to_server,
    "the engine pool arrives with issue 3",
)
