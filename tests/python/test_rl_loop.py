"""A complete RL loop through tally's Tinker client against a real
tally-server, the shape of the cookbook's rl_loop: sample a group of
rollouts from the policy (SamplingClient of the weights being trained),
score them with a toy reward, build datums with the sampler's logprobs and
group-centred advantages, train with importance_sampling (or ppo, two
updates per batch), step, and sample again from the new weights. The reward
rises; and because the sampler reads the very weights the trainer holds, the
sampler-trainer logprob gap of the first batch is zero (to float32
rounding).

The task: after PROMPT, every completion token equal to TARGET earns 1 /
MAX_TOKENS. Seeded sampling and a single-rank server make every run the
same."""

import unittest

import numpy as np

from tally_client import tinker
from tally_client.tinker import types
from tally_testing import TINY_LLAMA, ServerTestCase

VOCAB = 16
MODEL = dict(TINY_LLAMA, vocab_size=VOCAB)
PROMPT = [1, 5, 9]
TARGET = 7
MAX_TOKENS = 4
GROUP_SIZE = 16
STEPS = 6
TIMEOUT = 120


def reward(tokens):
    """The toy reward: the fraction of completion tokens equal to TARGET."""
    return sum(token == TARGET for token in tokens) / MAX_TOKENS


def datum(sequence, advantage):
    """The cookbook's RL datum of one rollout: the prompt's positions
    masked, the completion's with the sampler's logprobs and the
    advantage."""
    tokens = PROMPT + sequence.tokens
    prompt_positions = len(PROMPT) - 1
    completion = len(sequence.tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [0.0] * prompt_positions + sequence.logprobs,
            "advantages": [0.0] * prompt_positions + [advantage] * completion,
            "mask": [0.0] * prompt_positions + [1.0] * completion,
        })


class RlLoopTest(ServerTestCase):

    def run_loop(self, loss_fn, updates_per_batch=1):
        """Mean reward of each step's rollouts (and of a last sample after
        the last step), and the first step's ForwardBackwardOutput.
        `updates_per_batch`: forward_backward + optim_step rounds per batch
        of rollouts (PPO's epochs: the later ones train on logprobs of
        weights that have moved since)."""
        self.start_server()
        service = tinker.ServiceClient(
            base_url=f"localhost:{self.server.grpc_port}")
        self.addCleanup(service.close)
        training = service.create_lora_training_client(
            tinker.DEMO_MODEL, rank=8, config=MODEL, seed=3)
        sampler = training.save_weights_and_get_sampling_client()
        prompt = types.ModelInput.from_ints(PROMPT)
        adam = types.AdamParams(learning_rate=5e-2)
        rewards, first = [], None
        for step in range(STEPS + 1):
            rollouts = sampler.sample(
                prompt, GROUP_SIZE, types.SamplingParams(
                    max_tokens=MAX_TOKENS, seed=step, stop=[])
            ).result(TIMEOUT).sequences
            scores = [reward(sequence.tokens) for sequence in rollouts]
            rewards.append(float(np.mean(scores)))
            if step == STEPS:
                break
            datums = [datum(sequence, score - np.mean(scores))
                      for sequence, score in zip(rollouts, scores)]
            for _ in range(updates_per_batch):
                fwd_bwd = training.forward_backward(datums, loss_fn)
                training.optim_step(adam)
                if first is None:
                    first = fwd_bwd.result(TIMEOUT)
        return rewards, first

    def assertRewardRises(self, rewards, first):
        self.assertEqual(first.metrics["tally/policy_tokens:sum"],
                         GROUP_SIZE * MAX_TOKENS)
        # The sampler's logprobs are the trainer's own.
        self.assertLess(first.metrics["tally/logprob_gap:max"], 1e-5)
        self.assertAlmostEqual(first.metrics["tally/ratio:mean"], 1.0, delta=1e-5)
        self.assertLess(rewards[0], 0.25, rewards)
        self.assertGreater(np.mean(rewards[-3:]), rewards[0] + 0.3, rewards)

    def test_importance_sampling_raises_the_reward(self):
        self.assertRewardRises(*self.run_loop("importance_sampling"))

    def test_ppo_with_two_updates_per_batch_raises_the_reward(self):
        self.assertRewardRises(*self.run_loop("ppo", updates_per_batch=2))


if __name__ == "__main__":
    unittest.main()
