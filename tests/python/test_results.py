"""tally_client.results without a server: every result class against the
tally.v1 message it mirrors (the same field names, every field converted to
a plain Python value), its enums against the proto's, and the conversions of
hand-built responses (unset submessages and optional scalars as None,
unknown enum values, frozen instances, `raw`)."""

import concurrent.futures
import dataclasses
import enum
import functools
import typing
import unittest

from google.protobuf.descriptor import FieldDescriptor

import tally_client
from tally_client import pb, results

# Every result class, by the full name of its message.
CLASSES = {cls.PROTO: cls for cls in vars(results).values()
           if isinstance(cls, type) and issubclass(cls, results.TypedMessage)
           and cls is not results.TypedMessage}

# Message fields a class leaves out on purpose: list_models() reads every
# page, so its ModelList has no page token.
LEFT_OUT = {"tally.v1.ListModelsResponse": {"next_page_token"}}

# Each IntEnum and the proto enum (and the prefix of its names) it mirrors.
ENUMS = ((results.DType, pb.DType, "DTYPE_"),
         (results.Optimizer, pb.Optimizer, "OPTIMIZER_"),
         (results.LossReduction, pb.LossReduction, "LOSS_REDUCTION_"),
         (results.GradSync, pb.GradSync, "GRAD_SYNC_"),
         (results.StopReason, pb.StopReason, "STOP_REASON_"))

# The result type of every client call, by the response message it wraps.
CALL_RESULTS = {
    "tally.v1.ModelInfo": tally_client.ModelInfo,
    "tally.v1.ServerInfo": tally_client.ServerInfo,
    "tally.v1.ListModelsResponse": tally_client.ModelList,
    "tally.v1.DeleteModelResponse": tally_client.DeleteResult,
    "tally.v1.ForwardBackwardResponse": tally_client.ForwardBackwardResult,
    "tally.v1.OptimStepResponse": tally_client.OptimStepResult,
    "tally.v1.AbortAccumulationResponse": tally_client.AbortResult,
    "tally.v1.SaveCheckpointResponse": tally_client.SaveResult,
    "tally.v1.LoadCheckpointResponse": tally_client.LoadResult,
    "tally.v1.ExportWeightsResponse": tally_client.ExportResult,
    "tally.v1.SampleResponse": tally_client.SamplingResult,
    "tally.v1.ComputeLogprobsResponse": tally_client.LogprobsResult,
}


# What each public client method returns (a future of it, for the
# sequenced calls).
RETURNS = {
    (tally_client.ServerClient, "server_info"): tally_client.ServerInfo,
    (tally_client.ServerClient, "list_models"): tally_client.ModelList,
    (tally_client.TrainingClient, "server_info"): tally_client.ServerInfo,
    (tally_client.TrainingClient, "create_model"): tally_client.ModelInfo,
    (tally_client.TrainingClient, "get_model"): tally_client.ModelInfo,
    (tally_client.TrainingClient, "delete_model"): tally_client.DeleteResult,
}
FUTURES = {
    "forward_backward": tally_client.ForwardBackwardResult,
    "optim_step": tally_client.OptimStepResult,
    "abort_window": tally_client.AbortResult,
    "save": tally_client.SaveResult,
    "export_weights": tally_client.ExportResult,
    "load": tally_client.LoadResult,
    "sample": tally_client.SamplingResult,
    "compute_logprobs": tally_client.LogprobsResult,
}


def descriptor(full_name):
    return pb.DESCRIPTOR.pool.FindMessageTypeByName(full_name)


def message_class(full_name):
    """The pb class of tally.v1 message `full_name` (nested ones too)."""
    return functools.reduce(getattr, full_name.split(".")[2:], pb)


def filled(message_type, seed=1):
    """A message of `message_type` (a descriptor) with every field set to a
    value derived from `seed`: repeated and map fields with two entries,
    enums to a defined nonzero value, submessages filled the same way."""
    message = message_class(message_type.full_name)()
    for number, field in enumerate(message_type.fields, start=seed):
        if field.message_type is not None and \
                field.message_type.GetOptions().map_entry:
            target = getattr(message, field.name)
            for i in range(2):
                target[f"key{number}_{i}"] = number + i + 0.5
        elif field.message_type is not None:
            values = [filled(field.message_type, number + i) for i in range(2)]
            if field.label == FieldDescriptor.LABEL_REPEATED:
                getattr(message, field.name).extend(values)
            else:
                getattr(message, field.name).CopyFrom(values[0])
        else:
            values = [scalar(field, number + i) for i in range(2)]
            if field.label == FieldDescriptor.LABEL_REPEATED:
                getattr(message, field.name).extend(values)
            else:
                setattr(message, field.name, values[0])
    return message


