"""tally's metrics through a real Prometheus.

Starts a 2-rank tally-server (`--nproc-per-node 2 --dp-shard 2`) and Debian's
`prometheus` on loopback, scraping both ranks' /metrics every second with the
alert rules of deploy/k8s loaded; trains a tiny Llama through the Python
client (tally_client), then asks Prometheus's HTTP API for what the client
knows: tally_grad_norm equals the last OptimStep's grad norm, the step and
token counters equal what the client sent, every rank's latency histograms
counted each command once, the two ranks took part in the same collectives,
and their parameter shards add up to the model. `promtool check metrics`
passes on each rank's /metrics, and every dashboard and alert expression is
valid PromQL that Prometheus evaluates.
"""

import json
import math
import os
import re
import socket
import subprocess
import tempfile
import time
import unittest
import urllib.parse
import urllib.request

import yaml

from tally_client import TrainingClient, sample
from tally_testing import TINY_LLAMA, TallyServer, read_json

SOURCE_DIR = os.environ["TALLY_SOURCE_DIR"]
RANKS = 2
MODEL = "tiny"
STEPS = 3
CALLS_PER_STEP = 2


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode("utf-8")


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.2)


class Prometheus:
    """A prometheus server in `work_dir` scraping `targets` every second."""

    def __init__(self, work_dir, targets, rules):
        self.port = free_port()
        with open(os.path.join(work_dir, "rules.yml"), "w", encoding="utf-8") as f:
            yaml.safe_dump(rules, f)
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["rules.yml"],
            "scrape_configs": [{"job_name": "tally",
                                "static_configs": [{"targets": targets}]}],
        }
        config_path = os.path.join(work_dir, "prometheus.yml")
        with open(config_path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        self._log = open(os.path.join(work_dir, "prometheus.log"), "wb")
        self.process = subprocess.Popen(
            ["prometheus", f"--config.file={config_path}",
             f"--storage.tsdb.path={os.path.join(work_dir, 'tsdb')}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            cwd=work_dir, stdout=self._log, stderr=subprocess.STDOUT)
        wait_for(self._ready, 30, "prometheus /-/ready")

    def _ready(self):
        if self.process.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.process.returncode}")
        try:
            http_get(f"http://127.0.0.1:{self.port}/-/ready")
            return True
        except OSError:
            return False

    def query(self, expr):
        """[(labels, float value)] of an instant query at the current time."""
        url = (f"http://127.0.0.1:{self.port}/api/v1/query?"
               + urllib.parse.urlencode({"query": expr}))
        answer = json.loads(http_get(url))
        if answer["status"] != "success":
            raise AssertionError(f"{expr}: {answer}")
        result = answer["data"]["result"]
        if answer["data"]["resultType"] == "scalar":
            return [({}, float(result[1]))]
        return [(r["metric"], float(r["value"][1])) for r in result]

    def value(self, expr):
        """The single value of `expr`; fails unless exactly one series."""
        series = self.query(expr)
        if len(series) != 1:
            raise AssertionError(f"{expr}: expected one series, got {series}")
        return series[0][1]

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._log.close()


class PrometheusEndToEndTest(unittest.TestCase):
    """One server, one Prometheus and one training run for all the tests."""

    @classmethod
    def setUpClass(cls):
        cls.temp = tempfile.TemporaryDirectory(prefix="tally_prom_")
        cls.server = TallyServer(
            os.path.join(cls.temp.name, "server"),
            extra_args=["--nproc-per-node", str(RANKS), "--dp-shard", str(RANKS)])
        try:
            port_file = os.path.join(cls.temp.name, "server", "ports.json")
            cls.metrics_ports = [cls.server.metrics_port] + [
                wait_for(lambda r=r: _try_read_json(f"{port_file}.rank{r}"), 60,
                         f"rank {r}'s port file")["metrics_port"]
                for r in range(1, RANKS)]
            with open(os.path.join(SOURCE_DIR, "deploy", "k8s", "components",
                                   "monitoring", "prometheusrule.yaml"),
                      encoding="utf-8") as f:
                cls.rules = yaml.safe_load(f)["spec"]
            cls.prometheus = Prometheus(
                cls.temp.name, [f"127.0.0.1:{p}" for p in cls.metrics_ports],
                cls.rules)
            cls.info, cls.tokens, cls.samples, cls.last = cls.train()
        except BaseException:
            cls.server.kill()
            if hasattr(cls, "prometheus"):
                cls.prometheus.stop()
            cls.temp.cleanup()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.prometheus.stop()
        code = cls.server.terminate()
        log = cls.server.log_tail()
        cls.temp.cleanup()
        if code != 0:
            raise AssertionError(f"tally-server exited with {code}:\n{log}")

    @classmethod
    def train(cls):
        """Trains STEPS steps; returns (ModelInfo, tokens, samples, the last
        OptimStepResponse)."""
        with TrainingClient(f"localhost:{cls.server.grpc_port}", MODEL) as client:
            info = client.create_model(config=TINY_LLAMA, seed=3,
                                       default_max_grad_norm=1.0)
            tokens = samples = 0
            step = None
            vocab = TINY_LLAMA["vocab_size"]
            for s in range(STEPS):
                calls = []
                for c in range(CALLS_PER_STEP):
                    batch = []
                    for i in range(c + 2):
                        length = 5 + 3 * i + s
                        text = [(7 * s + 11 * c + 13 * i + 5 * t) % vocab
                                for t in range(length + 1)]
                        batch.append(sample(text[:-1], text[1:]))
                    calls.append(client.forward_backward(batch))
                step = client.optim_step(adam={"learning_rate": 1e-2}).result()
                for call in calls:
                    tokens += call.result().valid_tokens
                    samples += call.result().num_samples
        return info, tokens, samples, step

    def test_prometheus_sees_what_the_client_sent(self):
        info, tokens, samples, last = (self.info, self.tokens, self.samples,
                                       self.last)
        self.assertEqual(last.step, STEPS)
        p = self.prometheus
        model = f'model_id="{MODEL}"'
        # Rank 0 times by model; the others (one model here) for all models.
        steps_timed = (f'tally_optim_step_seconds_count{{{model}, rank="0"}} '
                       'or tally_optim_step_seconds_count{rank!="0"}')
        wait_for(lambda: [v for _, v in p.query(steps_timed)] == [STEPS] * RANKS,
                 20, "a scrape of every rank after the last step")

        self.assertEqual(p.value("count(up{job=\"tally\"} == 1)"), RANKS)
        # Request-level series come from rank 0 only.
        grad_norm = p.query(f"tally_grad_norm{{{model}}}")
        self.assertEqual([labels["rank"] for labels, _ in grad_norm], ["0"])
        self.assertTrue(math.isclose(grad_norm[0][1], last.grad_norm,
                                     rel_tol=1e-12), (grad_norm, last.grad_norm))
        self.assertTrue(math.isclose(
            p.value(f"tally_clip_coefficient{{{model}}}"), last.clip_coef,
            rel_tol=1e-12))
        self.assertEqual(p.value(f"tally_model_step{{{model}}}"), STEPS)
        self.assertEqual(p.value(
            f'tally_optim_steps_total{{{model}, outcome="applied"}}'), STEPS)
        self.assertEqual(p.value(
            f'tally_optim_steps_total{{{model}, outcome="skipped_nonfinite"}}'), 0)
        self.assertEqual(p.value(f"tally_valid_tokens_total{{{model}}}"), tokens)
        self.assertEqual(p.value(f"tally_samples_total{{{model}}}"), samples)
        self.assertEqual(p.value(f"tally_pending_tokens{{{model}}}"), 0)
        self.assertEqual(p.value(
            'sum(tally_requests_total{method="ForwardBackward", code="OK"})'),
            STEPS * CALLS_PER_STEP)
        # Every rank timed each command once: rank 0 by model, the others
        # in one histogram for all their models (no model_id label).
        for metric, count in [("tally_forward_backward_seconds",
                               STEPS * CALLS_PER_STEP),
                              ("tally_optim_step_seconds", STEPS)]:
            per_rank = dict((l["rank"], v) for l, v in p.query(
                f'{metric}_count{{{model}, rank="0"}} or '
                f'{metric}_count{{rank!="0", model_id=""}}'))
            self.assertEqual(per_rank, {str(r): count for r in range(RANKS)})
            self.assertEqual(
                [l["rank"] for l, _ in p.query(f"{metric}_count{{{model}}}")],
                ["0"])
            inf_bucket = p.query(f'{metric}_bucket{{le="+Inf"}}')
            self.assertEqual([v for _, v in inf_bucket], [count] * RANKS)
        self.assertEqual(p.value(
            f"tally_grad_norm_distribution_count{{{model}}}"), STEPS)
        # Collectives pair up: both ranks made the same calls with the same
        # payload per communicator and op.
        calls = {}
        for labels, value in p.query("tally_collective_calls_total"):
            calls.setdefault((labels["communicator"], labels["op"]),
                             {})[labels["rank"]] = value
        world_all_reduce = [k for k in calls if k[1] == "all_reduce"
                            and "world" in k[0].split("+")]
        self.assertTrue(world_all_reduce, calls)
        self.assertGreater(calls[world_all_reduce[0]]["0"], 0)
        for key, per_rank in calls.items():
            self.assertEqual(len(set(per_rank.values())), 1, (key, per_rank))
        # dp_shard=2: the ranks' parameter shards add up to the model.
        self.assertEqual(p.value(
            f"sum(tally_rank_parameter_bytes{{{model}}})"),
            info.num_parameters * 4)
        self.assertEqual(p.value(
            f"sum(tally_rank_optimizer_state_bytes{{{model}}})"),
            2 * info.num_parameters * 4)
        self.assertEqual(p.value("min(tally_world_size)"), RANKS)

    def test_promtool_check_metrics_on_every_rank(self):
        for port in self.metrics_ports:
            text = http_get(f"http://127.0.0.1:{port}/metrics")
            self.assertIn(f'model_id="{MODEL}"', text)
            result = subprocess.run(["promtool", "check", "metrics"],
                                    input=text, capture_output=True, text=True,
                                    check=False)
            self.assertEqual(result.returncode, 0,
                             f"rank on port {port}:\n{result.stdout}{result.stderr}")

    def test_dashboard_and_alert_queries_evaluate(self):
        wait_for(lambda: self.prometheus.query("tally_model_step"), 20,
                 "a scrape with the model")
        with open(os.path.join(SOURCE_DIR, "deploy", "k8s", "base",
                               "grafana-dashboard.json"), encoding="utf-8") as f:
            dashboard = json.load(f)
        # As Grafana sends them with every variable at "All".
        exprs = [re.sub(r"\$(namespace|model_id|rank)\b", ".*", t["expr"])
                 .replace("$__rate_interval", "5s")
                 for panel in dashboard["panels"] for t in panel["targets"]]
        exprs += [r["expr"] for g in self.rules["groups"] for r in g["rules"]]
        for expr in exprs:
            with self.subTest(expr=expr):
                self.prometheus.query(expr)  # raises unless status success
        # The rules loaded and evaluate without errors.
        rules = json.loads(http_get(
            f"http://127.0.0.1:{self.prometheus.port}/api/v1/rules"))
        loaded = [r for g in rules["data"]["groups"] for r in g["rules"]]
        self.assertEqual(len(loaded),
                         sum(len(g["rules"]) for g in self.rules["groups"]))
        wait_for(lambda: all(r.get("health") == "ok" for g in json.loads(http_get(
            f"http://127.0.0.1:{self.prometheus.port}/api/v1/rules"))["data"]["groups"]
            for r in g["rules"]), 10, "every rule evaluated healthy")


def _try_read_json(path):
    try:
        return read_json(path)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    unittest.main()
