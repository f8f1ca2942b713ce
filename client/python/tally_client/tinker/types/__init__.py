"""The data types of Tinker's Python SDK (`tinker.types`), as tally's Tinker
client takes and returns them: a package laid out as Tinker's (each type in
its module, e.g. `tally_client.tinker.types.tensor_data.TensorData`), every
name re-exported here.

Same names, fields, defaults and helpers as Tinker's, as plain dataclasses:
a training loop builds Datums from ModelInputs and per-token TensorData
(lists, nested lists, numpy arrays or torch tensors), and reads
ForwardBackwardOutput's per-datum "logprobs" and "elementwise_loss". numpy
and torch are imported only by the conversions that return them.

    from tally_client.tinker import types
    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:]})
"""

from tally_client.tinker.types.checkpoint import (Checkpoint, CheckpointType,
                                                  CheckpointsListResponse)
from tally_client.tinker.types.datum import Datum, LossFnInputs
from tally_client.tinker.types.encoded_text_chunk import EncodedTextChunk
from tally_client.tinker.types.forward_backward_output import (
    ForwardBackwardOutput, LossFnOutput)
from tally_client.tinker.types.get_info_response import (GetInfoResponse,
                                                         ModelData)
from tally_client.tinker.types.get_server_capabilities_response import (
    GetServerCapabilitiesResponse, SupportedModel)
from tally_client.tinker.types.image_asset_pointer_chunk import \
    ImageAssetPointerChunk
from tally_client.tinker.types.image_chunk import ImageChunk
from tally_client.tinker.types.load_weights_response import \
    LoadWeightsResponse
from tally_client.tinker.types.loss_fn_type import LossFnType
from tally_client.tinker.types.model_input import ModelInput
from tally_client.tinker.types.model_input_chunk import ModelInputChunk
from tally_client.tinker.types.optim_step_request import AdamParams
from tally_client.tinker.types.optim_step_response import OptimStepResponse
from tally_client.tinker.types.sample_response import SampleResponse
from tally_client.tinker.types.sampled_sequence import SampledSequence
from tally_client.tinker.types.sampling_params import SamplingParams
from tally_client.tinker.types.save_weights_for_sampler_response import \
    SaveWeightsForSamplerResponse
from tally_client.tinker.types.save_weights_response import \
    SaveWeightsResponse
from tally_client.tinker.types.stop_reason import StopReason
from tally_client.tinker.types.tensor_data import TensorData
from tally_client.tinker.types.tensor_dtype import TensorDtype

__all__ = ["AdamParams", "Checkpoint", "CheckpointType",
           "CheckpointsListResponse", "Datum", "EncodedTextChunk", "ForwardBackwardOutput",
           "GetInfoResponse", "GetServerCapabilitiesResponse",
           "ImageAssetPointerChunk", "ImageChunk", "LoadWeightsResponse",
           "LossFnInputs", "LossFnOutput", "LossFnType", "ModelData",
           "ModelInput", "ModelInputChunk", "OptimStepResponse",
           "SampleResponse", "SampledSequence", "SamplingParams",
           "SaveWeightsForSamplerResponse", "SaveWeightsResponse",
           "StopReason", "SupportedModel", "TensorData", "TensorDtype"]