def scalar(field, number):
    if field.enum_type is not None:
        values = [v.number for v in field.enum_type.values if v.number]
        return values[number % len(values)]
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"text{number}"
    if field.type == FieldDescriptor.TYPE_BOOL:
        return number % 2 == 1
    if field.cpp_type in (FieldDescriptor.CPPTYPE_DOUBLE,
                          FieldDescriptor.CPPTYPE_FLOAT):
        return number + 0.25
    return number


class ResultClassTest(unittest.TestCase):

    def test_every_class_has_its_message_fields(self):
        self.assertGreaterEqual(len(CLASSES), len(CALL_RESULTS))
        for name, cls in CLASSES.items():
            with self.subTest(message=name):
                fields = {f.name for f in descriptor(name).fields}
                fields -= LEFT_OUT.get(name, set())
                mine = {f.name for f in dataclasses.fields(cls)} - {"raw"}
                self.assertEqual(mine, fields)

    def test_only_fields_with_presence_can_be_none(self):
        for name, cls in CLASSES.items():
            hints = typing.get_type_hints(cls)
            for field in descriptor(name).fields:
                if field.name in LEFT_OUT.get(name, set()):
                    continue
                hint = hints[field.name]
                optional = typing.get_origin(hint) is typing.Union and \
                    type(None) in typing.get_args(hint)
                with self.subTest(message=name, field=field.name):
                    if optional:
                        self.assertTrue(field.has_presence)
                    elif field.has_presence:
                        # Always set by the server: converted even unset.
                        self.assertIsNotNone(field.message_type)

    def test_every_nested_message_has_a_class(self):
        for name in CLASSES:
            for field in descriptor(name).fields:
                nested = field.message_type
                if nested is None or nested.GetOptions().map_entry or \
                        field.name in LEFT_OUT.get(name, set()):
                    continue
                with self.subTest(message=name, field=field.name):
                    self.assertIn(nested.full_name, CLASSES)

    def test_every_call_result_wraps_its_response(self):
        for name, cls in CALL_RESULTS.items():
            with self.subTest(message=name):
                self.assertIs(CLASSES[name], cls)

    def test_the_client_methods_return_the_typed_results(self):
        for (cls, method), result in RETURNS.items():
            with self.subTest(method=f"{cls.__name__}.{method}"):
                hints = typing.get_type_hints(getattr(cls, method))
                self.assertIs(hints["return"], result)
        for method, result in FUTURES.items():
            with self.subTest(method=f"TrainingClient.{method}"):
                hints = typing.get_type_hints(
                    getattr(tally_client.TrainingClient, method))
                self.assertIs(typing.get_origin(hints["return"]),
                              concurrent.futures.Future)
                self.assertEqual(typing.get_args(hints["return"]), (result,))

    def test_enums_match_the_proto(self):
        for mine, proto, prefix in ENUMS:
            with self.subTest(enum=mine.__name__):
                self.assertEqual(
                    {m.name: m.value for m in mine},
                    {name[len(prefix):]: value
                     for name, value in proto.items()})


