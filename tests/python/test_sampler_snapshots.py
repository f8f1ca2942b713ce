"""Sampler snapshots against a real tally-server: save_weights_for_sampler
freezes the weights of the last step, so that sampling the snapshot after
more optim_steps returns exactly what sampling the live weights returned
when it was saved (tokens, and logprobs bitwise), on one rank and on a
tp 2 x dp_shard 2 server; names are unique per model,
listed, deleted (and with their model); the Tinker client's
save_weights_for_sampler handle and save_weights_and_get_sampling_client(name)
sample the snapshot; and a snapshot that does not fit --max-memory-bytes is
refused with RESOURCE_EXHAUSTED before anything is copied."""

import unittest

from tally_client import (AlreadyExistsError, NotFoundError,
                          ResourceExhaustedError, TrainingClient, sample,
                          tinker)
from tally_client.tinker import types
from tally_testing import TINY_LLAMA, ServerTestCase, SharedServerTestCase

PROMPTS = [[3, 17, 42, 5], [60, 1]]
TIMEOUT = 120


def train(client, seed):
    """One window of one call and its step."""
    text = [(7 * i + seed) % TINY_LLAMA["vocab_size"] for i in range(12)]
    client.forward_backward([sample(text[:-1], text[1:])])
    return client.optim_step(adam={"learning_rate": 1e-2}).result(TIMEOUT)


def draw(client, sampler=None):
    """A seeded sample of PROMPTS: (tokens, logprobs) of every sequence."""
    result = client.sample(PROMPTS, num_samples=2, max_tokens=5,
                           temperature=0.9, stop=[], seed=31,
                           sampler=sampler).result(TIMEOUT)
    return result.step, [(s.tokens, s.logprobs) for s in result.sequences]


class SamplerSnapshotServerTest(SharedServerTestCase):
    """One single-rank server; each test its own fp64 tiny Llama."""

    TEMP_PREFIX = "tally_snapshots_"

    def model(self, model_id, **fields):
        client = TrainingClient(self.target, model_id)
        self.addCleanup(client.close)
        client.create_model(config=TINY_LLAMA, seed=5, dtype="fp64", **fields)
        train(client, 3)
        return client

    def test_a_snapshot_is_frozen_across_steps(self):
        client = self.model("frozen")
        step, live = draw(client)
        prompt_logprobs = client.compute_logprobs(PROMPTS).result(TIMEOUT)
        info = client.save_weights_for_sampler("s1").result(TIMEOUT)
        self.assertEqual((info.model_id, info.name, info.step), ("frozen",
                                                                 "s1", 1))
        self.assertEqual(info.path, "tally://frozen/samplers/s1")
        self.assertFalse(info.is_adapter)
        self.assertEqual(info.bytes, client.get_model().trainable_bytes)
        train(client, 4)
        train(client, 5)
        self.assertEqual(draw(client, "s1"), (step, live))
        frozen = client.compute_logprobs(PROMPTS, sampler="s1").result(TIMEOUT)
        self.assertEqual([p.logprobs for p in frozen.prompts],
                         [p.logprobs for p in prompt_logprobs.prompts])
        now_step, now = draw(client)
        self.assertEqual(now_step, 3)
        self.assertNotEqual(now, live)

    def test_names_are_unique_listed_and_deleted(self):
        client = self.model("names")
        client.save_weights_for_sampler("a").result(TIMEOUT)
        with self.assertRaisesRegex(AlreadyExistsError, "sampler 'a'"):
            client.save_weights_for_sampler("a").result(TIMEOUT)
        self.assertEqual([s.name for s in client.list_samplers()], ["a"])
        client.delete_sampler("a")
        self.assertEqual(client.list_samplers(), [])
        with self.assertRaisesRegex(NotFoundError, "sampler 'a'"):
            client.sample(PROMPTS, max_tokens=2, sampler="a").result(TIMEOUT)
        with self.assertRaisesRegex(NotFoundError, "sampler 'a'"):
            client.delete_sampler("a")
        # DeleteModel takes its snapshots along.
        client.save_weights_for_sampler("b").result(TIMEOUT)
        client.delete_model()
        client.create_model(config=TINY_LLAMA, seed=5, dtype="fp64")
        self.assertEqual(client.list_samplers(), [])

    def test_an_adapter_snapshot_holds_the_adapter(self):
        client = self.model("adapter", lora={"rank": 2})
        info = client.save_weights_for_sampler("lora").result(TIMEOUT)
        self.assertTrue(info.is_adapter)
        self.assertEqual(info.bytes, client.get_model().trainable_bytes)

    def test_tinker_samples_the_snapshot(self):
        service = tinker.ServiceClient(base_url=self.target)
        self.addCleanup(service.close)
        training = service.create_lora_training_client(
            tinker.DEMO_MODEL, rank=2, config=TINY_LLAMA, base_seed=6,
            dtype="fp64")
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4],
                            "weights": [1.0, 1.0, 1.0]})
        training.forward_backward([datum], "cross_entropy").result(TIMEOUT)
        training.optim_step(types.AdamParams(learning_rate=0.1)).result(
            TIMEOUT)
        prompt = types.ModelInput.from_ints(PROMPTS[0])
        params = types.SamplingParams(max_tokens=4, temperature=0.9, seed=2)

        def tokens_and_logprobs(sampler):
            response = sampler.sample(prompt, 2, params).result(TIMEOUT)
            return [(s.tokens, s.logprobs) for s in response.sequences]

        bound = training.save_weights_and_get_sampling_client("t1")
        want = tokens_and_logprobs(bound)
        path = training.save_weights_for_sampler("t2").result(TIMEOUT).path
        self.assertEqual(path, f"tally://{training.model_id}/samplers/t2")
        for _ in range(2):
            training.forward_backward([datum], "cross_entropy").result(TIMEOUT)
            training.optim_step(types.AdamParams(learning_rate=0.1)).result(
                TIMEOUT)
        self.assertEqual(tokens_and_logprobs(bound), want)
        by_path = service.create_sampling_client(model_path=path)
        self.assertEqual(tokens_and_logprobs(by_path), want)
        live = training.save_weights_and_get_sampling_client()
        self.assertNotEqual(tokens_and_logprobs(live), want)


