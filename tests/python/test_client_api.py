"""tally_client's API without a server: the dtype spellings every dtype
argument accepts, the exception class of every gRPC status code, the type
hints of the public API, and the typing files the package ships (py.typed,
the generated modules' .pyi stubs)."""

import importlib
import inspect
import os
import unittest

import grpc

import tally_client
from tally_client import errors, pb
from tally_client.tinker import ServiceClient

# The modules whose public functions and methods must be annotated.
PUBLIC_MODULES = ("tally_client.client", "tally_client.dtypes",
                  "tally_client.errors", "tally_client.results",
                  "tally_client.samples", "tally_client.sampling",
                  "tally_client.server", "tally_client.tinker.api_future",
                  "tally_client.tinker.clients",
                  "tally_client.tinker.conversions",
                  "tally_client.tinker.sampling_client",
                  "tally_client.tinker.tokenizer",
                  "tally_client.tinker.types.datum",
                  "tally_client.tinker.types.image_chunk",
                  "tally_client.tinker.types.model_input",
                  "tally_client.tinker.types.tensor_data")

# Every spelling and the DType it means (the set tallyctl's --dtype takes).
SPELLINGS = {
    "float32": pb.DTYPE_FLOAT32, "FP32": pb.DTYPE_FLOAT32,
    "Float64": pb.DTYPE_FLOAT64, "fp64": pb.DTYPE_FLOAT64,
    "bfloat16": pb.DTYPE_BFLOAT16, "BF16": pb.DTYPE_BFLOAT16,
    "float16": pb.DTYPE_FLOAT16, "fp16": pb.DTYPE_FLOAT16,
    "DTYPE_BFLOAT16": pb.DTYPE_BFLOAT16, "dtype_float64": pb.DTYPE_FLOAT64,
    "DTYPE_UNSPECIFIED": pb.DTYPE_UNSPECIFIED,
    pb.DTYPE_FLOAT32: pb.DTYPE_FLOAT32, 3: pb.DTYPE_BFLOAT16,
    None: pb.DTYPE_UNSPECIFIED,
}
BAD_DTYPES = ("half", "bfloat", "float", "", "int8", 5, -1, True, 1.0)


def camel_case(code):
    return "".join(part.capitalize() for part in code.name.split("_"))


class DTypeTest(unittest.TestCase):

    def test_every_spelling_parses(self):
        for spelling, dtype in SPELLINGS.items():
            with self.subTest(spelling=spelling):
                self.assertEqual(tally_client.parse_dtype(spelling), dtype)

    def test_a_bad_dtype_names_the_argument_and_the_spellings(self):
        for bad in BAD_DTYPES:
            with self.subTest(dtype=bad):
                with self.assertRaises(ValueError) as raised:
                    tally_client.parse_dtype(bad, "save_dtype")
                message = str(raised.exception)
                self.assertTrue(message.startswith("save_dtype: "), message)
                for spelling in ("float32|fp32", "float64|fp64",
                                 "bfloat16|bf16", "DTYPE_BFLOAT16 (3)"):
                    self.assertIn(spelling, message)
                self.assertNotIn("enum label", message)

    def test_create_model_and_export_weights_refuse_before_sending(self):
        # No server listens: a request that were sent would fail UNAVAILABLE.
        client = tally_client.TrainingClient("localhost:1", "m",
                                             first_seq_id=1)
        self.addCleanup(client.close)
        for call in (lambda: client.create_model(dtype="half"),
                     lambda: client.export_weights("/x", dtype="half")):
            with self.assertRaisesRegex(ValueError, "^dtype: .*bf16"):
                call()

    def test_tinker_export_refuses_a_bad_dtype(self):
        service = ServiceClient(base_url="localhost:1")
        self.addCleanup(service.close)
        training = tally_client.tinker.TrainingClient(
            service.server.training_client("m", first_seq_id=1), "m")
        with self.assertRaisesRegex(ValueError, "^dtype: .*bf16"):
            training.save_weights_for_sampler("w", dtype="half")