class ConversionTest(unittest.TestCase):

    def assert_mirrors(self, typed, message, where):
        """`typed` holds every field of `message` as plain values."""
        self.assertIs(typed.raw, message, where)
        for field in message.DESCRIPTOR.fields:
            if field.name in LEFT_OUT.get(message.DESCRIPTOR.full_name, ()):
                continue
            got, want = getattr(typed, field.name), getattr(message, field.name)
            here = f"{where}.{field.name}"
            if field.message_type is not None and \
                    field.message_type.GetOptions().map_entry:
                self.assertIs(type(got), dict, here)
                self.assertEqual(got, dict(want), here)
            elif field.label == FieldDescriptor.LABEL_REPEATED:
                self.assertIs(type(got), list, here)
                self.assertEqual(len(got), len(want), here)
                for i, (g, w) in enumerate(zip(got, want)):
                    self.assert_value(field, g, w, f"{here}[{i}]")
            else:
                self.assert_value(field, got, want, here)

    def assert_value(self, field, got, want, where):
        if field.message_type is not None:
            self.assert_mirrors(got, want, where)
        elif field.enum_type is not None:
            self.assertIsInstance(got, enum.IntEnum, where)
            self.assertEqual(got, want, where)
            self.assertTrue(field.enum_type.values_by_number[want].name
                            .endswith("_" + got.name), where)
        else:
            self.assertEqual(got, want, where)

    def test_a_filled_message_converts_field_by_field(self):
        for name, cls in CLASSES.items():
            with self.subTest(message=name):
                message = filled(descriptor(name))
                self.assert_mirrors(cls.from_proto(message), message, name)

    def test_forward_backward_response(self):
        response = pb.ForwardBackwardResponse(
            loss_sum=6.0, loss_mean=1.5, valid_tokens=4, num_samples=2,
            accumulated_calls=1, accumulated_tokens=4, accumulated_samples=2,
            metrics={"loss:sum": 6.0},
            samples=[pb.SampleResult(loss_sum=2.0, valid_tokens=1,
                                     logprobs=[-0.5], token_losses=[2.0]),
                     pb.SampleResult(loss_sum=4.0, valid_tokens=3,
                                     policy=pb.PolicyStats(tokens=3,
                                                           kl_k1=0.125))])
        result = tally_client.ForwardBackwardResult.from_proto(response)
        self.assertEqual((result.loss_sum, result.loss_mean,
                          result.valid_tokens, result.num_samples),
                         (6.0, 1.5, 4, 2))
        self.assertEqual(result.metrics, {"loss:sum": 6.0})
        self.assertEqual(result.samples[0].logprobs, [-0.5])
        self.assertEqual(result.samples[1].logprobs, [])
        # cross_entropy leaves the policy stats unset: None, not zeros.
        self.assertIsNone(result.policy)
        self.assertIsNone(result.samples[0].policy)
        self.assertEqual(result.samples[1].policy.tokens, 3)
        self.assertEqual(result.samples[1].policy.kl_k1, 0.125)

    def test_unset_submessages_and_optional_scalars_are_none(self):
        info = tally_client.ModelInfo.from_proto(pb.ModelInfo(
            model_id="full", dtype=pb.DTYPE_BFLOAT16,
            default_adam=pb.AdamParams(learning_rate=0.0, eps=1e-8)))
        self.assertIsNone(info.lora)
        self.assertIsNone(info.config.rope_scaling)
        # Set to 0 and unset differ, as in the message.
        self.assertEqual(info.default_adam.learning_rate, 0.0)
        self.assertEqual(info.default_adam.eps, 1e-8)
        self.assertIsNone(info.default_adam.beta1)
        self.assertIs(info.dtype, results.DType.BFLOAT16)
        self.assertEqual(info.dtype, pb.DTYPE_BFLOAT16)

        adapter = tally_client.ModelInfo.from_proto(pb.ModelInfo(
            lora=pb.LoraConfig(rank=8, train_mlp=False)))
        self.assertEqual(adapter.lora.rank, 8)
        self.assertIs(adapter.lora.train_mlp, False)
        self.assertIsNone(adapter.lora.train_attn)
        self.assertIsNone(adapter.lora.seed)

    def test_an_unknown_enum_value_stays_an_int(self):
        # A newer server's value: proto3 enums are open.
        message = pb.ModelInfo.FromString(
            pb.ModelInfo(dtype=pb.DTYPE_FLOAT32).SerializeToString()
            .replace(bytes([9 << 3, 1]), bytes([9 << 3, 42])))
        self.assertEqual(message.dtype, 42)
        info = tally_client.ModelInfo.from_proto(message)
        self.assertEqual(info.dtype, 42)
        self.assertNotIsInstance(info.dtype, enum.Enum)

    def test_server_info_lists(self):
        info = tally_client.ServerInfo.from_proto(pb.ServerInfo(
            version="1.2.3", dtypes=[pb.DTYPE_FLOAT32, pb.DTYPE_BFLOAT16],
            losses=["cross_entropy", "ppo"],
            devices=pb.ServerInfo.Devices(gpus=[
                pb.ServerInfo.Devices.Gpu(index=1, name="H100")])))
        self.assertEqual(info.version, "1.2.3")
        self.assertEqual(info.dtypes, [results.DType.FLOAT32,
                                       results.DType.BFLOAT16])
        self.assertEqual(info.losses, ["cross_entropy", "ppo"])
        self.assertEqual(info.devices.gpus[0].name, "H100")
        self.assertEqual(info.mesh.world_size, 0)

    def test_results_are_frozen_and_compare_without_raw(self):
        step = pb.OptimStepResponse(step=3, grad_norm=0.5, metrics={"a": 1.0})
        first = tally_client.OptimStepResult.from_proto(step)
        second = tally_client.OptimStepResult.from_proto(
            pb.OptimStepResponse.FromString(step.SerializeToString()))
        with self.assertRaises(dataclasses.FrozenInstanceError):
            first.step = 4
        self.assertEqual(first, second)
        self.assertIsNot(first.raw, second.raw)
        self.assertNotIn("raw", repr(first))
        self.assertNotEqual(first, tally_client.OptimStepResult.from_proto(
            pb.OptimStepResponse(step=4)))

    def test_a_wrong_message_type_is_a_type_error(self):
        with self.assertRaises(TypeError) as raised:
            tally_client.ModelInfo.from_proto(pb.OptimStepResponse())
        self.assertIn("tally.v1.ModelInfo", str(raised.exception))
        self.assertIn("tally.v1.OptimStepResponse", str(raised.exception))

    def test_a_typed_lora_config_is_accepted_back(self):
        lora = pb.LoraConfig(rank=4, alpha=8.0, train_unembed=False)
        typed = tally_client.ModelInfo.from_proto(pb.ModelInfo(lora=lora)).lora
        self.assertEqual(tally_client.lora_config(typed), lora)


