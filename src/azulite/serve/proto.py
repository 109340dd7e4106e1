"""Triton's own protobuf schema, as shipped by tritonclient: ``ModelConfig`` (config.pbtxt) and the
KServe v2 / Triton gRPC service. The data plane returns these messages for metadata, config, statistics
and the repository index, so HTTP and gRPC answer from one source."""

from tritonclient.grpc import model_config_pb2 as model_config_pb2  # noqa: F401
from tritonclient.grpc import service_pb2 as service_pb2  # noqa: F401
from tritonclient.grpc import service_pb2_grpc as service_pb2_grpc  # noqa: F401
