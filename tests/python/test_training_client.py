"""The Python client package (client/python, tally_client) against a real
2-rank tally-server, directly and through a fault-injecting proxy.

Every comparison is against a second model with the same seed trained on the
same server without faults or without pipelining: the step counts must be
identical, the grad norms and losses equal to float32 rounding (pipelined or
retried calls may accumulate a window's gradients in another order).

Dropped responses (executed, then retried) are in
test_client_exactly_once.py, which needs the server's seq_id deduplication.
"""

import os
import unittest

import numpy as np
import torch

from client_testing import FB, STEP, VOCAB, ClientServerTestCase, window
from tally_client import (PendingWindowError, TallyError, WindowAbortedError,
                          sample, samples_from_batch)


class TrainingClientTest(ClientServerTestCase):

    def test_pipelined_calls_with_numpy_and_torch_match_blocking_calls(self):
        expected = self.reference_steps("blocking", 2)
        client = self.new_model("pipelined")
        futures = []
        for s in range(2):
            calls = []
            for c, batch in enumerate(window(s)):
                # numpy for even calls, torch for odd ones.
                convert = np.array if c % 2 == 0 else torch.tensor
                calls.append(client.forward_backward(
                    [(convert(x), convert(y)) for x, y in batch]))
            futures.append((client.optim_step(), calls))
        # Nothing was waited for until here.
        self.assertSameTraining(
            [(step.result().grad_norm, [c.result().loss_mean for c in calls])
             for step, calls in futures], expected)
        self.assertEqual(client.get_model().step, 2)

    def test_server_info_describes_the_2_rank_server(self):
        info = self.new_model("info").server_info()
        self.assertEqual(info.mesh.world_size, 2)
        self.assertIn("qwen3", info.model_types)
        self.assertIn("cross_entropy", info.losses)
        self.assertIn("seq_id", info.features)
        self.assertNotEqual(info.compute.blas, "reference", info.compute)

    def test_samples_from_a_padded_batch(self):
        rows = samples_from_batch(np.array([[1, 2, 3], [4, 5, 0]]),
                                  torch.tensor([[2, 3, 4], [5, -100, -100]]))
        self.assertEqual([list(r.input_tokens) for r in rows], [[1, 2, 3], [4]])
        self.assertEqual([list(r.target_tokens) for r in rows], [[2, 3, 4], [5]])
        with self.assertRaisesRegex(ValueError, "target_tokens has 1"):
            sample([1, 2], [3])

    def test_rl_losses_read_advantages_and_sampling_logprobs(self):
        client = self.new_model("rl-loss")
        inputs, targets = [1, 2, 3, 4], [2, 3, 4, 5]
        logprobs = client.forward_backward(
            [sample(inputs, targets)], forward_only=True,
            return_logprobs=True).result().samples[0].logprobs
        advantages = [1.0, -1.0, 0.5, 2.0]
        # On policy (the sampler's logprobs are the trainer's): ratio 1.
        rl = client.forward_backward(
            [{"input_tokens": inputs, "target_tokens": targets,
              "advantages": advantages, "sampling_logprobs": list(logprobs)}],
            reduction="sum", forward_only=True, return_logprobs=True,
            loss_fn="importance_sampling").result()
        np.testing.assert_allclose(rl.samples[0].token_losses,
                                   -np.array(advantages), rtol=1e-5)
        self.assertAlmostEqual(rl.policy.ratio_mean, 1.0, delta=1e-5)
        self.assertEqual(rl.policy.tokens, 4)
        with self.assertRaisesRegex(ValueError, "unknown loss_fn 'grpo'"):
            client.forward_backward([sample(inputs, targets)], loss_fn="grpo")
        with self.assertRaisesRegex(ValueError, "advantages has 1 values"):
            sample(inputs, targets, advantages=[1.0])

    def test_dropped_requests_are_retried_with_the_same_seq_id(self):
        expected = self.reference_steps("reference-requests", 2)
        proxy = self.proxy()
        proxy.plan(FB, ["drop_request", None, "drop_request", "drop_request"])
        proxy.plan(STEP, ["drop_request"])
        client = self.new_model("dropped-requests", target=proxy.target,
                                token="secret-token")
        self.assertSameTraining(self.train_through(client, 2), expected)
        self.assertEqual(proxy.received[FB], 6 + 3)
        self.assertEqual(proxy.forwarded[FB], 6)
        self.assertEqual(proxy.forwarded[STEP], 2)
        self.assertEqual(proxy.last_metadata[FB]["authorization"],
                         "Bearer secret-token")
        self.assertEqual(client.get_model().step, 2)

    def test_aborted_raises_and_names_the_remedy(self):
        proxy = self.proxy()
        proxy.plan(STEP, ["aborted"])
        client = self.new_model("aborted", target=proxy.target)
        for batch in window(0):
            client.forward_backward([sample(x, y) for x, y in batch])
        with self.assertRaisesRegex(WindowAbortedError, r"call abort_window\(\)"):
            client.optim_step().result()
        self.assertEqual(proxy.received[STEP], 1, "ABORTED must not be retried")
        discarded = client.abort_window().result()
        self.assertEqual(discarded.discarded_calls, 3)
        # The window redone from scratch gives the reference step.
        expected = self.reference_steps("reference-aborted", 1)
        self.assertSameTraining(self.train_through(client, 1), expected)

    def test_a_failed_call_aborts_its_window_instead_of_stepping(self):
        client = self.new_model("failed-call")
        good = client.forward_backward([sample([1, 2, 3], [2, 3, 4])])
        bad = client.forward_backward([sample([1, VOCAB + 5], [2, 3])])
        step = client.optim_step()
        self.assertEqual(good.result().valid_tokens, 3)
        with self.assertRaises(TallyError):
            bad.result()
        with self.assertRaisesRegex(WindowAbortedError, "window was aborted"):
            step.result()
        info = client.get_model()
        self.assertEqual((info.step, info.accumulated_calls), (0, 0))

    def test_a_refused_save_keeps_the_failed_call_of_its_window(self):
        expected = self.reference_steps("reference-failed-call-save", 1)
        client = self.new_model("failed-call-save")
        client.forward_backward([sample([1, 2, 3], [2, 3, 4])])
        bad = client.forward_backward([sample([1, VOCAB + 5], [2, 3])])
        with self.assertRaises(TallyError):
            client.save(os.path.join(self.temp, "failed-call-save")).result()
        self.assertEqual(bad.exception().code.name, "INVALID_ARGUMENT")
        # The window still misses its failed call: it is aborted, not
        # stepped, and the next one steps.
        with self.assertRaisesRegex(WindowAbortedError, "window was aborted"):
            client.optim_step().result()
        self.assertEqual(client.get_model().step, 0)
        self.assertSameTraining(self.train_through(client, 1), expected)

    def test_save_and_load(self):
        client = self.new_model("saved")
        path = os.path.join(self.temp, "saved-ckpt")
        self.train_through(client, 1)
        saved = client.save(path).result()
        self.assertEqual(saved.step, 1)
        after_save = self.train_through(client, 2)
        loaded = client.load(path).result()
        self.assertEqual(loaded.model.step, 1)
        # From the checkpoint, the same data gives the same second step.
        self.assertSameTraining(self.train_through(client, 2), after_save)

    def test_a_refused_save_with_a_pending_window_poisons_nothing(self):
        expected = self.reference_steps("reference-refused-save", 2)
        client = self.new_model("refused-save")
        calls = [client.forward_backward([sample(x, y) for x, y in batch])
                 for batch in window(0)]
        with self.assertRaises(TallyError) as raised:
            client.save(os.path.join(self.temp, "refused-save")).result()
        self.assertEqual(raised.exception.code.name, "FAILED_PRECONDITION")
        self.assertIn("pending accumulation window", raised.exception.details)
        # The window is intact: its step, and the next window's, are the
        # reference's.
        step = client.optim_step().result()
        got = [(step.grad_norm, [c.result().loss_mean for c in calls])]
        self.assertSameTraining(got + self.train_through(client, 2, first=1),
                                expected)

    def test_save_with_allow_pending_keeps_the_window_pending(self):
        expected = self.reference_steps("reference-pending-save", 2)
        client = self.new_model("pending-save")
        path = os.path.join(self.temp, "pending-save")
        calls = [client.forward_backward([sample(x, y) for x, y in batch])
                 for batch in window(0)]
        saved = client.save(path, allow_pending=True).result()
        self.assertEqual((saved.step, saved.unsaved_calls), (0, 3))
        self.assertEqual(client.get_model().accumulated_calls, 3)
        step = client.optim_step().result()
        got = [(step.grad_norm, [c.result().loss_mean for c in calls])]
        self.assertSameTraining(got + self.train_through(client, 2, first=1),
                                expected)
        # The checkpoint holds the state before the window's step.
        self.assertEqual(client.load(path).result().model.step, 0)
        self.assertSameTraining(self.train_through(client, 1), expected[:1])

    def test_a_failed_load_leaves_the_client_able_to_step(self):
        expected = self.reference_steps("reference-failed-load", 1)
        client = self.new_model("failed-load")
        with self.assertRaisesRegex(TallyError, "no-such-checkpoint"):
            client.load(os.path.join(self.temp, "no-such-checkpoint")).result()
        self.assertSameTraining(self.train_through(client, 1), expected)

    def test_a_refused_optim_step_leaves_its_window_to_the_next(self):
        expected = self.reference_steps("reference-refused-step", 1)
        # Refused by the engine (the seq_id is used) and by the server's
        # request validation (the seq_id is left unused: the client fills
        # it, or the next step would wait for it until the gap timeout).
        for name, refused, field in (
                ("engine", {"adam": {"learning_rate": -1.0}}, "learning_rate"),
                ("request", {"max_grad_norm": -1.0}, "max_grad_norm")):
            with self.subTest(name):
                client = self.new_model(f"refused-step-{name}")
                calls = [client.forward_backward([sample(x, y) for x, y in b])
                         for b in window(0)]
                bad = client.optim_step(**refused)
                step = client.optim_step()
                with self.assertRaises(TallyError) as raised:
                    bad.result()
                self.assertEqual(raised.exception.code.name,
                                 "INVALID_ARGUMENT")
                self.assertIn(field, raised.exception.details)
                got = [(step.result().grad_norm,
                        [c.result().loss_mean for c in calls])]
                self.assertSameTraining(got, expected)
                self.assertEqual(client.get_model().step, 1)

    def test_a_message_too_large_is_final_and_names_its_reason(self):
        # The server refuses a call whose response could exceed its
        # --max-message-bytes before running it; the reason says a retry
        # cannot help, so the client sends it once.
        proxy = self.proxy()
        client = self.new_model("too-large", target=proxy.target)
        many = [sample([1, 2], [2, 3]) for _ in range(40000)]
        with self.assertRaises(TallyError) as raised:
            client.forward_backward(many).result()
        self.assertEqual(raised.exception.code.name, "RESOURCE_EXHAUSTED")
        self.assertEqual(raised.exception.reason, "MESSAGE_TOO_LARGE")
        self.assertEqual(proxy.received[FB], 1, "a too-large call was retried")
        self.assertEqual(client.get_model().accumulated_calls, 0)

    def test_a_pending_window_it_did_not_send_needs_an_explicit_choice(self):
        first = self.new_model("shared")
        for batch in window(0)[:2]:
            first.forward_backward([sample(x, y) for x, y in batch]).result()
        second = self.client("shared")
        self.assertEqual(second.pending_window()[0], 2)
        with self.assertRaisesRegex(PendingWindowError, "pending_window="):
            second.forward_backward([sample([1, 2], [2, 3])])
        self.assertEqual(second.get_model().accumulated_calls, 2,
                         "a refused attach changed the window")
        adding = self.client("shared", pending_window="continue")
        adding.forward_backward([sample([1, 2], [2, 3])]).result()
        self.assertEqual(adding.get_model().accumulated_calls, 3)
        fresh = self.client("shared", pending_window="abort")
        fresh.forward_backward([sample([1, 2], [2, 3])]).result()
        self.assertEqual(fresh.get_model().accumulated_calls, 1)
        # A client of a model without a pending window attaches as before.
        idle = self.new_model("idle")
        self.assertEqual(idle.pending_window(), (0, 0, 0))
        idle.forward_backward([sample([1, 2], [2, 3])]).result()


if __name__ == "__main__":
    unittest.main()