class ErrorClassTest(unittest.TestCase):

    def test_each_status_code_has_its_own_subclass(self):
        classes = set()
        for code in grpc.StatusCode:
            if code == grpc.StatusCode.OK:
                continue
            with self.subTest(code=code.name):
                cls = tally_client.error_class(code)
                self.assertTrue(issubclass(cls, tally_client.TallyError))
                # ABORTED raises WindowAbortedError, an AbortedError.
                named = getattr(tally_client, camel_case(code) + "Error")
                self.assertTrue(issubclass(cls, named), (cls, named))
                self.assertIsNot(named, tally_client.TallyError)
                classes.add(named)
                error = cls("GetModel", code, "the details", "A_REASON")
                self.assertEqual((error.method, error.code, error.reason),
                                 ("GetModel", code, "A_REASON"))
                self.assertTrue(error.details.startswith("the details"))
                self.assertIn(f"GetModel: {code.name}: the details",
                              str(error))
        self.assertEqual(len(classes), len(grpc.StatusCode) - 1)

    def test_the_window_errors_keep_their_behaviour(self):
        aborted = tally_client.error_class(grpc.StatusCode.ABORTED)(
            "OptimStep", grpc.StatusCode.ABORTED, "poisoned")
        self.assertIsInstance(aborted, tally_client.WindowAbortedError)
        self.assertIsInstance(aborted, tally_client.AbortedError)
        self.assertIn("call abort_window()", str(aborted))
        self.assertTrue(issubclass(tally_client.PendingWindowError,
                                   tally_client.FailedPreconditionError))
        self.assertIs(tally_client.tinker.TallyError, tally_client.TallyError)


class TypingTest(unittest.TestCase):

    def public_functions(self):
        """(qualified name, function) of every public function and method
        (and __init__) the public modules define."""
        for module_name in PUBLIC_MODULES:
            module = importlib.import_module(module_name)
            for name, value in vars(module).items():
                if name.startswith("_") or getattr(
                        value, "__module__", None) != module_name:
                    continue
                if inspect.isfunction(value):
                    yield f"{module_name}.{name}", value
                elif inspect.isclass(value):
                    for attr, member in vars(value).items():
                        if inspect.isfunction(member) and (
                                not attr.startswith("_") or attr == "__init__"):
                            if member.__qualname__.startswith(value.__name__):
                                yield f"{module_name}.{name}.{attr}", member

    def test_every_public_function_is_annotated(self):
        count = 0
        for name, function in self.public_functions():
            count += 1
            with self.subTest(function=name):
                signature = inspect.signature(function)
                missing = [p for p in list(signature.parameters)
                           if p not in ("self", "cls")
                           and p not in function.__annotations__]
                self.assertEqual(missing, [])
                self.assertIn("return", function.__annotations__)
        self.assertGreater(count, 60)

    def test_the_package_ships_py_typed_and_message_stubs(self):
        package = os.path.dirname(tally_client.__file__)
        self.assertTrue(os.path.isfile(os.path.join(package, "py.typed")))
        for module in (pb, errors.error_details_pb2, errors.status_pb2):
            stub = os.path.splitext(module.__file__)[0] + ".pyi"
            with self.subTest(stub=stub), open(stub, encoding="utf-8") as f:
                self.assertIn("class ", f.read())
        with open(os.path.splitext(pb.__file__)[0] + ".pyi",
                  encoding="utf-8") as f:
            self.assertIn("class ModelInfo(_message.Message)", f.read())

    def test_the_messages_live_inside_the_client_package(self):
        self.assertEqual(pb.__name__,
                         "tally_client._proto.tally.v1.trainer_pb2")
        self.assertEqual(pb.DESCRIPTOR.package, "tally.v1")
        self.assertEqual(tally_client.pb_grpc.TrainerStub.__module__,
                         "tally_client._proto.tally.v1.trainer_pb2_grpc")


if __name__ == "__main__":
    unittest.main()
