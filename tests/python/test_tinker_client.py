"""tally_client.tinker, Tinker's Python SDK on tally, against a real
tally-server.

The supervised loop is the one of Tinker's "training and sampling" guide and
the RL loop the shape of the cookbook's rl_loop.py (group rollouts,
advantages = reward - group mean, datums with target_tokens, the sampler's
logprobs and advantages), each changed only in its import and ServiceClient.
The RL task is tiny and exact: a policy over a 16-token vocabulary, computed
with one forward call per step, learns to put its mass on a target set.
Every loss's elementwise_loss and the policy metrics are checked against
Tinker's formulas; then async variants, checkpoints, sampler weights,
forward_backward_custom and the errors. Every model is a LoRA adapter, as
Tinker's are (test_lora.py checks the adapter's math against PEFT's).

Every server requires a bearer token (the ServiceClient's api_key) and
confines checkpoints to its --checkpoint-root.
"""

import asyncio
import math
import os
import unittest

import numpy as np
import torch

from tally_client import tinker
from tally_client.tinker import types
from tally_testing import TINY_LLAMA, ServerTestCase

TOKEN = "tinker-test-token"
TENANT = "tenant-a"

# The RL task: after PROMPT, a token of TARGET_SET earns reward 1.
RL_VOCAB = 16
RL_MODEL = dict(TINY_LLAMA, vocab_size=RL_VOCAB)
PROMPT = [1, 5, 9]
TARGET_SET = (3, 7, 11, 13)
GROUP_SIZE = 16

# The demo model's byte-level vocabulary starts every text with BOS; the
# tiny model of the other tests reads the same bytes.
BOS = 256
TINY_BYTES = dict(TINY_LLAMA, vocab_size=260, max_position_embeddings=128)

PIG_LATIN = [
    {"input": "banana split", "output": "anana-bay plit-say"},
    {"input": "quantum physics", "output": "uantum-qay ysics-phay"},
    {"input": "donut shop", "output": "onut-day op-shay"},
    {"input": "pickle jar", "output": "ickle-pay ar-jay"},
    {"input": "space exploration", "output": "ace-spay exploration-way"},
    {"input": "rubber duck", "output": "ubber-ray uck-day"},
    {"input": "coding wizard", "output": "oding-cay izard-way"},
]


def encode(text, add_special_tokens=False):
    """The demo model's tokenizer: UTF-8 bytes, BOS first on request."""
    return ([BOS] if add_special_tokens else []) + list(text.encode("utf-8"))


def process_example(example):
    """A pig-latin Datum, as Tinker's guide builds one: the prompt's
    positions weigh 0, the completion's 1."""
    prompt_tokens = encode(f"English: {example['input']}\nPig Latin:",
                           add_special_tokens=True)
    completion_tokens = encode(f" {example['output']}\n\n")
    tokens = prompt_tokens + completion_tokens
    weights = [0] * len(prompt_tokens) + [1] * len(completion_tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens=tokens[:-1]),
        loss_fn_inputs=dict(weights=weights[1:], target_tokens=tokens[1:]))


def candidate_datums():
    """One datum per possible next token after PROMPT: a forward call reads
    the whole policy from their last logprobs."""
    return [types.Datum(model_input=types.ModelInput.from_ints(PROMPT),
                        loss_fn_inputs={"target_tokens": PROMPT[1:] + [token]})
            for token in range(RL_VOCAB)]


