"""tally_client.tinker's types, conversions, errors and tokenizer without a
server: what Tinker programs build (n-D TensorData, float token ids, image
chunks, per-token clip thresholds, datums without a mask) becomes the tally
Samples and loss_fn_config sent, or the error Tinker's SDK would raise;
tally's results come back under Tinker's metric names; every failure is
both a TallyError and Tinker's exception class of its status."""

import os
import sys
import tempfile
import types as pytypes
import unittest
from unittest import mock

import grpc
import numpy as np
import torch

from tally_client import errors, tinker
from tally_client.results import OptimStepResult
from tally_client.tinker import conversions, tokenizer, types
from tally_client.tinker.types.tensor_data import TensorData


def datum(tokens, **inputs):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                       loss_fn_inputs=inputs)


class TensorDataTest(unittest.TestCase):

    def test_nested_lists_arrays_and_tensors_keep_their_shape(self):
        for data in ([[1, 2, 3], [4, 5, 6]], np.arange(1, 7).reshape(2, 3),
                     torch.arange(1, 7).reshape(2, 3)):
            with self.subTest(type(data).__name__):
                tensor = TensorData(data=data, dtype="int64")
                self.assertEqual(tensor.shape, [2, 3])
                self.assertEqual(tensor.data, [1, 2, 3, 4, 5, 6])
                self.assertEqual(tensor.tolist(), [[1, 2, 3], [4, 5, 6]])
        self.assertIsNone(TensorData(data=[1.5], dtype="float32").shape)
        self.assertEqual(TensorData(dtype="float32").data, [])

    def test_conversions_round_trip(self):
        array = np.array([[0.5, -1.0]], dtype=np.float64)
        tensor = TensorData.from_numpy(array)
        self.assertEqual((tensor.dtype, tensor.shape), ("float32", [1, 2]))
        np.testing.assert_array_equal(tensor.to_numpy(), array)
        self.assertEqual(tensor.to_numpy().dtype, np.float32)
        ints = TensorData.from_torch(torch.tensor([[3], [4]]))
        self.assertEqual((ints.dtype, ints.tolist()), ("int64", [[3], [4]]))
        self.assertTrue(torch.equal(ints.to_torch(),
                                    torch.tensor([[3], [4]])))

    def test_integral_floats_are_token_ids_and_others_are_refused(self):
        self.assertEqual(TensorData(data=[5.0, 6.0], dtype="int64").data,
                         [5, 6])
        for bad in ([1.5], [float("nan")], [[1], [2, 3]], "123"):
            with self.subTest(bad=bad), self.assertRaises(ValueError):
                TensorData(data=bad, dtype="int64")
        with self.assertRaisesRegex(TypeError, "dtype"):
            TensorData(data=[1])


class ChunkTest(unittest.TestCase):

    def test_image_chunks_have_tinkers_length_and_to_ints_refuses_them(self):
        image = types.ImageChunk(data="iVBORw==", format="png",
                                 expected_tokens=4)
        self.assertEqual(image.data, b"\x89PNG")
        pointer = types.ImageAssetPointerChunk(format="jpeg",
                                               location="/tmp/cat.jpg")
        prompt = types.ModelInput.from_ints([1, 2]).append(image)
        self.assertEqual(prompt.length, 6)
        with self.assertRaisesRegex(ValueError, "expected_tokens"):
            _ = pointer.length
        with self.assertRaisesRegex(ValueError, "ImageChunk"):
            prompt.to_ints()

    def test_sending_an_image_is_unimplemented(self):
        image = types.ImageChunk(data=b"x", format="png", expected_tokens=1)
        sent = types.Datum(
            model_input=types.ModelInput.from_ints([1]).append(image),
            loss_fn_inputs={"target_tokens": [1, 2]})
        with self.assertRaises(tinker.InternalServerError) as raised:
            conversions.to_sample(sent, "cross_entropy")
        self.assertIsInstance(raised.exception, errors.UnimplementedError)
        self.assertIn("EncodedTextChunk", str(raised.exception))


