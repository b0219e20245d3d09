"""The cost model service process (a placeholder until the cost model is built)."""

from kiln.common.placeholder import placeholder_factory
from kiln.v1 import cost_model_pb2, cost_model_pb2_grpc

create_app = placeholder_factory(
    "cost-model",
    cost_model_pb2.DESCRIPTOR.services_by_name["CostModel"],
    cost_model_pb2_grpc.CostModelServicer,
    cost_model_pb2_grpc.add_CostModelServicer_to_server,
    "the cost model arrives with issue 3",
)
