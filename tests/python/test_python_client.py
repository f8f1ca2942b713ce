"""A Python client trains tally's demo model over gRPC, as a user would.

Three OptimSteps, each after three ForwardBackward calls of uneven
byte-level samples of the project's text; the window counters, the step, the
error codes of bad requests, and the Prometheus gauges are checked against
what the client itself sent and received.
"""

import glob
import math
import os
import re
import unittest
import urllib.request

import grpc

from tally_testing import ServerTestCase, pb, required_env

DEMO = "demo"
DEMO_VOCAB = 260
BOS = 256

# Bytes per sample, per call, per step: uneven on purpose (1 to 97 bytes).
STEP_PLAN = [
    [[40, 7], [1, 97, 23], [64]],
    [[12], [33, 5, 5, 18], [2, 71]],
    [[88, 3], [9], [50, 26, 1]],
]

_SAMPLE_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def text_bytes():
    """The bytes of the text file under <source>/data."""
    data_dir = os.path.join(required_env("TALLY_SOURCE_DIR"), "data")
    texts = glob.glob(os.path.join(data_dir, "*.txt"))
    if len(texts) != 1:
        raise RuntimeError(f"expected one .txt file in {data_dir}, got {texts}")
    with open(texts[0], "rb") as f:
        return f.read()


def byte_sample(chunk):
    """Next-byte prediction: input [BOS] + bytes[:-1], target bytes."""
    return pb.Sample(input_tokens=[BOS] + list(chunk[:-1]),
                     target_tokens=list(chunk))


def scrape(metrics_port):
    """{(name, frozenset(labels.items())): value} from /metrics."""
    url = f"http://localhost:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode("utf-8")
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE_LINE.match(line)
        if match is None:
            raise AssertionError(f"unparsable metrics line: {line!r}")
        name, labels, value = match.groups()
        label_set = frozenset(_LABEL.findall(labels or ""))
        samples[(name, label_set)] = float(value)
    return samples


class PythonClientTest(ServerTestCase):

    def assert_rpc_error(self, code, call, request, *mentions):
        with self.assertRaises(grpc.RpcError) as caught:
            call(request)
        error = caught.exception
        self.assertEqual(error.code(), code, error.details())
        for mention in mentions:
            self.assertIn(mention, error.details())

    def window(self):
        info = self.stub.GetModel(pb.GetModelRequest(model_id=DEMO))
        return (info.step, info.accumulated_calls, info.accumulated_tokens,
                info.accumulated_samples, info.pending_reduction)

    def eval_loss(self, samples):
        response = self.stub.ForwardBackward(pb.ForwardBackwardRequest(
            model_id=DEMO, samples=samples, forward_only=True))
        self.assertEqual(response.accumulated_calls, 0, "forward_only accumulated")
        return response.loss_mean

    def test_training_loop(self):
        self.start_server(demo_model=True)
        models = self.stub.ListModels(pb.ListModelsRequest()).models
        self.assertIn(DEMO, [m.model_id for m in models])
        demo = next(m for m in models if m.model_id == DEMO)
        self.assertEqual(demo.config.vocab_size, DEMO_VOCAB)
        self.assertEqual(self.window(), (0, 0, 0, 0, pb.LOSS_REDUCTION_UNSPECIFIED))

        text = text_bytes()
        offset = 0
        plan = []  # [[[Sample]]]: steps, calls, samples
        for step_calls in STEP_PLAN:
            plan.append([])
            for lengths in step_calls:
                call = []
                for n in lengths:
                    call.append(byte_sample(text[offset:offset + n]))
                    offset += n
                plan[-1].append(call)
        first_batch = [s for call in plan[0] for s in call]
        loss_before = self.eval_loss(first_batch)

        last_step = None
        for step_index, calls in enumerate(plan):
            tokens = samples = 0
            for call_index, call in enumerate(calls):
                response = self.stub.ForwardBackward(pb.ForwardBackwardRequest(
                    model_id=DEMO, samples=call))
                call_tokens = sum(len(s.target_tokens) for s in call)
                tokens += call_tokens
                samples += len(call)
                what = f"step {step_index} call {call_index}"
                self.assertEqual(response.valid_tokens, call_tokens, what)
                self.assertEqual(response.num_samples, len(call), what)
                self.assertEqual([r.valid_tokens for r in response.samples],
                                 [len(s.target_tokens) for s in call], what)
                self.assertTrue(math.isfinite(response.loss_sum), what)
                self.assertGreater(response.loss_sum, 0.0, what)
                self.assertAlmostEqual(response.loss_mean,
                                       response.loss_sum / call_tokens, 12, what)
                self.assertEqual(response.accumulated_calls, call_index + 1, what)
                self.assertEqual(response.accumulated_tokens, tokens, what)
                self.assertEqual(response.accumulated_samples, samples, what)

                if step_index == 1 and call_index == 0:
                    self.check_rejected_requests_keep_window(
                        (step_index, 1, tokens, samples,
                         pb.LOSS_REDUCTION_TOKEN_MEAN))

            last_step = self.stub.OptimStep(pb.OptimStepRequest(model_id=DEMO))
            self.assertEqual(last_step.step, step_index + 1)
            self.assertFalse(last_step.skipped, last_step.skip_reason)
            self.assertEqual(last_step.normalizer, tokens)
            self.assertTrue(math.isfinite(last_step.grad_norm))
            self.assertGreater(last_step.grad_norm, 0.0)
            self.assertEqual(self.window(),
                             (step_index + 1, 0, 0, 0,
                              pb.LOSS_REDUCTION_UNSPECIFIED))

        # Three steps on this text lower the loss on the first batch.
        self.assertLess(self.eval_loss(first_batch), loss_before)

        metrics = scrape(self.server.metrics_port)
        grad_norm = metrics[("tally_grad_norm",
                             frozenset({("model_id", DEMO), ("rank", "0")}))]
        self.assertLessEqual(abs(grad_norm - last_step.grad_norm),
                             1e-9 * last_step.grad_norm,
                             f"metrics {grad_norm!r}, OptimStep "
                             f"{last_step.grad_norm!r}")
        applied = metrics[("tally_optim_steps_total",
                           frozenset({("model_id", DEMO), ("rank", "0"),
                                      ("outcome", "applied")}))]
        self.assertEqual(applied, 3.0)

    def check_rejected_requests_keep_window(self, expected_window):
        self.assertEqual(self.window(), expected_window)
        bad_input = pb.Sample(input_tokens=[BOS, 999, 65],
                              target_tokens=[72, 105, 33])
        self.assert_rpc_error(
            grpc.StatusCode.INVALID_ARGUMENT, self.stub.ForwardBackward,
            pb.ForwardBackwardRequest(model_id=DEMO, samples=[bad_input]),
            "samples[0].input_tokens[1]", "999")
        self.assert_rpc_error(
            grpc.StatusCode.NOT_FOUND, self.stub.ForwardBackward,
            pb.ForwardBackwardRequest(model_id="no-such-model",
                                      samples=[byte_sample(b"abc")]),
            "no-such-model")
        self.assert_rpc_error(
            grpc.StatusCode.NOT_FOUND, self.stub.OptimStep,
            pb.OptimStepRequest(model_id="no-such-model"), "no-such-model")
        self.assertEqual(self.window(), expected_window)


if __name__ == "__main__":
    unittest.main()