class ToSampleTest(unittest.TestCase):

    def test_float_and_column_targets_become_token_ids(self):
        for targets in ([[2.0], [3.0]], TensorData(data=[2.0, 3.0],
                                                   dtype="float32")):
            with self.subTest(targets=targets):
                sample = conversions.to_sample(
                    datum([1, 2], target_tokens=targets), "cross_entropy")
                self.assertEqual(list(sample.target_tokens), [2, 3])
        with self.assertRaisesRegex(ValueError, "target_tokens"):
            conversions.to_sample(datum([1], target_tokens=TensorData(
                data=[2.5], dtype="float32")), "cross_entropy")

    def test_more_than_one_value_per_position_is_refused_by_key(self):
        wide = datum([1, 2], target_tokens=[2, 3], weights=[[1, 1], [1, 1]])
        with self.assertRaisesRegex(ValueError, r"'weights'.*\[2, 2\]"):
            conversions.to_sample(wide, "cross_entropy")

    def test_unmasked_rl_datums_weigh_only_sampled_positions(self):
        rl = datum([1, 2, 3, 4], target_tokens=[0, 0, 5, 6],
                   logprobs=[0.0, 0.0, -0.5, 0.0],
                   advantages=[0.0, 0.0, 1.0, 1.0])
        for loss_fn in ("importance_sampling", "ppo", "cispo"):
            with self.subTest(loss_fn):
                self.assertEqual(
                    list(conversions.to_sample(rl, loss_fn).weights),
                    [0.0, 0.0, 1.0, 1.0])
        # DRO's penalty does not vanish with the advantage; a mask or
        # weights given are the caller's.
        self.assertEqual(list(conversions.to_sample(rl, "dro").weights), [])
        masked = datum([1, 2], target_tokens=[2, 3], logprobs=[0.0, 0.0],
                       advantages=[0.0, 0.0], mask=[1.0, 1.0])
        self.assertEqual(list(conversions.to_sample(masked, "ppo").weights),
                         [1.0, 1.0])


def config_of(data, loss_fn_config, loss_fn="ppo"):
    return conversions.loss_fn_config_of(
        data, [conversions.to_sample(d, loss_fn) for d in data],
        loss_fn_config)


class ThresholdTest(unittest.TestCase):

    def test_one_threshold_per_call_folds_into_loss_fn_config(self):
        data = [datum([1, 2], target_tokens=[2, 3], mask=[0.0, 1.0],
                      clip_low_threshold=[0.0, 0.8],
                      clip_high_threshold=[1.2, 1.2])]
        # float32, as a TensorData stores them (and Tinker sends them).
        self.assertEqual(config_of(data, None),
                         {"clip_low_threshold": float(np.float32(0.8)),
                          "clip_high_threshold": float(np.float32(1.2))})
        self.assertEqual(config_of(data, {"clip_low_threshold": 0.8})
                         ["clip_low_threshold"], float(np.float32(0.8)))
        self.assertEqual(config_of([datum([1], target_tokens=[2])],
                                   {"beta": 0.1}), {"beta": 0.1})
        self.assertEqual(list(conversions.to_sample(data[0], "ppo").weights),
                         [0.0, 1.0])
        # Unmasked RL datums: the prompt padding does not count either.
        padded = [datum([1, 2, 3], target_tokens=[0, 4, 5],
                        logprobs=[0.0, -1.0, -2.0],
                        advantages=[0.0, 1.0, 1.0],
                        clip_high_threshold=[0.0, 1.3, 1.3])]
        self.assertEqual(config_of(padded, None),
                         {"clip_high_threshold": float(np.float32(1.3))})

    def test_varying_or_conflicting_thresholds_are_refused(self):
        varying = [datum([1, 2], target_tokens=[2, 3],
                         clip_low_threshold=[0.5, 0.8])]
        with self.assertRaises(tinker.InternalServerError) as raised:
            config_of(varying, None)
        self.assertEqual(raised.exception.code,
                         grpc.StatusCode.UNIMPLEMENTED)
        self.assertIn("clip_low_threshold", str(raised.exception))
        one = [datum([1], target_tokens=[2], clip_high_threshold=[1.5])]
        with self.assertRaisesRegex(ValueError, "clip_high_threshold"):
            config_of(one, {"clip_high_threshold": 2.0})
        wrong_length = [datum([1, 2], target_tokens=[2, 3],
                              clip_low_threshold=[0.8])]
        with self.assertRaisesRegex(ValueError, "clip_low_threshold"):
            config_of(wrong_length, None)


