"""Retries of calls the server already executed are applied once.

A fault-injecting proxy between the Python client and a 2-rank tally-server
lets the server execute a ForwardBackward and an OptimStep, then answers
UNAVAILABLE instead of their responses; the client retries both with the same
seq_id. With the server's exactly-once sequencing the retries get the cached
responses: the window counts the ForwardBackward once, the model steps once,
and training matches a model trained without faults.

This needs seq_id deduplication on the server (the exactly-once issue). A
server without it accumulates the retried ForwardBackward twice and fails the
retried OptimStep or applies it twice: this test then FAILS, on purpose.
"""

import unittest

from client_testing import FB, STEP, ClientServerTestCase, window
from tally_client import sample


class ExactlyOnceRetryTest(ClientServerTestCase):

    def test_dropped_responses_are_applied_once(self):
        expected = self.reference_steps("reference-responses", 2)
        proxy = self.proxy()
        # The server executes these calls, the client sees UNAVAILABLE and
        # retries them with the same seq_id.
        proxy.plan(FB, [None, "drop_response"])
        proxy.plan(STEP, ["drop_response"])
        client = self.new_model("dropped-responses", target=proxy.target)
        tokens_sent = sum(len(x) for batch in window(0) for x, _ in batch)
        calls = [client.forward_backward([sample(x, y) for x, y in batch])
                 for batch in window(0)]
        responses = [c.result() for c in calls]
        self.assertEqual(responses[-1].accumulated_tokens, tokens_sent,
                         "the retried ForwardBackward was accumulated twice")
        step = client.optim_step().result()
        self.assertEqual(step.step, 1, "the retried OptimStep was applied twice")
        self.assertEqual(step.normalizer, tokens_sent)
        self.assertSameTraining([(step.grad_norm, [r.loss_mean for r in responses])],
                                expected[:1])
        # The server did receive each dropped call twice.
        self.assertEqual(proxy.forwarded[FB], 3 + 1)
        self.assertEqual(proxy.forwarded[STEP], 2)
        self.assertSameTraining(self.train_through(client, 2, first=1), expected[1:])
        self.assertEqual(client.get_model().step, 2)


if __name__ == "__main__":
    unittest.main()