class TinkerTestCase(ServerTestCase):
    """A tally-server with bearer tokens and a checkpoint root, and a
    ServiceClient of it."""

    def setUp(self):
        super().setUp()
        self.checkpoint_root = os.path.join(self.temp_dir, "checkpoints")
        tokens_file = os.path.join(self.temp_dir, "tokens")
        with open(tokens_file, "w", encoding="utf-8") as f:
            f.write(f"{TOKEN} {TENANT}\n")
        self.start_server(extra_args=["--checkpoint-root", self.checkpoint_root,
                                      "--auth-tokens-file", tokens_file])
        self.base_url = f"localhost:{self.server.grpc_port}"
        self.service = self.service_client(TOKEN)

    def service_client(self, api_key):
        service = tinker.ServiceClient(base_url=self.base_url, api_key=api_key)
        self.addCleanup(service.close)
        return service

    def server_dir(self, handle):
        """The directory under --checkpoint-root of a tally:// handle of
        this test's tenant."""
        self.assertTrue(handle.startswith("tally://"), handle)
        return os.path.join(self.checkpoint_root, TENANT,
                            handle[len("tally://"):])

    def create(self, base_model=tinker.DEMO_MODEL, **fields):
        """A TrainingClient of a new LoRA model."""
        return self.service.create_lora_training_client(
            base_model=base_model, **fields)

    def policy(self, training_client):
        """p(token | PROMPT) for every token, from one forward call."""
        result = training_client.forward(candidate_datums(),
                                         "cross_entropy").result()
        logprobs = np.array([output["logprobs"].tolist()[-1]
                             for output in result.loss_fn_outputs])
        return np.exp(logprobs)


class TypesTest(unittest.TestCase):
    """Tinker's types, without a server."""

    def test_tensor_data_from_lists_numpy_and_torch(self):
        datum = types.Datum(
            model_input=types.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0, 1, 1],
                            "advantages": np.array([0.5, -0.5, 0.25]),
                            "logprobs": torch.tensor([-1.0, -2.0, -0.1])})
        inputs = datum.loss_fn_inputs
        self.assertEqual(inputs["target_tokens"],
                         types.TensorData(data=[2, 3, 4], dtype="int64",
                                          shape=[3]))
        self.assertEqual((inputs["weights"].dtype, inputs["weights"].tolist()),
                         ("float32", [0.0, 1.0, 1.0]))
        self.assertEqual(inputs["advantages"].dtype, "float32")
        np.testing.assert_array_equal(inputs["advantages"].to_numpy(),
                                      np.float32([0.5, -0.5, 0.25]))
        self.assertTrue(torch.equal(inputs["logprobs"].to_torch(),
                                    torch.tensor([-1.0, -2.0, -0.1])))
        self.assertEqual(inputs["target_tokens"].to_torch().dtype, torch.int64)

        matrix = types.TensorData.from_numpy(np.arange(6).reshape(2, 3))
        self.assertEqual((matrix.dtype, matrix.shape), ("int64", [2, 3]))
        self.assertEqual(matrix.tolist(), [[0, 1, 2], [3, 4, 5]])
        self.assertEqual(matrix.to_torch().shape, (2, 3))
        floats = types.TensorData.from_torch(torch.ones(2, 2,
                                                        dtype=torch.float64))
        self.assertEqual((floats.dtype, floats.to_numpy().dtype),
                         ("float32", np.float32))
        # Values are stored as float32, as Tinker sends them.
        self.assertEqual(types.TensorData(data=[0.1], dtype="float32").data,
                         [float(np.float32(0.1))])
        with self.assertRaisesRegex(ValueError, "3 values for shape"):
            types.TensorData(data=[1, 2, 3], dtype="int64", shape=[2, 2])
        with self.assertRaisesRegex(ValueError, "dtype"):
            types.TensorData(data=[1], dtype="float64")

    def test_model_input(self):
        model_input = types.ModelInput.from_ints([4, 5]).append_int(6).append(
            types.EncodedTextChunk(tokens=[7, 8]))
        self.assertEqual(model_input.to_ints(), [4, 5, 6, 7, 8])
        self.assertEqual(model_input.length, 5)
        self.assertEqual(types.ModelInput.empty().length, 0)

    def test_adam_params_defaults_are_tinkers(self):
        self.assertEqual(types.AdamParams(), types.AdamParams(
            learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12,
            weight_decay=0.0, grad_clip_norm=0.0))

    def test_base_url_forms(self):
        for url in ("grpc://localhost:1", "localhost:1"):
            tinker.ServiceClient(base_url=url).close()
        with self.assertRaisesRegex(ValueError, "tally speaks gRPC"):
            tinker.ServiceClient(base_url="ws://tinker.example/")


