"""tally_client: the Python client of the tally training server.

    from tally_client import ServerClient, TrainingClient, sample
    server = ServerClient("localhost:50051")
    print(server.server_info().version, len(server.list_models().models))
    client = TrainingClient("localhost:50051", "demo")
    fb = client.forward_backward([sample([1, 2, 3], [2, 3, 4])])
    step = client.optim_step(max_grad_norm=1.0)
    print(fb.result().loss_mean, step.result().grad_norm)
    done = client.sample([[1, 2, 3]], num_samples=4, max_tokens=8).result()
    print([s.tokens for s in done.sequences], done.sequences[0].logprobs)

Results are frozen dataclasses (tally_client.results: ModelInfo,
ServerInfo, ForwardBackwardResult, OptimStepResult, ...) with the field names
of their tally.v1 message and the message itself as `.raw`; the messages
are `tally_client.pb`, typed by the .pyi stubs shipped beside them. Failures
raise the TallyError subclass of their gRPC status code
(tally_client.errors). Tinker's Python SDK on tally:
tally_client.tinker.
"""

# The generated modules (tally_client._proto) are in the wheel beside the
# sources; in a build tree they are in build/python_stubs/tally_client, which
# joins this package's path when build/python_stubs is on sys.path.
import pkgutil

__path__ = pkgutil.extend_path(__path__, __name__)

# pylint: disable=wrong-import-position
from tally_client._proto.tally.v1 import trainer_pb2 as pb
from tally_client._proto.tally.v1 import trainer_pb2_grpc as pb_grpc
from tally_client.client import TrainingClient, lora_config
from tally_client.dtypes import parse_dtype
from tally_client.errors import (TRANSIENT_CODES, AbortedError,
                                 AlreadyExistsError, CancelledError,
                                 DataLossError, DeadlineExceededError,
                                 FailedPreconditionError, InternalError,
                                 InvalidArgumentError, NotFoundError,
                                 OutOfRangeError, PendingWindowError,
                                 PermissionDeniedError, ResourceExhaustedError,
                                 TallyError, UnauthenticatedError,
                                 UnavailableError, UnimplementedError,
                                 UnknownError, WindowAbortedError, error_class,
                                 error_details, is_retryable)
from tally_client.results import (AbortResult, DeleteResult, DType,
                                  ExportResult, ForwardBackwardResult,
                                  GradSync, LoadResult, LogprobsResult,
                                  LossReduction, ModelInfo, ModelList,
                                  OptimStepResult, Optimizer, SamplerInfo,
                                  SamplingResult, SaveResult, ServerInfo,
                                  StopReason)
from tally_client.samples import sample, samples_from_batch, to_samples
from tally_client.server import (RetryPolicy, ServerClient, Tls, make_channel,
                                 wait_for_serving)

__all__ = [
    "AbortResult", "AbortedError", "AlreadyExistsError", "CancelledError",
    "DType", "DataLossError", "DeadlineExceededError", "DeleteResult",
    "ExportResult", "FailedPreconditionError", "ForwardBackwardResult",
    "GradSync", "InternalError", "InvalidArgumentError", "LoadResult",
    "LogprobsResult", "LossReduction", "ModelInfo", "ModelList",
    "NotFoundError", "OptimStepResult", "Optimizer", "OutOfRangeError",
    "PendingWindowError", "PermissionDeniedError", "ResourceExhaustedError",
    "RetryPolicy", "SamplerInfo", "SamplingResult", "SaveResult", "ServerClient",
    "ServerInfo", "StopReason", "TRANSIENT_CODES", "TallyError", "Tls",
    "TrainingClient", "UnauthenticatedError", "UnavailableError",
    "UnimplementedError", "UnknownError", "WindowAbortedError", "error_class",
    "error_details", "is_retryable", "lora_config", "make_channel",
    "parse_dtype", "pb", "pb_grpc", "sample", "samples_from_batch",
    "to_samples", "wait_for_serving"]
