"""The sampling calls of tally_client (TrainingClient.sample,
compute_logprobs) and of its Tinker client (SamplingClient,
save_weights_and_get_sampling_client, create_sampling_client) against the
in-process fake Trainer of fake_trainer.py: what each call sends (every
parameter, unset ones left unset, seq_ids in call order or none), how the
answers map (prompt-major sequences, stop reasons, None before the prompt
logprobs, top-k pairs), and the errors (refused before sending, or by the
server). test_sampling_server.py runs the same calls on a real server."""

import asyncio
import unittest

import numpy as np
import torch

import tally_client
from fake_trainer import (SERVER_SEED, FakeTrainer, completion, token_logprob,
                          topk)
from tally_client import RetryPolicy, StopReason, TrainingClient, pb, tinker
from tally_client.tinker import types

FAST_RETRY = RetryPolicy(max_attempts=2, initial_backoff=0.01,
                         max_backoff=0.02)
TIMEOUT = 30


def byte_tokenizer():
    """A tokenizer with transformers' encode signature: UTF-8 bytes."""
    class Bytes:
        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + list(
                text.encode("utf-8"))
    return Bytes()


class FakeTestCase(unittest.TestCase):

    def setUp(self):
        super().setUp()
        self.fake = FakeTrainer.start()
        self.addCleanup(self.fake.stop)

    def client(self, model_id="m"):
        client = TrainingClient(self.fake.target, model_id, first_seq_id=1,
                                retry=FAST_RETRY)
        self.addCleanup(client.close)
        return client

    def service(self):
        service = tinker.ServiceClient(base_url=self.fake.target,
                                       retry=FAST_RETRY)
        self.addCleanup(service.close)
        return service