class MetricsTest(unittest.TestCase):

    def test_optim_step_metrics_are_tallys_extras(self):
        result = OptimStepResult.from_proto(tinker_step())
        metrics = conversions.optim_step_response(result).metrics
        self.assertEqual(metrics["tally/step"], 7.0)
        self.assertEqual(metrics["tally/learning_rate"], 0.5)
        self.assertEqual(metrics["tally/grad_norm"], 2.0)
        self.assertEqual(sorted(name for name in metrics
                                if not name.startswith("tally/")), [])


def tinker_step():
    from tally_client import pb  # pylint: disable=import-outside-toplevel
    return pb.OptimStepResponse(step=7, learning_rate=0.5, grad_norm=2.0)


class ErrorsTest(unittest.TestCase):

    def test_every_code_raises_tinkers_class_of_its_http_status(self):
        want = {
            "INVALID_ARGUMENT": (tinker.BadRequestError, 400),
            "FAILED_PRECONDITION": (tinker.BadRequestError, 400),
            "OUT_OF_RANGE": (tinker.BadRequestError, 400),
            "UNAUTHENTICATED": (tinker.AuthenticationError, 401),
            "PERMISSION_DENIED": (tinker.PermissionDeniedError, 403),
            "NOT_FOUND": (tinker.NotFoundError, 404),
            "ALREADY_EXISTS": (tinker.ConflictError, 409),
            "ABORTED": (tinker.ConflictError, 409),
            "RESOURCE_EXHAUSTED": (tinker.RateLimitError, 429),
            "INTERNAL": (tinker.InternalServerError, 500),
            "UNKNOWN": (tinker.InternalServerError, 500),
            "DATA_LOSS": (tinker.InternalServerError, 500),
            "UNIMPLEMENTED": (tinker.InternalServerError, 500),
        }
        for code in grpc.StatusCode:
            if code == grpc.StatusCode.OK:
                continue
            with self.subTest(code=code.name):
                error = errors.error_class(code)("M", code, "details")
                self.assertIsInstance(error, tinker.TallyError)
                self.assertIsInstance(error, tinker.TinkerError)
                self.assertIsInstance(error, tinker.APIError)
                self.assertTrue(error.message.startswith(
                    f"M: {code.name}: details"), error.message)
                if code.name in want:
                    cls, status = want[code.name]
                    self.assertIsInstance(error, cls)
                    self.assertEqual(error.status_code, status)
        self.assertIsInstance(
            errors.UnavailableError("M", grpc.StatusCode.UNAVAILABLE, "d"),
            tinker.APIConnectionError)
        self.assertIsInstance(
            errors.DeadlineExceededError(
                "M", grpc.StatusCode.DEADLINE_EXCEEDED, "d"),
            tinker.APITimeoutError)


