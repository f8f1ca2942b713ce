"""Every metric the dashboard and the alert rules name exists on a new server.

Starts a single-rank tally-server with its demo model and sends it no RPC,
scrapes its /metrics once, and checks that every metric named by a query of
deploy/k8s/base/grafana-dashboard.json (panels and variables) and by an alert
of the PrometheusRule (deploy/k8s/components/monitoring/prometheusrule.yaml)
has at least one sample: a panel or alert must never see "no data" for a counter that has not
counted yet. The metric names come from parsing the PromQL expressions, not
from a list here. The process_* series are there too (their values:
server/process_metrics_test.cc).
"""

import json
import os
import re
import tempfile
import unittest
import urllib.request

import yaml

from tally_testing import TallyServer

SOURCE_DIR = os.environ["TALLY_SOURCE_DIR"]
K8S_DIR = os.path.join(SOURCE_DIR, "deploy", "k8s")
RULE_PATH = os.path.join(K8S_DIR, "components", "monitoring", "prometheusrule.yaml")

# Series Prometheus adds to every scrape itself; no exporter serves them.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped",
                        "scrape_samples_post_metric_relabeling",
                        "scrape_series_added"}
# PromQL words that are neither metrics nor followed by "(".
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on",
                   "ignoring", "group_left", "group_right", "inf", "nan"}


def metric_names(expr):
    """The metric names a PromQL expression selects.

    Args:
        expr: a PromQL expression, Grafana variables ($name) allowed.

    Returns:
        The set of metric names: identifiers left once strings, label
        matchers, range and subquery brackets, grouping clauses, offsets and
        function names are taken out.
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', "", expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)",
                  " ", text)
    text = re.sub(r"\boffset\s+-?\w+", " ", text)
    text = re.sub(r"\$\w+", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.])([a-zA-Z_:][\w:]*)(\s*\()?", text):
        name, call = match.group(1), match.group(2)
        if call or name.lower() in PROMQL_KEYWORDS:
            continue
        names.add(name)
    return names


def dashboard_exprs():
    with open(os.path.join(K8S_DIR, "base", "grafana-dashboard.json"),
              encoding="utf-8") as f:
        dashboard = json.load(f)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        query = re.fullmatch(r"label_values\((.*),\s*\w+\)", variable.get("query", ""))
        if query:
            exprs.append(query.group(1))
    return exprs


def rule_exprs():
    with open(RULE_PATH, encoding="utf-8") as f:
        rules = yaml.safe_load(f)["spec"]
    return [r["expr"] for g in rules["groups"] for r in g["rules"]]


def scraped_samples(text):
    """{series name: [label text]} of the sample lines of a /metrics body."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s", line)
        samples.setdefault(match.group(1), []).append(match.group(2) or "")
    return samples


class MetricNamesTest(unittest.TestCase):
    """The parser against expressions of the shapes the dashboard uses."""

    def test_selectors_not_functions_labels_or_keywords(self):
        self.assertEqual(
            metric_names('histogram_quantile(0.9, sum by (le, rank) (rate('
                         'tally_optim_step_seconds_bucket{model_id=~"$model_id"}'
                         '[$__rate_interval])))'),
            {"tally_optim_step_seconds_bucket"})
        self.assertEqual(
            metric_names("sum by (namespace) (increase(a_total[30m] offset 2h)) > 0 "
                         "unless on (namespace) max_over_time(b_seconds[2h]) "
                         "> time() - 7200 and c == bool 1"),
            {"a_total", "b_seconds", "c"})
        self.assertEqual(metric_names('label_replace(x + y, "t", "$1", "m", "(.*)")'),
                         {"x", "y"})


class MetricsAtZeroTest(unittest.TestCase):

    def test_every_dashboard_and_alert_metric_is_served(self):
        named = set()
        for expr in dashboard_exprs() + rule_exprs():
            named |= metric_names(expr)
        named -= PROMETHEUS_SYNTHETIC
        self.assertTrue({"tally_memory_refusals_total", "tally_grad_norm"} <= named,
                        named)
        with tempfile.TemporaryDirectory(prefix="tally_zero_") as work:
            server = TallyServer(work, demo_model=True)
            try:
                with urllib.request.urlopen(
                        f"http://127.0.0.1:{server.metrics_port}/metrics",
                        timeout=10) as response:
                    samples = scraped_samples(response.read().decode("utf-8"))
            finally:
                code = server.terminate()
        self.assertEqual(code, 0, server.log_tail())
        missing = sorted(name for name in named if name not in samples)
        self.assertEqual(missing, [], "named by the dashboard or the alerts, "
                         "but no series on a new server")
        # Counters a refusal panel plots, at 0 with every label value.
        self.assertEqual(len(samples["tally_memory_refusals_total"]), 2)
        self.assertEqual(len(samples["tally_auth_failures_total"]), 2)
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes",
                     "process_virtual_memory_bytes", "process_open_fds",
                     "process_max_fds", "process_start_time_seconds"):
            self.assertEqual(samples.get(name), ['{rank="0"}'], name)


if __name__ == "__main__":
    unittest.main()