class SupervisedLoopTest(TinkerTestCase):

    def test_the_guides_pig_latin_loop_lowers_the_loss(self):
        service_client = tinker.ServiceClient(base_url=self.base_url,
                                              api_key=TOKEN)
        self.addCleanup(service_client.close)
        training_client = service_client.create_lora_training_client(
            base_model=tinker.DEMO_MODEL, seed=5)
        processed_examples = [process_example(ex) for ex in PIG_LATIN]
        losses = []
        for _ in range(8):
            fwdbwd_future = training_client.forward_backward(
                processed_examples, "cross_entropy")
            optim_future = training_client.optim_step(
                types.AdamParams(learning_rate=3e-3))
            fwdbwd_result = fwdbwd_future.result()
            optim_result = optim_future.result()
            logprobs = np.concatenate([output["logprobs"].tolist()
                                       for output in
                                       fwdbwd_result.loss_fn_outputs])
            weights = np.concatenate([example.loss_fn_inputs["weights"].tolist()
                                      for example in processed_examples])
            losses.append(-np.dot(logprobs, weights) / weights.sum())
            # Tinker's loss:sum is the weighted sum of the token losses.
            self.assertAlmostEqual(fwdbwd_result.metrics["loss:sum"],
                                   -np.dot(logprobs, weights),
                                   delta=1e-4 * abs(losses[-1]) * weights.sum())
            self.assertGreater(optim_result.metrics["tally/grad_norm"], 0.0)
        self.assertEqual(optim_result.metrics["tally/step"], 8.0)
        self.assertLess(losses[-1], 0.8 * losses[0], losses)
        # The demo model is the embedded byte-level Llama.
        info = training_client.get_info()
        self.assertEqual(info.model_info.config.vocab_size, 260)
        self.assertEqual((info.model_data.arch, info.is_lora, info.lora_rank),
                         ("llama", True, 32))


class RlLoopTest(TinkerTestCase):

    def run_rl(self, loss_fn, updates_per_batch, steps=15):
        """The RL loop; returns the policy's mass on TARGET_SET before each
        step and after the last, and the mean reward of each step.
        `updates_per_batch`: forward_backward + optim_step rounds per
        batch (PPO's several epochs over one batch of rollouts)."""
        training_client = self.create(config=RL_MODEL, seed=3)
        adam_params = types.AdamParams(learning_rate=2e-2)
        rng = np.random.default_rng(0)
        masses, rewards = [], []
        for _ in range(steps):
            probs = self.policy(training_client)
            masses.append(probs[list(TARGET_SET)].sum())
            tokens = rng.choice(RL_VOCAB, size=GROUP_SIZE,
                                p=probs / probs.sum())
            group_rewards = [1.0 if t in TARGET_SET else 0.0 for t in tokens]
            rewards.append(np.mean(group_rewards))
            advantages = [r - np.mean(group_rewards) for r in group_rewards]
            if all(a == 0.0 for a in advantages):
                continue
            ob_len = len(PROMPT) - 1
            training_datums = [types.Datum(
                model_input=types.ModelInput.from_ints(tokens=PROMPT),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_torch(
                        torch.tensor(PROMPT[1:] + [int(token)])),
                    "logprobs": types.TensorData.from_torch(torch.tensor(
                        [0.0] * ob_len + [math.log(probs[token])])),
                    "advantages": types.TensorData.from_torch(torch.tensor(
                        [0.0] * ob_len + [advantage])),
                }) for token, advantage in zip(tokens, advantages)]
            for _ in range(updates_per_batch):
                fwd_bwd_future = training_client.forward_backward(
                    training_datums, loss_fn=loss_fn)
                optim_step_future = training_client.optim_step(adam_params)
                fwd_bwd_result = fwd_bwd_future.result()
                optim_step_future.result()
                self.assertEqual(len(fwd_bwd_result.loss_fn_outputs),
                                 GROUP_SIZE)
        masses.append(self.policy(training_client)[list(TARGET_SET)].sum())
        return masses, rewards

    def assertLearned(self, masses, rewards):
        self.assertAlmostEqual(masses[0], len(TARGET_SET) / RL_VOCAB,
                               delta=0.05)
        self.assertGreater(masses[-1], 0.9, masses)
        self.assertGreater(np.mean(rewards[-5:]), np.mean(rewards[:5]) + 0.3,
                           rewards)

    def test_importance_sampling_learns_the_target_set(self):
        self.assertLearned(*self.run_rl("importance_sampling",
                                        updates_per_batch=1))

    def test_ppo_with_two_updates_per_batch_learns_the_target_set(self):
        self.assertLearned(*self.run_rl("ppo", updates_per_batch=2))


