"""deploy/k8s agrees with the tally-server this tree builds.

Renders every overlay (kubectl kustomize, or kustomize_lite without kubectl)
and checks: yamllint passes; every flag the pods pass exists in
`tally-server --help` and the server accepts the whole argument list; the
named container ports match the port flags and the rendezvous port; probes
call grpc.health.v1 on the `grpc` port; the Service reaches rank 0 only; the
PodMonitor scrapes the `metrics` port of every rank; the environment gives
each pod a distinct rank in [0, world size) with the world size equal to the
mesh; the grace period covers the drain; the alert rules pass `promtool check
rules` and `promtool test rules` (tests/deploy/alerts_test.yml); the Grafana
dashboard only queries metrics docs/metrics.md documents.

The TLS, auth and server-side checkpoint flags live in deploy/k8s/components;
the overlay using them (lws-production) is validated the same way. The plain
overlays listen on every interface in plaintext (--host=0.0.0.0
--allow-insecure-remote); lws-production serves TLS instead.
"""

import json
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

import kustomize_lite

SOURCE_DIR = os.environ.get("TALLY_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))
K8S_DIR = os.path.join(SOURCE_DIR, "deploy", "k8s")
PLAIN_OVERLAYS = ["lws", "statefulset"]
PRODUCTION_OVERLAY = "lws-production"
MESH_FLAGS = ["--pp", "--dp-replicate", "--dp-shard", "--cp", "--tp"]
# Flags whose sum bounds how long a pod takes to stop after SIGTERM
# (--exit-timeout-secs includes the drain; counting both is conservative).
STOP_FLAGS = ["--shutdown-drain-secs", "--exit-timeout-secs"]


def server_binary():
    path = os.environ.get("TALLY_SERVER")
    if not path:
        raise RuntimeError("TALLY_SERVER is not set; run through ctest")
    return path


def server_flags():
    """Every --flag `tally-server --help` lists."""
    out = subprocess.run([server_binary(), "--help"], check=True,
                         capture_output=True, text=True).stdout
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", out, re.M))


def parse_args(args):
    """{--flag: value} of `--flag=value` / bare `--flag` arguments."""
    parsed = {}
    for arg in args:
        name, _, value = arg.partition("=")
        parsed[name] = value if value else "true"
    return parsed


def pod_spec(workload):
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return workload["spec"]["template"]


def workload_of(objects):
    found = [o for o in objects if o["kind"] in ("LeaderWorkerSet",
                                                  "StatefulSet")]
    assert len(found) == 1, f"expected one workload, got {len(found)}"
    return found[0]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def resolve_pod_env(env, pod_index, workload):
    """The variables a pod of `workload` with index `pod_index` sees: literal
    values, the pod-index label through the downward API, and what the
    LeaderWorkerSet controller injects."""
    values = {}
    for name, entry in env.items():
        if "value" in entry:
            values[name] = entry["value"]
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.labels['apps.kubernetes.io/pod-index']", (
                f"{name}: unexpected fieldRef {path}")
            values[name] = str(pod_index)
    if workload["kind"] == "LeaderWorkerSet":
        size = workload["spec"]["leaderWorkerTemplate"]["size"]
        values.update({"LWS_LEADER_ADDRESS": "tally-0.tally",
                       "LWS_GROUP_SIZE": str(size),
                       "LWS_WORKER_INDEX": str(pod_index)})
    return values


def rank_and_world(flags, env):
    """runtime/distributed.cc ResolveRankEnv's precedence: flags, then
    torchrun's RANK/WORLD_SIZE, then LeaderWorkerSet's variables."""
    if "--rank" in flags:
        return int(flags["--rank"]), int(flags["--world-size"])
    if "RANK" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    return int(env["LWS_WORKER_INDEX"]), int(env["LWS_GROUP_SIZE"])


class ManifestTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.help_flags = server_flags()
        cls.rendered = {name: kustomize_lite.render(
            os.path.join(K8S_DIR, "overlays", name))
            for name in PLAIN_OVERLAYS + [PRODUCTION_OVERLAY]}

    def container(self, overlay):
        spec = pod_spec(workload_of(self.rendered[overlay]))["spec"]
        self.assertEqual(len(spec["containers"]), 1)
        return spec["containers"][0]

    def test_yamllint(self):
        result = subprocess.run(
            ["yamllint", "-c", os.path.join(SOURCE_DIR, "deploy", "yamllint.yaml"),
             os.path.join(SOURCE_DIR, "deploy"),
             os.path.join(SOURCE_DIR, "tests", "deploy")],
            capture_output=True, text=True, check=False)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_lite_renderer_matches_kubectl(self):
        if shutil.which("kubectl") is None:
            self.skipTest("kubectl not installed: only kustomize_lite renders")
        for overlay in PLAIN_OVERLAYS + [PRODUCTION_OVERLAY]:
            with self.subTest(overlay=overlay):
                directory = os.path.join(K8S_DIR, "overlays", overlay)
                lite = kustomize_lite.render(directory, use_kubectl=False)
                real = kustomize_lite.render(directory, use_kubectl=True)
                key = lambda o: (o["kind"], o["metadata"]["name"])
                self.assertEqual(sorted(map(key, lite)), sorted(map(key, real)))
                for kind in ("LeaderWorkerSet", "StatefulSet", "Service"):
                    for obj in real:
                        if obj["kind"] == kind:
                            self.assertEqual(
                                kustomize_lite.find(lite, kind,
                                                    obj["metadata"]["name"])["spec"],
                                obj["spec"])

    def test_every_flag_exists_and_the_server_accepts_the_arguments(self):
        for overlay in PLAIN_OVERLAYS:
            with self.subTest(overlay=overlay):
                args = self.container(overlay)["args"]
                unknown = set(parse_args(args)) - self.help_flags
                self.assertFalse(unknown, f"flags not in tally-server --help: {unknown}")
                # Flag values are parsed even with --help: bad ones exit 2.
                result = subprocess.run([server_binary()] + args + ["--help"],
                                        capture_output=True, text=True, check=False)
                self.assertEqual(result.returncode, 0, result.stderr)

    def test_production_overlay_flags(self):
        args = self.container(PRODUCTION_OVERLAY)["args"]
        unknown = set(parse_args(args)) - self.help_flags
        self.assertFalse(unknown, f"flags not in tally-server --help: {unknown}")
        result = subprocess.run([server_binary()] + args + ["--help"],
                                capture_output=True, text=True, check=False)
        self.assertEqual(result.returncode, 0, result.stderr)
        # What TallyServer::Start refuses (--help does not get that far).
        flags = parse_args(args)
        for needs_dir in ("--resume", "--checkpoint-every-steps",
                          "--checkpoint-on-exit"):
            if needs_dir in flags:
                self.assertIn("--checkpoint-dir", flags, needs_dir)
        # Tenants' paths are confined, and the server's own checkpoints lie
        # outside every tenant's reach.
        if "--auth-tokens-file" in flags:
            self.assertIn("--checkpoint-root", flags)
        if "--checkpoint-root" in flags and "--checkpoint-dir" in flags:
            root = flags["--checkpoint-root"].rstrip("/") + "/"
            periodic = flags["--checkpoint-dir"].rstrip("/") + "/"
            self.assertFalse(periodic.startswith(root) or root.startswith(periodic),
                             f"{periodic} and {root} overlap")

    def test_pods_listen_beyond_loopback_plaintext_only_without_tls(self):
        # The server's default --host is 127.0.0.1, which no Service reaches.
        for overlay in PLAIN_OVERLAYS + [PRODUCTION_OVERLAY]:
            with self.subTest(overlay=overlay):
                flags = parse_args(self.container(overlay)["args"])
                self.assertEqual(flags.get("--host"), "0.0.0.0")
                tls = "--tls-cert" in flags and "--tls-key" in flags
                self.assertEqual(tls, overlay == PRODUCTION_OVERLAY)
                # Plaintext beyond loopback needs the explicit opt-in; TLS
                # must not carry it.
                self.assertEqual("--allow-insecure-remote" in flags, not tls)

    def test_named_ports_match_the_flags(self):
        for overlay in PLAIN_OVERLAYS + [PRODUCTION_OVERLAY]:
            with self.subTest(overlay=overlay):
                container = self.container(overlay)
                flags = parse_args(container["args"])
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                self.assertEqual(set(ports), {"grpc", "metrics", "rendezvous"})
                self.assertEqual(ports["grpc"], int(flags["--grpc-port"]))
                self.assertEqual(ports["metrics"], int(flags["--metrics-port"]))
                self.assertEqual(str(ports["rendezvous"]),
                                 env_of(container)["MASTER_PORT"]["value"])

    def test_probes_call_grpc_health_on_the_grpc_port(self):
        for overlay in PLAIN_OVERLAYS:
            with self.subTest(overlay=overlay):
                container = self.container(overlay)
                grpc_port = next(p["containerPort"] for p in container["ports"]
                                 if p["name"] == "grpc")
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    self.assertIn(probe, container)
                    self.assertEqual(container[probe]["grpc"]["port"], grpc_port,
                                     probe)
                    # Service "" is the server's overall health.
                    self.assertEqual(container[probe]["grpc"].get("service", ""), "")
                # The startup probe outlasts the rendezvous timeout.
                startup = container["startupProbe"]
                flags = parse_args(container["args"])
                self.assertGreaterEqual(
                    startup["periodSeconds"] * startup["failureThreshold"],
                    int(flags["--rendezvous-timeout-secs"]))
        # Kubernetes gRPC probes cannot do TLS: the TLS overlay checks the port.
        container = self.container(PRODUCTION_OVERLAY)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertEqual(container[probe]["tcpSocket"]["port"], "grpc")

    def test_grace_period_covers_the_drain(self):
        for overlay in PLAIN_OVERLAYS + [PRODUCTION_OVERLAY]:
            with self.subTest(overlay=overlay):
                spec = pod_spec(workload_of(self.rendered[overlay]))["spec"]
                flags = parse_args(self.container(overlay)["args"])
                self.assertIn("--exit-timeout-secs", flags)
                stop = sum(int(flags[f]) for f in STOP_FLAGS if f in flags)
                self.assertGreaterEqual(spec["terminationGracePeriodSeconds"],
                                        stop + 10)

    def test_each_pod_gets_a_distinct_rank_and_rank_0_gets_the_traffic(self):
        for overlay in PLAIN_OVERLAYS + [PRODUCTION_OVERLAY]:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                workload = workload_of(objects)
                container = self.container(overlay)
                flags = parse_args(container["args"])
                mesh = 1
                for flag in MESH_FLAGS:
                    mesh *= int(flags.get(flag, "1"))
                pods = (workload["spec"]["leaderWorkerTemplate"]["size"]
                        if workload["kind"] == "LeaderWorkerSet"
                        else workload["spec"]["replicas"])
                ranks = []
                for index in range(pods):
                    env = resolve_pod_env(env_of(container), index, workload)
                    rank, world = rank_and_world(flags, env)
                    self.assertEqual(world, pods)
                    ranks.append(rank)
                    if index > 0:
                        self.assertIn("MASTER_ADDR" if workload["kind"] ==
                                      "StatefulSet" else "LWS_LEADER_ADDRESS", env)
                self.assertEqual(sorted(ranks), list(range(pods)))
                self.assertEqual(mesh, pods, "mesh flags disagree with the pod count")
                # The Service selects the pod of rank 0 and only it.
                service = kustomize_lite.find(objects, "Service", "tally")
                selector = service["spec"]["selector"]
                pod_labels = dict(pod_spec(workload)["metadata"]["labels"])
                index_label = ("leaderworkerset.sigs.k8s.io/worker-index"
                               if workload["kind"] == "LeaderWorkerSet"
                               else "apps.kubernetes.io/pod-index")
                self.assertEqual(selector.pop(index_label), str(ranks.index(0)))
                self.assertLessEqual(selector.items(), pod_labels.items())
                self.assertEqual(service["spec"]["ports"][0]["targetPort"], "grpc")

    def test_lws_restarts_the_whole_group(self):
        lws = workload_of(self.rendered["lws"])
        self.assertEqual(lws["spec"]["leaderWorkerTemplate"]["restartPolicy"],
                         "RecreateGroupOnPodRestart")
        # torchrun's variables would override the LWS ones.
        self.assertNotIn("RANK", env_of(self.container("lws")))

    def test_statefulset_rendezvous_through_the_headless_service(self):
        objects = self.rendered["statefulset"]
        sts = workload_of(objects)
        headless = kustomize_lite.find(objects, "Service", sts["spec"]["serviceName"])
        self.assertEqual(headless["spec"]["clusterIP"], "None")
        self.assertTrue(headless["spec"]["publishNotReadyAddresses"])
        self.assertEqual(sts["spec"]["podManagementPolicy"], "Parallel")
        master = env_of(self.container("statefulset"))["MASTER_ADDR"]["value"]
        self.assertEqual(master, f"{sts['metadata']['name']}-0.{headless['metadata']['name']}")

    def test_podmonitor_scrapes_the_metrics_port_of_every_rank(self):
        for overlay in PLAIN_OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                monitor = kustomize_lite.find(objects, "PodMonitor", "tally")
                endpoints = monitor["spec"]["podMetricsEndpoints"]
                self.assertEqual([e["port"] for e in endpoints], ["metrics"])
                pod_labels = pod_spec(workload_of(objects))["metadata"]["labels"]
                # Every pod (every rank) matches: no rank label in the selector.
                self.assertLessEqual(
                    monitor["spec"]["selector"]["matchLabels"].items(),
                    pod_labels.items())

    def test_volumes_and_resources(self):
        for overlay in PLAIN_OVERLAYS + [PRODUCTION_OVERLAY]:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                spec = pod_spec(workload_of(objects))["spec"]
                container = spec["containers"][0]
                volumes = {v["name"]: v for v in spec["volumes"]}
                for mount in container["volumeMounts"]:
                    self.assertIn(mount["name"], volumes)
                claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
                pvc = kustomize_lite.find(objects, "PersistentVolumeClaim", claim)
                self.assertIn("ReadWriteMany", pvc["spec"]["accessModes"])
                self.assertIn("cpu", container["resources"]["requests"])
                self.assertIn("memory", container["resources"]["requests"])
                self.assertTrue(spec["securityContext"]["runAsNonRoot"])

    def test_tls_and_auth_secrets_are_wired_to_flags(self):
        container = self.container(PRODUCTION_OVERLAY)
        flags = parse_args(container["args"])
        spec = pod_spec(workload_of(self.rendered[PRODUCTION_OVERLAY]))["spec"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"]
                   if "secret" in v}
        self.assertEqual(secrets, {"tls": "tally-tls",
                                   "auth-tokens": "tally-auth-tokens"})
        for flag, volume, key in [("--tls-cert", "tls", "tls.crt"),
                                  ("--tls-key", "tls", "tls.key"),
                                  ("--tls-client-ca", "tls", "ca.crt"),
                                  ("--auth-tokens-file", "auth-tokens", "tokens")]:
            self.assertEqual(flags[flag], f"{mounts[volume]}/{key}")

    def test_alert_rules_pass_promtool(self):
        with open(os.path.join(K8S_DIR, "base", "prometheusrule.yaml"),
                  encoding="utf-8") as f:
            rule = yaml.safe_load(f)
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "rules.yml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(rule["spec"], f)
            shutil.copy(os.path.join(SOURCE_DIR, "tests", "deploy", "alerts_test.yml"),
                        tmp)
            for command in (["promtool", "check", "rules", "rules.yml"],
                            ["promtool", "test", "rules", "alerts_test.yml"]):
                result = subprocess.run(command, cwd=tmp, capture_output=True,
                                        text=True, check=False)
                self.assertEqual(result.returncode, 0,
                                 f"{' '.join(command)}:\n{result.stdout}{result.stderr}")
        alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
        with open(os.path.join(SOURCE_DIR, "tests", "deploy", "alerts_test.yml"),
                  encoding="utf-8") as f:
            tested = {t["alertname"] for case in yaml.safe_load(f)["tests"]
                      for t in case["alert_rule_test"]}
        self.assertEqual(alerts, tested, "every alert needs a promtool test")

    def test_dashboard_queries_documented_metrics(self):
        with open(os.path.join(K8S_DIR, "base", "grafana-dashboard.json"),
                  encoding="utf-8") as f:
            dashboard = json.load(f)
        with open(os.path.join(SOURCE_DIR, "docs", "metrics.md"), encoding="utf-8") as f:
            documented = set(re.findall(r"^\| `(tally_[a-z_]+)`", f.read(), re.M))
        exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
        self.assertGreater(len(exprs), 10)
        for expr in exprs:
            for name in re.findall(r"\btally_[a-z_]+", expr):
                self.assertIn(re.sub(r"_bucket$", "", name), documented, expr)


if __name__ == "__main__":
    unittest.main()
