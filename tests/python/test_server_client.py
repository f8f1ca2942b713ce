"""tally_client against a real 1-rank tally-server: ServerClient's
server-level calls (server_info, list_models over several pages), the
TrainingClients that share its connection, the dtype spellings of
create_model, and the exception class of each status code the server
answers."""

import unittest

import grpc

from tally_client import (DType, FailedPreconditionError,
                          InvalidArgumentError, ModelInfo, ModelList,
                          NotFoundError, RetryPolicy, ServerClient, TallyError,
                          TrainingClient, pb)
from tally_testing import TINY_LLAMA, SharedServerTestCase

FAST_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.01, max_backoff=0.05)


class ServerClientTest(SharedServerTestCase):

    TEMP_PREFIX = "tally_server_client_"

    def setUp(self):
        self.server = ServerClient(self.target, retry=FAST_RETRY)
        self.addCleanup(self.server.close)

    def new_model(self, model_id, **fields):
        client = self.server.training_client(model_id)
        info = client.create_model(config=TINY_LLAMA, seed=3, **fields)
        self.addCleanup(client.delete_model)
        self.assertEqual(info.model_id, model_id)
        return client, info

    def test_list_models_reads_every_page(self):
        ids = ["list-a", "list-b", "list-c"]
        for model_id in ids:
            self.new_model(model_id)
        paged = self.server.list_models(page_size=1)
        self.assertIsInstance(paged, ModelList)
        self.assertTrue(all(isinstance(m, ModelInfo) for m in paged.models))
        self.assertEqual(sorted(m.model_id for m in paged.models
                                if m.model_id.startswith("list-")), ids)
        self.assertEqual(len(paged.raw.models), len(paged.models))
        self.assertEqual(sorted(m.model_id for m in paged.models),
                         sorted(m.model_id for m in
                                self.server.list_models().models))

    def test_server_info_from_the_server_and_from_a_model_client(self):
        info = self.server.server_info()
        self.assertEqual(info.mesh.world_size, 1)
        self.assertIn(pb.DTYPE_BFLOAT16, info.dtypes)
        self.assertIn(DType.BFLOAT16, info.dtypes)
        with TrainingClient(self.target, "no-such-model") as client:
            self.assertEqual(client.server_info(), info)

    def test_model_clients_share_the_connection(self):
        client, _ = self.new_model("shared")
        self.assertIs(client.server, self.server)
        client.close()  # leaves the ServerClient's channel open
        self.assertEqual(client.get_model().model_id, "shared")
        self.assertTrue(any(m.model_id == "shared"
                            for m in self.server.list_models().models))

    def test_create_model_takes_every_dtype_spelling(self):
        for n, spelling in enumerate(("bf16", "BFLOAT16", "DTYPE_BFLOAT16",
                                      pb.DTYPE_BFLOAT16)):
            with self.subTest(dtype=spelling):
                _, info = self.new_model(f"bf16-{n}", dtype=spelling)
                self.assertEqual(info.dtype, pb.DTYPE_BFLOAT16)
        _, info = self.new_model("fp64", dtype="FP64")
        self.assertEqual(info.dtype, pb.DTYPE_FLOAT64)

    def test_each_refusal_raises_the_class_of_its_code(self):
        missing = self.server.training_client("missing")
        with self.assertRaises(NotFoundError) as raised:
            missing.get_model()
        self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertEqual(raised.exception.method, "GetModel")
        # float16 is a storage dtype: the server refuses to train in it.
        with self.assertRaisesRegex(InvalidArgumentError, "DTYPE_FLOAT16"):
            self.server.training_client("fp16").create_model(
                config=TINY_LLAMA, dtype="fp16")
        client, _ = self.new_model("empty-window")
        with self.assertRaisesRegex(FailedPreconditionError,
                                    "nothing accumulated") as raised:
            client.optim_step().result()
        self.assertIsInstance(raised.exception, TallyError)
        self.assertEqual(raised.exception.code,
                         grpc.StatusCode.FAILED_PRECONDITION)


if __name__ == "__main__":
    unittest.main()