class TrainingClientSampleTest(FakeTestCase):

    def test_every_parameter_is_sent_and_the_reply_maps_prompt_major(self):
        prompts = [[1, 2, 3], [4, 5]]
        result = self.client().sample(
            prompts, num_samples=3, max_tokens=2, temperature=0.5, top_p=0.9,
            top_k=5, stop=[7, [8, 9]], seed=11, include_prompt_logprobs=True,
            topk_prompt_logprobs=2).result(TIMEOUT)
        (request,) = self.fake.sent("Sample")
        self.assertEqual([list(p.tokens) for p in request.prompts], prompts)
        self.assertEqual(request.seq_id, 1)
        self.assertEqual(request.num_samples, 3)
        self.assertEqual(request.params.max_tokens, 2)
        self.assertEqual(request.params.temperature, 0.5)
        self.assertEqual(request.params.top_p, 0.9)
        self.assertEqual(request.params.top_k, 5)
        self.assertEqual(request.params.seed, 11)
        self.assertEqual(list(request.params.stop.token_ids), [7])
        self.assertEqual(
            [list(s.tokens) for s in request.params.stop.sequences], [[8, 9]])
        self.assertTrue(request.include_prompt_logprobs)
        self.assertEqual(request.topk_prompt_logprobs, 2)

        self.assertIsInstance(result, tally_client.SamplingResult)
        self.assertEqual(len(result.sequences), 6)
        for p, prompt in enumerate(prompts):
            for s in range(3):
                sequence = result.sequences[p * 3 + s]
                tokens = completion(prompt, s, 2)
                self.assertEqual(sequence.tokens, tokens)
                self.assertEqual(sequence.logprobs,
                                 [token_logprob(t) for t in tokens])
                self.assertIs(sequence.stop_reason, StopReason.STOP if s == 0
                              else StopReason.LENGTH)
            logprobs = result.prompt_logprobs[p]
            self.assertEqual(logprobs.logprobs,
                             [token_logprob(t) for t in prompt[1:]])
            self.assertEqual([(k.tokens, k.logprobs) for k in logprobs.topk],
                             [topk(t, 2) for t in prompt[1:]])
        self.assertEqual(result.seed, 11)

    def test_unset_parameters_stay_unset_and_an_empty_stop_is_sent(self):
        client = self.client()
        result = client.sample([[1]], max_tokens=1,
                               temperature=None).result(TIMEOUT)
        client.sample([[1]], max_tokens=1, stop=[]).result(TIMEOUT)
        unset, empty_stop = self.fake.sent("Sample")
        for field in ("temperature", "top_p", "top_k", "seed", "stop"):
            self.assertFalse(unset.params.HasField(field), field)
        self.assertEqual(unset.num_samples, 1)
        self.assertFalse(unset.include_prompt_logprobs)
        self.assertEqual(unset.topk_prompt_logprobs, 0)
        self.assertEqual(result.seed, SERVER_SEED)
        self.assertEqual(result.prompt_logprobs, [])
        self.assertTrue(empty_stop.params.HasField("stop"))
        self.assertEqual(empty_stop.params.stop, pb.StopConditions())
        self.assertEqual(empty_stop.params.temperature, 1.0)

    def test_numpy_and_torch_prompts_and_stops(self):
        self.client().sample(
            [np.array([3, 4]), torch.tensor([5, 6, 7])], max_tokens=1,
            stop=[np.int64(9), torch.tensor([1, 2])]).result(TIMEOUT)
        (request,) = self.fake.sent("Sample")
        self.assertEqual([list(p.tokens) for p in request.prompts],
                         [[3, 4], [5, 6, 7]])
        self.assertEqual(list(request.params.stop.token_ids), [9])
        self.assertEqual(list(request.params.stop.sequences[0].tokens), [1, 2])

    def test_bad_prompts_and_stops_are_refused_before_sending(self):
        client = self.client()
        cases = {"wrap a single prompt": dict(prompts=[1, 2, 3]),
                 "prompts[1]": dict(prompts=[[1], [2.5]]),
                 "a string stop needs a tokenizer":
                     dict(prompts=[[1]], stop="\n"),
                 "stop[0]": dict(prompts=[[1]], stop=[[True]])}
        for message, arguments in cases.items():
            with self.subTest(message), self.assertRaises(ValueError) as raised:
                client.sample(max_tokens=1, **arguments)
            self.assertIn(message, str(raised.exception))
        self.assertEqual(self.fake.requests, [])

    def test_samples_take_seq_ids_in_call_order_unless_unsequenced(self):
        client = self.client()
        client.optim_step().result(TIMEOUT)
        after_step = client.sample([[1]], max_tokens=1)
        unsequenced = client.sample([[1]], max_tokens=1, sequenced=False)
        logprobs = client.compute_logprobs([[1, 2]])
        for future in (after_step, unsequenced, logprobs):
            future.result(TIMEOUT)
        (step,) = self.fake.sent("OptimStep")
        self.assertEqual(step.seq_id, 1)
        # The fake answers in arrival order, not by seq_id.
        self.assertEqual(sorted(r.seq_id for r in self.fake.sent("Sample")),
                         [0, 2])
        self.assertEqual(self.fake.sent("ComputeLogprobs")[0].seq_id, 3)
        self.assertEqual(after_step.result().step, 1)

    def test_a_refused_sample_raises_and_its_seq_id_is_filled(self):
        client = self.client()
        with self.assertRaises(tally_client.InvalidArgumentError) as raised:
            client.sample([[1]], max_tokens=0).result(TIMEOUT)
        self.assertIn("params.max_tokens", raised.exception.details)
        (filler,) = self.fake.sent("ForwardBackward")
        self.assertEqual(filler.seq_id, 1)
        self.assertTrue(filler.forward_only)
        client.sample([[1]], max_tokens=1).result(TIMEOUT)
        self.assertEqual(self.fake.sent("Sample")[-1].seq_id, 2)

    def test_compute_logprobs(self):
        prompts = [[4, 9, 2], [7, 1]]
        result = self.client().compute_logprobs(prompts, topk=3).result(
            TIMEOUT)
        (request,) = self.fake.sent("ComputeLogprobs")
        self.assertEqual([list(p.tokens) for p in request.prompts], prompts)
        self.assertEqual(request.topk, 3)
        self.assertIsInstance(result, tally_client.LogprobsResult)
        for prompt, logprobs in zip(prompts, result.prompts):
            self.assertEqual(logprobs.logprobs,
                             [token_logprob(t) for t in prompt[1:]])
            self.assertEqual(logprobs.topk[0].tokens, topk(prompt[1], 3)[0])


