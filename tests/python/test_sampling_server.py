"""tally_client's sampling calls against a real tally-server: the
log-probability returned with each sampled token is ForwardBackward's
log-probability of the same completed sequence (fp64, to 1e-10 relative),
greedy sampling takes the argmax, compute_logprobs matches the forward, a
seed reproduces its tokens, sampling neither sees nor disturbs a pending
window, and the Tinker client's base_model sampler computes the base.
test_sampling_client.py checks the conversions against a fake server;
test_rl_loop.py runs the RL loop through the Tinker client."""

import unittest

import numpy as np

from tally_client import StopReason, TrainingClient, sample, tinker
from tally_client.tinker import types
from tally_testing import TINY_LLAMA, SharedServerTestCase

PROMPTS = [[3, 17, 42, 5], [60, 1]]
MAX_TOKENS = 6
RTOL = 1e-10
TIMEOUT = 120


class SamplingServerTest(SharedServerTestCase):
    """One single-rank server; each test its own fp64 tiny Llama, stepped
    once so that its weights are not the initial ones."""

    TEMP_PREFIX = "tally_sampling_"

    def model(self, model_id):
        client = TrainingClient(self.target, model_id)
        self.addCleanup(client.close)
        client.create_model(config=TINY_LLAMA, seed=5, dtype="fp64")
        text = [(7 * i + 3) % TINY_LLAMA["vocab_size"] for i in range(12)]
        client.forward_backward([sample(text[:-1], text[1:])])
        client.optim_step(adam={"learning_rate": 1e-2}).result(TIMEOUT)
        return client

    def forward_logprobs(self, client, tokens):
        """ForwardBackward's (forward only) logprob of each token of
        `tokens` after the first."""
        result = client.forward_backward(
            [sample(tokens[:-1], tokens[1:])], forward_only=True,
            return_logprobs=True).result(TIMEOUT)
        return np.array(result.samples[0].logprobs)

    def test_sampled_logprobs_equal_forward_backwards(self):
        client = self.model("exact")
        for temperature in (0.0, 0.8):
            with self.subTest(temperature=temperature):
                result = client.sample(
                    PROMPTS, num_samples=2, max_tokens=MAX_TOKENS,
                    temperature=temperature, stop=[], seed=9).result(TIMEOUT)
                self.assertEqual(result.step, 1)
                self.assertEqual(len(result.sequences), 2 * len(PROMPTS))
                for i, sequence in enumerate(result.sequences):
                    prompt = PROMPTS[i // 2]
                    self.assertEqual(len(sequence.tokens), MAX_TOKENS)
                    self.assertIs(sequence.stop_reason, StopReason.LENGTH)
                    full = prompt + sequence.tokens
                    want = self.forward_logprobs(client, full)[len(prompt) - 1:]
                    np.testing.assert_allclose(sequence.logprobs, want,
                                               rtol=RTOL, atol=0)

    def test_greedy_takes_the_argmax_and_stops_on_a_stop_token(self):
        client = self.model("greedy")
        prompt = PROMPTS[0]
        greedy = client.sample([prompt], max_tokens=MAX_TOKENS,
                               temperature=0.0, stop=[]
                               ).result(TIMEOUT).sequences[0]
        # Each token is the most probable continuation of the text before
        # it: the top-1 of ComputeLogprobs over the completed text.
        top = client.compute_logprobs([prompt + greedy.tokens],
                                      topk=1).result(TIMEOUT)
        self.assertEqual([position.tokens[0] for position in
                          top.prompts[0].topk[len(prompt) - 1:]],
                         greedy.tokens)
        stop_at = greedy.tokens[2]
        stopped = client.sample([prompt], max_tokens=MAX_TOKENS,
                                temperature=0.0, stop=[stop_at]
                                ).result(TIMEOUT).sequences[0]
        first = greedy.tokens.index(stop_at)
        self.assertEqual(stopped.tokens, greedy.tokens[:first + 1])
        self.assertIs(stopped.stop_reason, StopReason.STOP)

    def test_compute_logprobs_equals_the_forward(self):
        client = self.model("prompt")
        result = client.compute_logprobs(PROMPTS, topk=3).result(TIMEOUT)
        for prompt, logprobs in zip(PROMPTS, result.prompts):
            np.testing.assert_allclose(
                logprobs.logprobs, self.forward_logprobs(client, prompt),
                rtol=RTOL, atol=0)
            self.assertEqual(len(logprobs.topk), len(prompt) - 1)
            for position in logprobs.topk:
                self.assertEqual(len(position.tokens), 3)
                self.assertEqual(position.logprobs,
                                 sorted(position.logprobs, reverse=True))

    def test_a_seed_reproduces_its_tokens_and_a_window_stays_pending(self):
        client = self.model("seeded")
        first = client.sample(PROMPTS, num_samples=3, max_tokens=MAX_TOKENS,
                              seed=123).result(TIMEOUT)
        client.forward_backward([sample([1, 2, 3], [2, 3, 4])]).result(TIMEOUT)
        again = client.sample(PROMPTS, num_samples=3, max_tokens=MAX_TOKENS,
                              seed=123).result(TIMEOUT)
        self.assertEqual([s.tokens for s in again.sequences],
                         [s.tokens for s in first.sequences])
        self.assertEqual(again.seed, 123)
        self.assertEqual(client.pending_window()[0], 1)
        self.assertEqual(client.optim_step().result(TIMEOUT).step, 2)
        drawn = client.sample(PROMPTS, max_tokens=MAX_TOKENS).result(TIMEOUT)
        replay = client.sample(PROMPTS, max_tokens=MAX_TOKENS,
                               seed=drawn.seed).result(TIMEOUT)
        self.assertEqual([s.tokens for s in replay.sequences],
                         [s.tokens for s in drawn.sequences])

    def test_a_tinker_base_model_sampler_is_the_untrained_base(self):
        full = TrainingClient(self.target, "full-base")
        self.addCleanup(full.close)
        full.create_model(config=TINY_LLAMA, seed=8, dtype="fp64")
        service = tinker.ServiceClient(base_url=self.target)
        self.addCleanup(service.close)
        prompt = types.ModelInput.from_ints(PROMPTS[0])
        with service.create_sampling_client(
                base_model=tinker.DEMO_MODEL, config=TINY_LLAMA, base_seed=8,
                dtype="fp64") as sampler:
            np.testing.assert_allclose(
                sampler.compute_logprobs(prompt).result(TIMEOUT)[1:],
                self.forward_logprobs(full, PROMPTS[0]), rtol=RTOL, atol=0)
            adapter = sampler.model_id
            self.assertIn(adapter, [m.model_id for m in
                                    service.server.list_models().models])
        self.assertNotIn(adapter, [m.model_id for m in
                                   service.server.list_models().models])


if __name__ == "__main__":
    unittest.main()