class LossOutputsTest(TinkerTestCase):
    """Each loss's elementwise_loss and the policy metrics, against Tinker's
    formulas, for samplers whose logprobs are the trainer's minus 0.5 (ratio
    e^0.5 on every token)."""

    GAP = 0.5

    def test_elementwise_losses_and_policy_metrics(self):
        training_client = self.create(config=RL_MODEL, seed=4)
        tokens = [[1, 2, 3, 4, 5], [6, 7, 8]]
        plain = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]),
                             loss_fn_inputs={"target_tokens": t[1:]})
                 for t in tokens]
        logprobs = [output["logprobs"].to_numpy() for output in
                    training_client.forward(plain, "cross_entropy")
                    .result().loss_fn_outputs]
        self.assertEqual([lp.shape for lp in logprobs], [(4,), (2,)])
        advantages = [np.float32([1.0, -1.0, 0.5, 2.0]), np.float32([1.0, 1.0])]
        datums = [types.Datum(model_input=datum.model_input, loss_fn_inputs={
            "target_tokens": datum.loss_fn_inputs["target_tokens"],
            "logprobs": lp - self.GAP, "advantages": a})
            for datum, lp, a in zip(plain, logprobs, advantages)]
        ratio = math.exp(self.GAP)
        expected = {
            "cross_entropy": lambda lp, a: -lp,
            "importance_sampling": lambda lp, a: -ratio * a,
            "ppo": lambda lp, a: -np.minimum(ratio * a, 1.2 * a),
            "cispo": lambda lp, a: -1.2 * lp * a,
            "dro": lambda lp, a: -(lp * a - 0.1 / 2 * self.GAP ** 2),
        }
        for loss_fn, formula in expected.items():
            config = {"beta": 0.1} if loss_fn == "dro" else None
            result = training_client.forward(datums, loss_fn, config).result()
            self.assertEqual(result.loss_fn_output_type, "ArrayRecord")
            for output, lp, a in zip(result.loss_fn_outputs, logprobs,
                                     advantages):
                self.assertEqual(output["elementwise_loss"].shape, [len(lp)])
                np.testing.assert_allclose(
                    output["elementwise_loss"].to_numpy(), formula(lp, a),
                    rtol=1e-5, atol=1e-6, err_msg=loss_fn)
                np.testing.assert_allclose(output["logprobs"].to_numpy(), lp,
                                           rtol=1e-6, err_msg=loss_fn)
            total = sum(formula(lp, a).sum()
                        for lp, a in zip(logprobs, advantages))
            self.assertAlmostEqual(result.metrics["loss:sum"], total,
                                   delta=1e-4, msg=loss_fn)
            metrics = result.metrics
            self.assertEqual(metrics["tally/policy_tokens:sum"], 6.0, loss_fn)
            for name in ("tally/ratio:mean", "tally/ratio:min",
                         "tally/ratio:max"):
                self.assertAlmostEqual(metrics[name], ratio, delta=1e-5,
                                       msg=(loss_fn, name))
            self.assertAlmostEqual(metrics["tally/logprob_gap:max"], self.GAP,
                                   delta=1e-5)
            self.assertAlmostEqual(metrics["tally/kl_k1:mean"], -self.GAP,
                                   delta=1e-5)
            self.assertAlmostEqual(metrics["tally/kl_k3:mean"],
                                   ratio - 1 - self.GAP, delta=1e-5)
            self.assertEqual(metrics["tally/clipped_fraction:mean"],
                             1.0 if loss_fn in ("ppo", "cispo") else 0.0,
                             loss_fn)

    def test_ppo_clip_thresholds_come_from_loss_fn_config(self):
        training_client = self.create(config=RL_MODEL, seed=4)
        tokens = [1, 2, 3, 4]
        datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": tokens[1:]})
        lp = training_client.forward([datum], "cross_entropy").result() \
            .loss_fn_outputs[0]["logprobs"].to_numpy()
        datum = types.Datum(model_input=datum.model_input, loss_fn_inputs={
            **datum.loss_fn_inputs, "logprobs": lp - self.GAP,
            "advantages": np.ones(3, np.float32)})
        result = training_client.forward(
            [datum], "ppo", {"clip_low_threshold": 0.5,
                             "clip_high_threshold": 2.0}).result()
        # e^0.5 lies inside [0.5, 2]: nothing is clipped.
        np.testing.assert_allclose(
            result.loss_fn_outputs[0]["elementwise_loss"].to_numpy(),
            np.full(3, -math.exp(self.GAP)), rtol=1e-5)
        self.assertEqual(result.metrics["tally/clipped_fraction:mean"], 0.0)