class ServiceClientTest(unittest.TestCase):

    def connect(self, environ, **kwargs):
        """(target, token, tls) a ServiceClient made with `kwargs` under
        `environ` connects with."""
        with mock.patch.dict(os.environ, environ, clear=True), \
                mock.patch("tally_client.tinker.clients.ServerClient") as \
                server:
            tinker.ServiceClient(**kwargs)
        return server.call_args.args

    def test_base_url_and_api_key_come_from_tinkers_variables(self):
        self.assertEqual(self.connect({}), ("localhost:50051", None, None))
        self.assertEqual(
            self.connect({"TINKER_BASE_URL": "https://h:7",
                          "TINKER_API_KEY": "k"}), ("h:7", "k", True))
        self.assertEqual(
            self.connect({"TINKER_BASE_URL": "http://h:7",
                          "TINKER_API_KEY": "k", "TALLY_TOKEN": "t"}),
            ("h:7", "t", None))
        self.assertEqual(
            self.connect({"TINKER_BASE_URL": "h:7"}, base_url="grpc://g:8",
                         api_key="a"), ("g:8", "a", None))


class TokenizerTest(unittest.TestCase):

    def test_transformers_loads_the_base_directory(self):
        directory = tempfile.mkdtemp()
        self.addCleanup(os.rmdir, directory)
        fake = pytypes.ModuleType("transformers")
        fake.AutoTokenizer = mock.Mock()
        with mock.patch.dict(sys.modules, {"transformers": fake}):
            got = tokenizer.load_tokenizer(directory)
        fake.AutoTokenizer.from_pretrained.assert_called_once_with(directory)
        self.assertIs(got, fake.AutoTokenizer.from_pretrained.return_value)

    def test_tokenizers_reads_tokenizer_json_without_transformers(self):
        directory = tempfile.mkdtemp()
        path = os.path.join(directory, "tokenizer.json")
        with open(path, "w", encoding="utf-8") as f:
            f.write("{}")
        self.addCleanup(os.rmdir, directory)
        self.addCleanup(os.remove, path)
        fake = pytypes.ModuleType("tokenizers")
        fake.Tokenizer = mock.Mock()
        fake.Tokenizer.from_file.return_value.encode.return_value.ids = [4, 2]
        fake.Tokenizer.from_file.return_value.decode.return_value = "hi"
        with mock.patch.dict(sys.modules, {"transformers": None,
                                           "tokenizers": fake}):
            got = tokenizer.load_tokenizer(directory)
        fake.Tokenizer.from_file.assert_called_once_with(path)
        self.assertEqual(got.encode("hi", add_special_tokens=False), [4, 2])
        self.assertEqual(got.decode([4, 2]), "hi")

    def test_string_stops_use_the_base_directorys_tokenizer(self):
        directory = tempfile.mkdtemp()
        self.addCleanup(os.rmdir, directory)
        fake = pytypes.ModuleType("transformers")
        fake.AutoTokenizer = mock.Mock()
        fake.AutoTokenizer.from_pretrained.return_value.encode.return_value = \
            [9, 8]
        model = mock.Mock(model_id="m")
        sampler = tinker.SamplingClient(model, directory, sequenced=True)
        with mock.patch.dict(sys.modules, {"transformers": fake}):
            sampler.sample(types.ModelInput.from_ints([1]), 1,
                           types.SamplingParams(max_tokens=2, stop="</s>"))
        fake.AutoTokenizer.from_pretrained.return_value.encode \
            .assert_called_once_with("</s>", add_special_tokens=False)
        self.assertEqual(model.sample.call_args.kwargs["stop"], [[9, 8]])

    def test_errors_say_what_is_missing(self):
        with self.assertRaisesRegex(ValueError, "no tokenizer"):
            tokenizer.load_tokenizer(None)
        with self.assertRaisesRegex(ValueError, "not readable here"):
            tokenizer.load_tokenizer("/no/such/base")
        directory = tempfile.mkdtemp()
        self.addCleanup(os.rmdir, directory)
        with mock.patch.dict(sys.modules, {"transformers": None,
                                           "tokenizers": None}):
            with self.assertRaisesRegex(ImportError,
                                        "pip install transformers"):
                tokenizer.load_tokenizer(directory)


if __name__ == "__main__":
    unittest.main()
