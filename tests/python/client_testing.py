"""Shared fixture of the Python client tests (test_training_client.py,
test_client_exactly_once.py): a 2-rank tally-server per test class, models
trained directly or through a fault-injecting proxy, and the comparison of
two training runs.

    class MyTest(ClientServerTestCase):
        def test_x(self):
            expected = self.reference_steps("ref", 2)
            client = self.new_model("m", target=self.proxy().target)
            self.assertSameTraining(self.train_through(client, 2), expected)
"""


from fault_proxy import FaultProxy
from tally_client import RetryPolicy, TrainingClient, sample
from tally_testing import TINY_LLAMA, SharedServerTestCase

VOCAB = TINY_LLAMA["vocab_size"]
RTOL = 1e-6
FAST_RETRY = RetryPolicy(max_attempts=5, initial_backoff=0.01, max_backoff=0.05)
FB = "/tally.v1.Trainer/ForwardBackward"
STEP = "/tally.v1.Trainer/OptimStep"


def window(step, calls=3):
    """`calls` batches of token lists for training step `step`: uneven
    lengths, deterministic."""
    batches = []
    for c in range(calls):
        batch = []
        for i in range(1 + c):
            length = 4 + 5 * i + 2 * c + step
            text = [(3 * step + 7 * c + 11 * i + 5 * t * t) % VOCAB
                    for t in range(length + 1)]
            batch.append((text[:-1], text[1:]))
        batches.append(batch)
    return batches


class ClientServerTestCase(SharedServerTestCase):
    """A 2-rank tally-server (--dp-shard 2, 1 MiB messages) shared by a
    class's tests, and helpers to train models on it directly or through a
    FaultProxy."""

    SERVER_ARGS = ("--nproc-per-node", "2", "--dp-shard", "2",
                   # Small enough for a test to exceed with one call.
                   "--max-message-bytes", str(1 << 20))
    TEMP_PREFIX = "tally_client_"

    def assertSameTraining(self, got, want):
        """[(grad norm, [losses])] per step, to RTOL."""
        self.assertEqual(len(got), len(want))
        for (got_norm, got_losses), (want_norm, want_losses) in zip(got, want):
            self.assertAlmostEqual(got_norm, want_norm, delta=RTOL * want_norm)
            self.assertEqual(len(got_losses), len(want_losses))
            for got_loss, want_loss in zip(got_losses, want_losses):
                self.assertAlmostEqual(got_loss, want_loss, delta=RTOL * want_loss)

    def client(self, model_id, target=None, **kwargs):
        client = TrainingClient(target or self.target, model_id,
                                retry=FAST_RETRY, **kwargs)
        self.addCleanup(client.close)
        return client

    def new_model(self, model_id, target=None, **kwargs):
        client = self.client(model_id, target, **kwargs)
        info = client.create_model(config=TINY_LLAMA, seed=11,
                                   default_max_grad_norm=0.5)
        self.assertEqual(info.model_id, model_id)
        return client

    def reference_steps(self, model_id, steps):
        """(grad norm, [loss_mean per call]) per step, one blocking call at a
        time on a direct connection."""
        client = self.new_model(model_id)
        results = []
        for s in range(steps):
            losses = [client.forward_backward([sample(x, y) for x, y in batch])
                      .result().loss_mean for batch in window(s)]
            results.append((client.optim_step().result().grad_norm, losses))
        return results

    def proxy(self):
        proxy = FaultProxy(self.target)
        self.addCleanup(proxy.stop)
        return proxy

    def train_through(self, client, steps, first=0):
        """Trains windows first .. steps-1 like reference_steps does."""
        results = []
        for s in range(first, steps):
            calls = [client.forward_backward([sample(x, y) for x, y in batch])
                     for batch in window(s)]
            step = client.optim_step().result()
            results.append((step.grad_norm, [c.result().loss_mean for c in calls]))
        return results