class SamplerSnapshotMeshServerTest(ServerTestCase):

    def test_every_rank_freezes_its_shard(self):
        # tp 2 x dp_shard 2: the command reaches every rank, each copies
        # its own shard, and the snapshot samples as the live weights did.
        mesh = self.start_server(extra_args=[
            "--nproc-per-node", "4", "--dp-shard", "2", "--tp", "2"])
        client = TrainingClient(f"localhost:{mesh.server.grpc_port}", "m")
        self.addCleanup(client.close)
        client.create_model(config=TINY_LLAMA, seed=5, dtype="fp64")
        train(client, 3)
        live = draw(client)
        client.save_weights_for_sampler("s").result(TIMEOUT)
        train(client, 4)
        self.assertEqual(draw(client, "s"), live)
        self.assertNotEqual(draw(client), live)
        client.delete_sampler("s")
        with self.assertRaisesRegex(NotFoundError, "sampler 's'"):
            draw(client, "s")


class SamplerSnapshotAdmissionTest(ServerTestCase):

    def test_a_snapshot_that_does_not_fit_is_refused(self):
        # The model's parameters, from a server without a limit.
        sizing = self.start_server(name="sizing")
        client = TrainingClient(f"localhost:{sizing.server.grpc_port}", "m")
        self.addCleanup(client.close)
        parameters = client.create_model(config=TINY_LLAMA,
                                         dtype="fp64").num_parameters
        # AdamW keeps 4 copies of the fp64 parameters; a snapshot is a 5th.
        limit = int(4.5 * 8 * parameters)
        small = self.start_server(name="small", extra_args=[
            "--max-memory-bytes", str(limit)])
        client = TrainingClient(f"localhost:{small.server.grpc_port}", "m")
        self.addCleanup(client.close)
        client.create_model(config=TINY_LLAMA, dtype="fp64")
        with self.assertRaisesRegex(ResourceExhaustedError,
                                    "sampler snapshot.*--max-memory-bytes"):
            client.save_weights_for_sampler("s").result(TIMEOUT)
        self.assertEqual(client.list_samplers(), [])


if __name__ == "__main__":
    unittest.main()