class TinkerSamplingClientTest(FakeTestCase):

    def sampler(self, **kwargs):
        training = self.service().create_lora_training_client(
            tinker.DEMO_MODEL, rank=4)
        return training, training.save_weights_and_get_sampling_client(
            **kwargs)

    def test_sampling_params_and_the_response_as_tinkers(self):
        _, sampler = self.sampler()
        prompt = [1, 2, 3]
        response = sampler.sample(
            types.ModelInput.from_ints(prompt), 2,
            types.SamplingParams(max_tokens=2, temperature=0.0, stop=[7]),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=2).result(TIMEOUT)
        (request,) = self.fake.sent("Sample")
        self.assertEqual(request.model_id, sampler.model_id)
        self.assertEqual(list(request.prompts[0].tokens), prompt)
        self.assertEqual(request.num_samples, 2)
        self.assertTrue(request.params.HasField("temperature"))
        self.assertEqual(request.params.temperature, 0.0)
        self.assertEqual((request.params.top_k, request.params.top_p), (-1, 1))
        self.assertFalse(request.params.HasField("seed"))
        self.assertEqual(list(request.params.stop.token_ids), [7])

        self.assertIsInstance(response, types.SampleResponse)
        self.assertEqual(
            [(s.stop_reason, s.tokens, s.logprobs) for s in response.sequences],
            [("stop" if s == 0 else "length", completion(prompt, s, 2),
              [token_logprob(t) for t in completion(prompt, s, 2)])
             for s in range(2)])
        self.assertEqual(response.prompt_logprobs,
                         [None] + [token_logprob(t) for t in prompt[1:]])
        self.assertEqual(response.topk_prompt_logprobs,
                         [None] + [list(zip(*topk(t, 2))) for t in prompt[1:]])
        self.assertEqual(response.seed, SERVER_SEED)

    def test_no_prompt_logprobs_unless_asked_and_an_empty_stop(self):
        _, sampler = self.sampler()
        response = sampler.sample(types.ModelInput.from_ints([5]), 1,
                                  types.SamplingParams(max_tokens=1, seed=3)
                                  ).result(TIMEOUT)
        self.assertIsNone(response.prompt_logprobs)
        self.assertIsNone(response.topk_prompt_logprobs)
        sampler.sample(types.ModelInput.from_ints([5]), 1,
                       types.SamplingParams(max_tokens=1, stop=[])
                       ).result(TIMEOUT)
        default_stop, no_stop = self.fake.sent("Sample")
        self.assertEqual(default_stop.params.seed, 3)
        self.assertFalse(default_stop.params.HasField("stop"))
        self.assertTrue(no_stop.params.HasField("stop"))
        self.assertEqual(no_stop.params.stop, pb.StopConditions())

    def test_string_stops_go_through_the_tokenizer_or_are_refused(self):
        _, plain = self.sampler()
        prompt = types.ModelInput.from_ints([1])
        for stop in ("\n\n", ["ab"]):
            with self.subTest(stop=stop), \
                    self.assertRaises(ValueError) as raised:
                plain.sample(prompt, 1, types.SamplingParams(max_tokens=1,
                                                             stop=stop))
            self.assertIn("tokenizer", str(raised.exception))
        with self.assertRaises(ValueError) as raised:
            plain.sample(prompt, 1, types.SamplingParams())
        self.assertIn("max_tokens", str(raised.exception))
        with self.assertRaisesRegex(ValueError, "not both"):
            plain.sample(prompt, 1, types.SamplingParams(max_tokens=1,
                                                         stop=["a", 2]))
        with self.assertRaisesRegex(ValueError, "tokenizer"):
            plain.get_tokenizer()
        self.assertEqual(self.fake.sent("Sample"), [])

        _, tokenized = self.sampler(tokenizer=byte_tokenizer())
        tokenized.sample(prompt, 1, types.SamplingParams(
            max_tokens=1, stop=["\n\n", "ab"])).result(TIMEOUT)
        (request,) = self.fake.sent("Sample")
        self.assertEqual(
            [list(s.tokens) for s in request.params.stop.sequences],
            [[10, 10], [97, 98]])
        self.assertEqual(list(request.params.stop.token_ids), [])

    def test_compute_logprobs_and_the_async_variants(self):
        _, sampler = self.sampler()
        prompt = types.ModelInput.from_ints([4, 8, 15])
        expected = [None, token_logprob(8), token_logprob(15)]
        self.assertEqual(sampler.compute_logprobs(prompt).result(TIMEOUT),
                         expected)

        async def run():
            response = await sampler.sample_async(
                prompt, 1, types.SamplingParams(max_tokens=1))
            logprobs = await sampler.compute_logprobs_async(prompt)
            return response, logprobs, await sampler.get_base_model_async()

        response, logprobs, base = asyncio.run(run())
        self.assertIsInstance(response, types.SampleResponse)
        self.assertEqual(response.sequences[0].tokens,
                         completion([4, 8, 15], 0, 1))
        self.assertEqual(logprobs, expected)
        self.assertEqual(base, tinker.DEMO_MODEL)

    def test_a_training_clients_sampler_follows_its_steps(self):
        training, sampler = self.sampler()
        training.optim_step(types.AdamParams()).result(TIMEOUT)
        response = sampler.sample(types.ModelInput.from_ints([1]), 1,
                                  types.SamplingParams(max_tokens=1))
        self.assertEqual(response.result(TIMEOUT).step, 1)
        (step,) = self.fake.sent("OptimStep")
        self.assertEqual(self.fake.sent("Sample")[0].seq_id, step.seq_id + 1)
        # A name freezes a snapshot, which the sampler then reads.
        frozen = training.save_weights_and_get_sampling_client("snapshot")
        (saved,) = self.fake.sent("SaveWeightsForSampler")
        self.assertEqual(saved.name, "snapshot")
        frozen.sample(types.ModelInput.from_ints([1]), 1,
                      types.SamplingParams(max_tokens=1)).result(TIMEOUT)
        self.assertEqual(self.fake.sent("Sample")[-1].sampler, "snapshot")
        self.assertEqual(self.fake.sent("Sample")[0].sampler, "")

    def test_create_sampling_client_of_a_model_id(self):
        service = self.service()
        sampler = service.create_sampling_client(model_path="m")
        self.assertEqual(sampler.get_base_model(), "base-of-m")
        sampler.sample(types.ModelInput.from_ints([2]), 1,
                       types.SamplingParams(max_tokens=1)).result(TIMEOUT)
        self.assertEqual(self.fake.sent("Sample")[0].seq_id, 0)
        with self.assertRaises(tally_client.NotFoundError):
            service.create_sampling_client(model_path="nope")
        for arguments in ({}, {"model_path": "m", "base_model": "b"},
                          {"model_path": "m/sampler_weights/x"},
                          {"model_path": "m", "seed": 1}):
            with self.subTest(arguments=arguments), \
                    self.assertRaises(ValueError):
                service.create_sampling_client(**arguments)

    def test_a_training_clients_create_sampling_client(self):
        training, _ = self.sampler()
        own = training.create_sampling_client(training.model_id)
        other = training.create_sampling_client("m")
        params = types.SamplingParams(max_tokens=1)
        for sampler in (own, other):
            sampler.sample(types.ModelInput.from_ints([1]), 1,
                           params).result(TIMEOUT)
        mine, theirs = self.fake.sent("Sample")
        self.assertEqual((mine.model_id, mine.seq_id), (training.model_id, 1))
        self.assertEqual((theirs.model_id, theirs.seq_id), ("m", 0))

    def test_create_sampling_client_of_a_base_model_owns_its_adapter(self):
        sampler = self.service().create_sampling_client(
            base_model="/data/base", dtype="fp64")
        (create,) = self.fake.sent("CreateModel")
        self.assertEqual(create.init_checkpoint, "/data/base")
        self.assertEqual(create.dtype, pb.DTYPE_FLOAT64)
        self.assertEqual(create.lora.rank, 1)
        self.assertEqual((create.lora.train_attn, create.lora.train_mlp,
                          create.lora.train_unembed), (True, False, False))
        self.assertEqual(sampler.get_base_model(), "/data/base")
        sampler.close()
        sampler.close()
        (delete,) = self.fake.sent("DeleteModel")
        self.assertEqual(delete.model_id, sampler.model_id)


if __name__ == "__main__":
    unittest.main()