class ClientApiTest(TinkerTestCase):

    def test_async_variants(self):
        datum = process_example(PIG_LATIN[0])

        async def main():
            training_client = await self.service \
                .create_lora_training_client_async(
                    base_model=tinker.DEMO_MODEL, config=TINY_BYTES, seed=1)
            fwd_bwd_future = await training_client.forward_backward_async(
                [datum], "cross_entropy")
            optim_future = await training_client.optim_step_async(
                types.AdamParams(learning_rate=1e-3))
            fwd_bwd_result = await fwd_bwd_future
            optim_result = await optim_future.result_async(timeout=60)
            forward = await (await training_client.forward_async(
                [datum], "cross_entropy"))
            saved = await (await training_client.save_state_async("async"))
            loaded = await (await training_client.load_state_async(saved.path))
            await (await training_client.load_state_with_optimizer_async(
                saved.path))
            exported = await (await training_client
                              .save_weights_for_sampler_async(
                                  "async", export=True))
            info = await training_client.get_info_async()
            capabilities = await self.service.get_server_capabilities_async()
            restored = await self.service \
                .create_training_client_from_state_async(saved.path)
            return (fwd_bwd_result, optim_result, forward, loaded, exported,
                    info, capabilities, await restored.get_info_async())

        (fwd_bwd_result, optim_result, forward, loaded, exported, info,
         capabilities, restored_info) = asyncio.run(main())
        self.assertEqual(len(fwd_bwd_result.loss_fn_outputs), 1)
        self.assertEqual(optim_result.metrics["tally/step"], 1.0)
        # The forward ran after the step: another loss on the same datum.
        self.assertNotEqual(forward.metrics["loss:sum"],
                            fwd_bwd_result.metrics["loss:sum"])
        self.assertTrue(loaded.path.endswith("/weights/async"), loaded.path)
        self.assertTrue(os.path.isdir(self.server_dir(exported.path)),
                        exported.path)
        self.assertEqual(info.model_info.step, 1)
        self.assertEqual(capabilities.supported_models[0].model_name,
                         tinker.DEMO_MODEL)
        self.assertEqual(restored_info.model_info.step, 1)

    def test_save_state_and_load_state_round_trip(self):
        training_client = self.create(config=TINY_BYTES, seed=2)
        data = [process_example(ex) for ex in PIG_LATIN[:3]]
        adam = types.AdamParams(learning_rate=1e-2)

        def train_step():
            training_client.forward_backward(data, "cross_entropy")
            return training_client.optim_step(adam).result()

        def loss():
            return training_client.forward(data, "cross_entropy").result() \
                .metrics["loss:sum"]

        train_step()
        saved = training_client.save_state("0001").result()
        self.assertEqual(
            saved.path, f"tally://{training_client.model_id}/weights/0001")
        self.assertTrue(os.path.isdir(self.server_dir(saved.path)))
        loss_at_save = loss()
        second_step = train_step()
        train_step()
        self.assertNotEqual(loss(), loss_at_save)
        training_client.load_state_with_optimizer(saved.path).result()
        self.assertEqual(loss(), loss_at_save)
        self.assertEqual(training_client.get_info().model_info.step, 1)
        # With the optimizer restored, the second step repeats exactly.
        self.assertEqual(train_step().metrics["tally/grad_norm"],
                         second_step.metrics["tally/grad_norm"])

        training_client.load_state(saved.path).result()
        self.assertEqual(loss(), loss_at_save)
        restored = self.service.create_training_client_from_state(saved.path)
        self.assertNotEqual(restored.model_id, training_client.model_id)
        self.assertEqual(restored.forward(data, "cross_entropy").result()
                         .metrics["loss:sum"], loss_at_save)
        resumed = self.service.create_training_client_from_state_with_optimizer(
            saved.path)
        resumed.forward_backward(data, "cross_entropy")
        self.assertEqual(resumed.optim_step(adam).result()
                         .metrics["tally/grad_norm"],
                         second_step.metrics["tally/grad_norm"])

    def test_save_state_mid_window_keeps_the_window_pending(self):
        data = [process_example(ex) for ex in PIG_LATIN[:3]]
        adam = types.AdamParams(learning_rate=1e-2)

        def loss(client):
            return client.forward(data, "cross_entropy").result() \
                .metrics["loss:sum"]

        control = self.create(config=TINY_BYTES, seed=3)
        control.forward_backward(data, "cross_entropy")
        want = control.optim_step(adam).result()

        saving = self.create(config=TINY_BYTES, seed=3)
        loss_before = loss(saving)
        saving.forward_backward(data, "cross_entropy")
        saved = saving.save_state("mid-window").result()
        got = saving.optim_step(adam).result()
        # The step took the window sent before the save, as if no save
        # had happened ...
        self.assertEqual(got.metrics["tally/grad_norm"],
                         want.metrics["tally/grad_norm"])
        self.assertEqual(loss(saving), loss(control))
        # ... and the state saved is the one before the step.
        restored = self.service.create_training_client_from_state(saved.path)
        self.assertEqual(loss(restored), loss_before)

    def test_refused_load_state_and_optim_step_leave_training_going(self):
        data = [process_example(ex) for ex in PIG_LATIN[:3]]
        adam = types.AdamParams(learning_rate=1e-2)
        control = self.create(config=TINY_BYTES, seed=4)
        control.forward_backward(data, "cross_entropy")
        want = control.optim_step(adam).result()

        training_client = self.create(config=TINY_BYTES, seed=4)
        # A state that does not exist (the engine's refusal), one outside
        # --checkpoint-root (refused before it is sequenced).
        for path in ("no-such-state", "/no-such-root/state"):
            with self.assertRaisesRegex(tinker.TallyError, path):
                training_client.load_state(path).result()
        training_client.forward_backward(data, "cross_entropy")
        for refused in (types.AdamParams(learning_rate=-1.0),
                        types.AdamParams(grad_clip_norm=-1.0)):
            with self.assertRaises(tinker.TallyError) as raised:
                training_client.optim_step(refused).result()
            self.assertEqual(raised.exception.code.name, "INVALID_ARGUMENT")
        got = training_client.optim_step(adam).result()
        self.assertEqual(got.metrics["tally/grad_norm"],
                         want.metrics["tally/grad_norm"])
        self.assertEqual(training_client.get_info().model_info.step, 1)

    def test_save_weights_for_sampler_writes_the_adapter(self):
        training_client = self.create(config=TINY_BYTES, seed=2)
        handle = training_client.save_weights_for_sampler(
            "0000", export=True).result().path
        self.assertEqual(
            handle, f"tally://{training_client.model_id}/sampler_weights/0000")
        path = self.server_dir(handle)
        # A PEFT adapter directory, as Tinker's sampler serves the adapter.
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            self.assertTrue(os.path.isfile(os.path.join(path, name)), name)
        # merge=True: the base with the adapter merged in, an HF directory.
        path = self.server_dir(training_client.save_weights_for_sampler(
            "0000-merged", merge=True).result().path)
        self.assertTrue(os.path.isfile(os.path.join(path, "config.json")))
        self.assertTrue(os.path.isfile(os.path.join(path,
                                                    "model.safetensors")))

    def test_forward_backward_custom_matches_the_builtin_loss(self):
        data = [process_example(ex) for ex in PIG_LATIN[:3]]
        builtin = self.create(config=TINY_BYTES, seed=6)
        builtin.forward_backward(data, "cross_entropy")
        want = builtin.optim_step(types.AdamParams()).result()

        def weighted_nll(data, logprobs):
            loss = -sum((lp * d.loss_fn_inputs["weights"].to_torch()).sum()
                        for d, lp in zip(data, logprobs))
            return loss, {"nll:sum": loss.item()}

        custom = self.create(config=TINY_BYTES, seed=6)
        result = custom.forward_backward_custom(data, weighted_nll).result()
        got = custom.optim_step(types.AdamParams()).result()
        self.assertGreater(result.metrics["nll:sum"], 0.0)
        self.assertAlmostEqual(got.metrics["tally/grad_norm"],
                               want.metrics["tally/grad_norm"],
                               delta=1e-5 * want.metrics["tally/grad_norm"])

        async def custom_async():
            future = await custom.forward_backward_custom_async(data,
                                                                weighted_nll)
            return await future

        self.assertIn("nll:sum", asyncio.run(custom_async()).metrics)

        # A loss that leaves a datum out is refused, as Tinker's.
        def first_only(data, logprobs):
            return -logprobs[0].sum(), {}

        with self.assertRaisesRegex(ValueError, "no gradient"):
            custom.forward_backward_custom(data, first_only)

    def test_errors_name_the_problem(self):
        training_client = self.create(config=RL_MODEL, seed=1)
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                            loss_fn_inputs={"target_tokens": [2, 3],
                                            "advantages": [1.0, 1.0],
                                            "logprobs": [-1.0, -1.0]})
        with self.assertRaisesRegex(ValueError, "grpo.*importance_sampling"):
            training_client.forward_backward([datum], "grpo")
        with self.assertRaises(tinker.TallyError) as raised:
            training_client.forward_backward(
                [datum], "ppo", {"clip_low": 0.9}).result()
        self.assertEqual(raised.exception.code.name, "INVALID_ARGUMENT")
        self.assertIn("clip_low", raised.exception.details)
        with self.assertRaisesRegex(ValueError, "no tokenizer"):
            training_client.get_tokenizer()
        with self.assertRaises(tinker.TallyError) as raised:
            self.service_client("wrong-token").create_lora_training_client(
                tinker.DEMO_MODEL)
        self.assertEqual(raised.exception.code.name, "UNAUTHENTICATED")


if __name__ == "__main__":
    unittest.main()