class FakeServer(tally_client.ServerClient):
    """A ServerClient without a server: call() records each request and
    answers with responses[method](request) at once."""

    def __init__(self, responses):  # pylint: disable=super-init-not-called
        self.target = "fake"
        self.responses = responses
        self.requests = []

    def call(self, method, request, retryable):
        self.requests.append((method, request))
        future = concurrent.futures.Future()
        future.set_result(self.responses[method](request))
        return future


class ClientConversionTest(unittest.TestCase):

    def test_calls_return_typed_results_and_take_them_back(self):
        created = pb.ModelInfo(
            model_id="m", next_seq_id=1,
            config=pb.ModelConfig(vocab_size=32, model_type="qwen3"),
            default_adam=pb.AdamParams(learning_rate=0.5),
            lora=pb.LoraConfig(rank=4, train_attn=False))
        server = FakeServer({
            "CreateModel": lambda _: created,
            "ForwardBackward": lambda request: pb.ForwardBackwardResponse(
                valid_tokens=len(request.samples[0].target_tokens),
                metrics={"loss:sum": 1.0})})
        client = server.training_client("m", first_seq_id=1)
        info = client.create_model(config=pb.ModelConfig(vocab_size=32))
        self.assertIsInstance(info, tally_client.ModelInfo)
        self.assertIs(info.raw, created)
        again = client.create_model(config=info.config,
                                    default_adam=info.default_adam,
                                    lora=info.lora)
        self.assertEqual(again, info)
        request = server.requests[-1][1]
        self.assertEqual(request.config, created.config)
        self.assertEqual(request.default_adam, created.default_adam)
        self.assertEqual(request.lora, created.lora)

        result = client.forward_backward([([1, 2, 3], [2, 3, 4])]).result()
        self.assertIsInstance(result, tally_client.ForwardBackwardResult)
        self.assertEqual(result.valid_tokens, 3)
        self.assertEqual(result.metrics, {"loss:sum": 1.0})

    def test_a_response_that_does_not_convert_fails_the_future(self):
        server = FakeServer({"SaveCheckpoint": lambda _: pb.ModelInfo()})
        client = server.training_client("m", first_seq_id=1)
        with self.assertRaises(TypeError) as raised:
            client.save("/ckpt").result(timeout=60)
        self.assertIn("tally.v1.SaveCheckpointResponse", str(raised.exception))


if __name__ == "__main__":
    unittest.main()
