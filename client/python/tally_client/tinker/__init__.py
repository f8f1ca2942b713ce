"""Tinker's Python SDK on a tally server: a Tinker program runs on tally by
changing its imports and giving it the server's address (base_url= or
$TINKER_BASE_URL). The names of `tinker` and `tinker.types` (a package laid
out as Tinker's), the clients' parameters and Tinker's exception classes
are Tinker 0.25.0's (tests/python/tinker_signatures.json lists them).

    from tally_client import tinker          # was: import tinker
    from tally_client.tinker import types    # was: from tinker import types

    service = tinker.ServiceClient(base_url="localhost:50051")
    training = service.create_lora_training_client(
        base_model="/data/Qwen3-0.6B")       # a server-side HF directory
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]})
    fwd_bwd = training.forward_backward([datum], "cross_entropy")
    step = training.optim_step(types.AdamParams(learning_rate=1e-4))
    print(fwd_bwd.result().metrics["loss:sum"],
          step.result().metrics["tally/grad_norm"])

create_lora_training_client makes a LoRA adapter (PEFT's, alpha 32) over
the frozen base_model, which the server shares among the adapters of the
same base. save_weights_and_get_sampling_client() gives a SamplingClient
that samples the weights being trained, in the server and in call order
(no snapshot is written):

    sampler = training.save_weights_and_get_sampling_client()
    result = sampler.sample(types.ModelInput.from_ints(prompt), 8,
                            types.SamplingParams(max_tokens=32)).result()

What differs from Tinker (client/python/README.md has the whole list): no
sampler snapshots yet (a sampling client reads a model's latest weights),
checkpoint paths are tally:// handles (server-side directories without
--checkpoint-root), tally's metrics come under
"tally/", and every failure is a TallyError as well as Tinker's class.
"""

from tally_client.errors import (APIConnectionError, APIError,
                                 APIResponseValidationError, APIStatusError,
                                 APITimeoutError, AuthenticationError,
                                 BadRequestError, ConflictError,
                                 InternalServerError, NotFoundError,
                                 PermissionDeniedError, RateLimitError,
                                 RequestFailedError, TallyError, TinkerError,
                                 UnprocessableEntityError, WindowAbortedError)
from tally_client.tinker import types
from tally_client.tinker.api_future import APIFuture
from tally_client.tinker.clients import (DEMO_MODEL, REDUCTIONS,
                                         ServiceClient, TrainingClient)
from tally_client.tinker.rest_client import RestClient
from tally_client.tinker.sampling_client import SamplingClient
from tally_client.tinker.types import (AdamParams, Checkpoint, CheckpointType,
                                       Datum, EncodedTextChunk,
                                       ForwardBackwardOutput,
                                       ImageAssetPointerChunk, ImageChunk,
                                       LossFnType, ModelInput,
                                       ModelInputChunk, OptimStepResponse,
                                       SampledSequence, SampleResponse,
                                       SamplingParams, StopReason, TensorData,
                                       TensorDtype)

__all__ = ["APIConnectionError", "APIError", "APIFuture",
           "APIResponseValidationError", "APIStatusError", "APITimeoutError",
           "AdamParams", "AuthenticationError", "BadRequestError",
           "Checkpoint", "CheckpointType", "ConflictError", "DEMO_MODEL", "Datum", "EncodedTextChunk",
           "ForwardBackwardOutput", "ImageAssetPointerChunk", "ImageChunk",
           "InternalServerError", "LossFnType", "ModelInput",
           "ModelInputChunk", "NotFoundError", "OptimStepResponse",
           "PermissionDeniedError", "REDUCTIONS", "RateLimitError",
           "RequestFailedError", "RestClient", "SampleResponse", "SampledSequence",
           "SamplingClient", "SamplingParams", "ServiceClient", "StopReason",
           "TallyError", "TensorData", "TensorDtype", "TinkerError",
           "TrainingClient", "UnprocessableEntityError", "WindowAbortedError",
           "types"]
