"""deploy/k8s agrees with the tally-server this tree builds.

Renders every overlay in deploy/k8s/overlays (kubectl kustomize, or
kustomize_lite without kubectl) and checks: yamllint passes; every flag the
pods pass exists in tally-server (its --help, or server/flags.cc before the
build) and the server accepts the whole argument list; each flag appears once
and exactly one transport is chosen (plaintext or TLS); the named container
ports match the port flags and the rendezvous port; the probes are HTTP
GETs of /healthz and /readyz on the `metrics` port; no Service takes the name of the
workload's headless Service (the LWS name, or a StatefulSet's serviceName);
the client Service reaches rank 0 only; the PodMonitor scrapes the `metrics`
port of every rank; each pod gets a distinct rank in [0, world size) with the
world size equal to the mesh; every container meets Pod Security
"restricted"; the shutdown budget follows docs/deploy.md's formula; every
rank's --threads is its CPU request (the downward API variable in its args,
resolved as the kubelet does); base and docs/deploy.md's overlay without
components/monitoring hold built-in kinds only; the
PodDisruptionBudget and the NetworkPolicies cover the pods; the checkpoint
volume can be mounted by every rank; the periodic checkpoint directory lies
outside the tenants' root; with --auth-tokens-file, /metrics takes HTTP Basic
auth from a mounted Secret and the PodMonitor scrapes with that Secret's keys
(and without it, the PodMonitor sends no credentials); the storage knob documented in docs/deploy.md
renders; the alert rules pass `promtool check rules` and `promtool test
rules` (tests/deploy/alerts_test.yml) and use metrics server/metrics.cc
registers and docs/metrics.md quotes verbatim; the Grafana dashboard only
queries metrics docs/metrics.md documents, in valid PromQL, through its
namespace, model_id and rank variables, and has panels for the RL policy
statistics and memory admission.
"""

import copy
import itertools
import json
import math
import os
import re
import shutil
import subprocess
import tempfile
import unittest

import yaml

import kustomize_lite
import server_flags
from server_flags import SOURCE_DIR

K8S_DIR = os.path.join(SOURCE_DIR, "deploy", "k8s")
MONITORING_DIR = os.path.join(K8S_DIR, "components", "monitoring")
DEPLOY_DOC = os.path.join(SOURCE_DIR, "docs", "deploy.md")
OVERLAYS = sorted(os.listdir(os.path.join(K8S_DIR, "overlays")))
WORKLOAD_KINDS = ("LeaderWorkerSet", "StatefulSet")
MESH_FLAGS = ["--pp", "--dp-replicate", "--dp-shard", "--cp", "--tp"]
TLS_AUTH_FLAGS = ["--tls-cert", "--tls-key", "--tls-client-ca",
                  "--auth-tokens-file"]
# docs/deploy.md, "Shutdown budget".
SHUTDOWN_ANNOTATION = "tally/shutdown-"
EXIT_SLACK_SECS = 10
GRACE_SLACK_SECS = 10
# The API versions of the kinds every cluster serves (no CRD).
BUILT_IN_API_VERSIONS = {"v1", "apps/v1", "policy/v1", "networking.k8s.io/v1"}
# A port Gloo or NCCL might listen on (the Linux ephemeral range).
EPHEMERAL_PORT = ("", 45000)


def pod_template(workload):
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["workerTemplate"]
    return workload["spec"]["template"]


def workload_of(objects):
    found = [o for o in objects if o["kind"] in WORKLOAD_KINDS]
    assert len(found) == 1, f"expected one workload, got {len(found)}"
    return found[0]


def world_size(workload):
    if workload["kind"] == "LeaderWorkerSet":
        return workload["spec"]["leaderWorkerTemplate"]["size"]
    return workload["spec"]["replicas"]


def headless_service_name(workload):
    """The Service whose DNS names the ranks rendezvous through: the LWS
    controller creates one named like the LWS; a StatefulSet names its own."""
    if workload["kind"] == "LeaderWorkerSet":
        return workload["metadata"]["name"]
    return workload["spec"]["serviceName"]


def of_kind(objects, kind):
    return [o for o in objects if o["kind"] == kind]


def env_of(container):
    return {e["name"]: e for e in container.get("env", [])}


def cpu_millicores(quantity):
    """A Kubernetes CPU quantity ("4", "500m", "1.5") in millicores."""
    text = str(quantity)
    if text.endswith("m"):
        return int(text[:-1])
    return math.ceil(float(text) * 1000)


def downward_resource(container, ref):
    """What the kubelet puts in an env var with a resourceFieldRef of
    requests.cpu: the container's request over the divisor, rounded up."""
    assert ref["resource"] == "requests.cpu", f"unexpected resource {ref}"
    assert ref.get("containerName", container["name"]) == container["name"]
    request = container["resources"]["requests"].get("cpu", "0")
    return str(math.ceil(cpu_millicores(request)
                         / cpu_millicores(ref.get("divisor", "1"))))


def resolve_pod_env(container, pod_index, workload):
    """The variables `container` sees in the pod of `workload` with index
    `pod_index`: literal values, the pod-index label and the CPU request
    through the downward API, and what the LeaderWorkerSet controller
    injects."""
    values = {}
    for name, entry in env_of(container).items():
        if "value" in entry:
            values[name] = entry["value"]
        elif "resourceFieldRef" in entry["valueFrom"]:
            values[name] = downward_resource(
                container, entry["valueFrom"]["resourceFieldRef"])
        else:
            path = entry["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == "metadata.labels['apps.kubernetes.io/pod-index']", (
                f"{name}: unexpected fieldRef {path}")
            values[name] = str(pod_index)
    if workload["kind"] == "LeaderWorkerSet":
        name = workload["metadata"]["name"]
        values.update({"LWS_LEADER_ADDRESS": f"{name}-0.{name}.default",
                       "LWS_GROUP_SIZE": str(world_size(workload)),
                       "LWS_WORKER_INDEX": str(pod_index)})
    return values


def expand_args(args, env):
    """The kubelet's $(VAR) expansion of container args: a defined variable
    is replaced, $$ is a literal $, anything else stays as written."""
    def replace(match):
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return [re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", replace, arg)
            for arg in args]


def rank_and_world(flags, env):
    """runtime/parallel/distributed.cc ResolveRankEnv's precedence: flags, then
    torchrun's RANK/WORLD_SIZE, then LeaderWorkerSet's variables."""
    if "--rank" in flags:
        return int(flags["--rank"]), int(flags["--world-size"])
    if "RANK" in env:
        return int(env["RANK"]), int(env["WORLD_SIZE"])
    return int(env["LWS_WORKER_INDEX"]), int(env["LWS_GROUP_SIZE"])


def required_exit_timeout(annotations, drain_secs):
    """docs/deploy.md's formula: drain + the longest command + writing the
    final checkpoint at the assumed bandwidth + slack."""
    value = lambda key: int(annotations[SHUTDOWN_ANNOTATION + key])
    checkpoint_secs = math.ceil(value("checkpoint-bytes")
                                / value("write-bytes-per-second"))
    return (drain_secs + value("longest-command-seconds") + checkpoint_secs
            + EXIT_SLACK_SECS)


def effective_security(pod_spec, container):
    """The container's securityContext over the pod's (Kubernetes' rule)."""
    merged = dict(pod_spec.get("securityContext", {}))
    merged.update(container.get("securityContext", {}))
    return merged


def selects(selector, labels):
    if set(selector) - {"matchLabels"}:
        raise NotImplementedError(f"selector {selector}")
    return selector.get("matchLabels", {}).items() <= labels.items()


def peer_admits(peers, source):
    """Whether a NetworkPolicy rule's `from` list admits `source`, a dict of
    the connecting pod's `labels`, `namespace_labels` and `same_namespace`.
    ipBlock peers are taken to admit every pod (pod IPs may fall in them)."""
    if not peers:
        return True
    for peer in peers:
        if "ipBlock" in peer:
            return True
        if "namespaceSelector" in peer:
            namespace_ok = selects(peer["namespaceSelector"],
                                   source["namespace_labels"])
        else:
            namespace_ok = source["same_namespace"]
        if namespace_ok and selects(peer.get("podSelector", {}),
                                    source["labels"]):
            return True
    return False


def port_admits(ports, port):
    """`port` is (name, number); a rule's ports match by name or number."""
    if not ports:
        return True
    name, number = port
    for entry in ports:
        if entry.get("protocol", "TCP") != "TCP":
            continue
        wanted = entry.get("port")
        if wanted is None or wanted == name:
            return True
        if isinstance(wanted, int) and wanted <= number <= entry.get("endPort",
                                                                     wanted):
            return True
    return False


def network_admits(policies, pod_labels, port, source):
    """NetworkPolicy ingress semantics for a pod labelled `pod_labels`."""
    selecting = [p for p in policies
                 if selects(p["spec"]["podSelector"], pod_labels)
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    return any(port_admits(rule.get("ports"), port)
               and peer_admits(rule.get("from"), source)
               for policy in selecting
               for rule in policy["spec"].get("ingress", []))


def kustomization_blocks(markdown):
    """The ```yaml blocks of `markdown` that are kustomization.yaml files."""
    return [yaml.safe_load(block) for block in
            re.findall(r"```yaml\n(.*?)```", markdown, re.S)
            if "kind: Kustomization" in block]


def render_beside_overlays(kustomization):
    """The objects of `kustomization` (a dict) as an overlay directory beside
    the shipped ones, in a copy of deploy/k8s."""
    with tempfile.TemporaryDirectory() as tmp:
        tree = os.path.join(tmp, "k8s")
        shutil.copytree(K8S_DIR, tree)
        overlay = os.path.join(tree, "overlays", "my-cluster")
        os.makedirs(overlay)
        with open(os.path.join(overlay, "kustomization.yaml"), "w",
                  encoding="utf-8") as f:
            yaml.safe_dump(kustomization, f)
        return kustomize_lite.render(overlay)


class ManifestTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.flags = server_flags.load()
        cls.rendered = {name: kustomize_lite.render(
            os.path.join(K8S_DIR, "overlays", name)) for name in OVERLAYS}

    def pod_spec(self, overlay):
        return pod_template(workload_of(self.rendered[overlay]))["spec"]

    def container(self, overlay):
        containers = self.pod_spec(overlay)["containers"]
        self.assertEqual(len(containers), 1)
        return containers[0]

    def pod_args(self, overlay, pod_index=0):
        """The container's args as the pod with `pod_index` runs them."""
        container = self.container(overlay)
        return expand_args(container["args"], resolve_pod_env(
            container, pod_index, workload_of(self.rendered[overlay])))

    def parsed_args(self, overlay, pod_index=0):
        return self.flags.parse(self.pod_args(overlay, pod_index))

    def uses_tls(self, overlay):
        return "--tls-cert" in self.parsed_args(overlay)

    def test_every_overlay_is_checked(self):
        self.assertGreaterEqual(set(OVERLAYS), {"lws", "statefulset",
                                                "lws-production", "lws-cuda"})

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
        key = lambda o: (o["kind"], o["metadata"]["name"])
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                directory = os.path.join(K8S_DIR, "overlays", overlay)
                lite = sorted(kustomize_lite.render(directory, use_kubectl=False),
                              key=key)
                real = sorted(kustomize_lite.render(directory, use_kubectl=True),
                              key=key)
                self.assertEqual([key(o) for o in lite], [key(o) for o in real])
                for lite_obj, real_obj in zip(lite, real):
                    if real_obj["kind"] != "ConfigMap":  # lite skips data
                        self.assertEqual(lite_obj, real_obj)

    def test_every_flag_exists_and_the_server_accepts_the_arguments(self):
        binary = server_flags.server_binary()
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                args = self.pod_args(overlay)
                self.flags.parse(args)  # raises on an unknown flag
                if binary is None:
                    continue
                # Flag values are parsed even with --help: bad ones exit 2.
                result = subprocess.run([binary] + args + ["--help"],
                                        capture_output=True, text=True, check=False)
                self.assertEqual(result.returncode, 0, result.stderr)
        if binary is None:
            self.skipTest("build/server/tally-server not built: flag names "
                          "checked against server/flags.cc, values not parsed")

    def test_each_flag_once_and_exactly_one_transport(self):
        tls_overlays = []
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                names = [a.partition("=")[0] for a in self.container(overlay)["args"]]
                repeated = {n for n in names if names.count(n) > 1}
                self.assertFalse(repeated, f"flags given twice: {repeated}")
                if self.uses_tls(overlay):
                    tls_overlays.append(overlay)
                    for flag in TLS_AUTH_FLAGS:
                        self.assertEqual(names.count(flag), 1, flag)
                # Plaintext beyond loopback needs the explicit opt-in; TLS
                # must not carry it.
                self.assertNotEqual("--allow-insecure-remote" in names,
                                    self.uses_tls(overlay))
        self.assertIn("lws-production", tls_overlays)

    def test_pods_listen_beyond_loopback(self):
        # The server's default --host is 127.0.0.1, which no Service reaches.
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                self.assertEqual(self.parsed_args(overlay).get("--host"), "0.0.0.0")

    def test_checkpoint_flags(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                flags = self.parsed_args(overlay)
                # What TallyServer::Start refuses (--help does not get that far).
                for needs_dir in ("--resume", "--checkpoint-every-steps",
                                  "--checkpoint-on-exit"):
                    if needs_dir in flags:
                        self.assertIn("--checkpoint-dir", flags, needs_dir)
                if "--auth-tokens-file" in flags:
                    self.assertIn("--checkpoint-root", flags)
                mounts = {m["name"]: m["mountPath"].rstrip("/") + "/"
                          for m in self.container(overlay)["volumeMounts"]}
                directories = [flags[f].rstrip("/") + "/" for f in
                               ("--checkpoint-root", "--checkpoint-dir") if f in flags]
                for directory in directories:
                    # On the shared volume, below its mount point.
                    self.assertTrue(directory.startswith(mounts["checkpoints"]),
                                    directory)
                    self.assertNotEqual(directory, mounts["checkpoints"])
                if len(directories) == 2:
                    # The server's own checkpoints lie outside every tenant's
                    # reach, and the root is not inside them either.
                    root, periodic = directories
                    self.assertFalse(periodic.startswith(root)
                                     or root.startswith(periodic),
                                     f"{periodic} and {root} overlap")

    def test_named_ports_match_the_flags(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                container = self.container(overlay)
                flags = self.parsed_args(overlay)
                ports = {p["name"]: p["containerPort"] for p in container["ports"]}
                self.assertEqual(set(ports), {"grpc", "metrics", "rendezvous"})
                self.assertEqual(ports["grpc"], int(flags["--grpc-port"]))
                self.assertEqual(ports["metrics"], int(flags["--metrics-port"]))
                self.assertEqual(str(ports["rendezvous"]),
                                 env_of(container)["MASTER_PORT"]["value"])

    def test_probes(self):
        """Every rank's probes are HTTP on its metrics port, whatever the
        gRPC transport: /healthz for startup and liveness, /readyz (503 while
        draining or after a rank failed) for readiness."""
        paths = {"startupProbe": "/healthz", "readinessProbe": "/readyz",
                 "livenessProbe": "/healthz"}
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                container = self.container(overlay)
                for probe, path in paths.items():
                    self.assertIn(probe, container)
                    self.assertEqual(container[probe]["httpGet"],
                                     {"path": path, "port": "metrics"}, probe)
                # A busy metrics port must not fail a probe at once.
                for probe in ("readinessProbe", "livenessProbe"):
                    self.assertGreaterEqual(
                        container[probe].get("timeoutSeconds", 1), 5, probe)
                # The startup probe outlasts the rendezvous timeout.
                startup = container["startupProbe"]
                self.assertGreaterEqual(
                    startup["periodSeconds"] * startup["failureThreshold"],
                    int(self.parsed_args(overlay)["--rendezvous-timeout-secs"]))

    def test_shutdown_budget_follows_the_documented_formula(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                template = pod_template(workload_of(self.rendered[overlay]))
                flags = self.parsed_args(overlay)
                drain = float(flags["--shutdown-drain-secs"])
                exit_timeout = float(flags["--exit-timeout-secs"])
                grace = template["spec"]["terminationGracePeriodSeconds"]
                self.assertGreater(grace, exit_timeout)
                self.assertGreater(exit_timeout, drain)
                self.assertGreaterEqual(
                    exit_timeout,
                    required_exit_timeout(template["metadata"]["annotations"], drain))
                self.assertGreaterEqual(grace, exit_timeout + GRACE_SLACK_SECS)

    def test_no_service_takes_the_headless_service_name(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                workload = workload_of(objects)
                headless = headless_service_name(workload)
                named = [s for s in of_kind(objects, "Service")
                         if s["metadata"]["name"] == headless]
                if workload["kind"] == "LeaderWorkerSet":
                    # The controller creates it only if the name is free.
                    self.assertEqual(named, [], f"Service {headless} shadows "
                                     "the LWS controller's headless Service")
                else:
                    self.assertEqual(len(named), 1, headless)
                    self.assertEqual(named[0]["spec"]["clusterIP"], "None")
                    self.assertTrue(named[0]["spec"]["publishNotReadyAddresses"])

    def test_documented_services_exist(self):
        with open(DEPLOY_DOC, encoding="utf-8") as f:
            referenced = set(re.findall(r"svc/([a-z0-9-]+)", f.read()))
        self.assertTrue(referenced)
        for overlay in OVERLAYS:
            names = {s["metadata"]["name"]
                     for s in of_kind(self.rendered[overlay], "Service")}
            self.assertLessEqual(referenced, names, overlay)

    def test_each_pod_gets_a_distinct_rank_and_rank_0_gets_the_traffic(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                workload = workload_of(objects)
                container = self.container(overlay)
                flags = self.parsed_args(overlay)
                mesh = math.prod(int(flags.get(flag, "1")) for flag in MESH_FLAGS)
                pods = world_size(workload)
                ranks = []
                for index in range(pods):
                    env = resolve_pod_env(container, index, workload)
                    rank, world = rank_and_world(flags, env)
                    self.assertEqual(world, pods)
                    ranks.append(rank)
                    if index > 0:
                        self.assertIn("MASTER_ADDR" if workload["kind"] ==
                                      "StatefulSet" else "LWS_LEADER_ADDRESS", env)
                self.assertEqual(sorted(ranks), list(range(pods)))
                self.assertEqual(mesh, pods, "mesh flags disagree with the pod count")
                # The client Service selects the pod of rank 0 and only it.
                service = kustomize_lite.find(objects, "Service", "tally-api")
                self.assertNotEqual(service["spec"].get("clusterIP"), "None")
                selector = dict(service["spec"]["selector"])
                pod_labels = dict(pod_template(workload)["metadata"]["labels"])
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
        sts = workload_of(self.rendered["statefulset"])
        self.assertEqual(sts["spec"]["podManagementPolicy"], "Parallel")
        master = env_of(self.container("statefulset"))["MASTER_ADDR"]["value"]
        self.assertEqual(master, f"{sts['metadata']['name']}-0."
                                 f"{headless_service_name(sts)}")

    def test_monitoring_selects_every_rank_and_carries_the_release_label(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                monitor = kustomize_lite.find(objects, "PodMonitor", "tally")
                endpoints = monitor["spec"]["podMetricsEndpoints"]
                self.assertEqual([e["port"] for e in endpoints], ["metrics"])
                pod_labels = pod_template(workload_of(objects))["metadata"]["labels"]
                # Every pod (every rank) matches: no rank label in the selector.
                self.assertLessEqual(
                    monitor["spec"]["selector"]["matchLabels"].items(),
                    pod_labels.items())
                # kube-prometheus-stack selects both kinds by the same label.
                rule = kustomize_lite.find(objects, "PrometheusRule", "tally")
                self.assertEqual(monitor["metadata"]["labels"].get("release"),
                                 rule["metadata"]["labels"].get("release"))
        production = self.rendered["lws-production"]
        self.assertIn("release", kustomize_lite.find(
            production, "PodMonitor", "tally")["metadata"]["labels"])

    def test_monitoring_is_an_optional_component(self):
        """base, and docs/deploy.md's StatefulSet overlay without
        components/monitoring, render only built-in kinds, which a cluster
        without the Prometheus Operator accepts; the components that patch
        the monitoring objects still render without them; the shipped
        overlays include the component, whose objects carry base's labels."""
        base = kustomize_lite.render(os.path.join(K8S_DIR, "base"))
        self.assertEqual({o["apiVersion"] for o in base} - BUILT_IN_API_VERSIONS,
                         set())
        with open(DEPLOY_DOC, encoding="utf-8") as f:
            plain = [b for b in kustomization_blocks(f.read())
                     if b.get("resources") == ["../../workloads/statefulset"]]
        self.assertEqual(len(plain), 1, "docs/deploy.md: one overlay of "
                         "workloads/statefulset without monitoring")
        self.assertNotIn("../../components/monitoring", plain[0]["components"])
        objects = render_beside_overlays(plain[0])
        self.assertEqual({o["apiVersion"] for o in objects} - BUILT_IN_API_VERSIONS,
                         set())
        workload_of(objects)
        secured = render_beside_overlays({
            "resources": ["../../workloads/statefulset"],
            "components": ["../../components/tls-auth",
                           "../../components/prometheus-release"]})
        self.assertFalse([o for o in secured if o["apiVersion"].startswith(
            "monitoring.coreos.com/")])
        base_labels = {"app.kubernetes.io/name": "tally",
                       "app.kubernetes.io/part-of": "tally"}
        for overlay in OVERLAYS:
            for kind in ("PodMonitor", "PrometheusRule"):
                with self.subTest(overlay=overlay, kind=kind):
                    labels = kustomize_lite.find(self.rendered[overlay], kind,
                                                 "tally")["metadata"]["labels"]
                    self.assertLessEqual(base_labels.items(), labels.items())

    def test_threads_follow_the_cpu_request(self):
        """Every rank runs one intra-op thread per core it requests: --threads
        is the container's own requests.cpu (downward API), so a changed
        request changes the threads."""
        for overlay in OVERLAYS:
            workload = workload_of(self.rendered[overlay])
            container = self.container(overlay)
            request = container["resources"]["requests"]["cpu"]
            for index in range(world_size(workload)):
                with self.subTest(overlay=overlay, pod=index):
                    threads = int(self.parsed_args(overlay, index)["--threads"])
                    self.assertEqual(threads * 1000, cpu_millicores(request))
            with self.subTest(overlay=overlay, request="6"):
                changed = copy.deepcopy(container)
                changed["resources"]["requests"]["cpu"] = "6"
                args = expand_args(changed["args"],
                                   resolve_pod_env(changed, 0, workload))
                self.assertEqual(self.flags.parse(args)["--threads"], "6")

    def test_pod_security_restricted(self):
        for overlay in OVERLAYS:
            spec = self.pod_spec(overlay)
            containers = spec["containers"] + spec.get("initContainers", [])
            self.assertFalse(spec.get("hostNetwork") or spec.get("hostPID")
                             or spec.get("hostIPC"))
            for volume in spec["volumes"]:
                self.assertLessEqual(set(volume) - {"name"}, {
                    "emptyDir", "persistentVolumeClaim", "secret", "configMap",
                    "projected", "downwardAPI"}, volume["name"])
            for container in containers:
                with self.subTest(overlay=overlay, container=container["name"]):
                    security = effective_security(spec, container)
                    self.assertIs(security.get("allowPrivilegeEscalation"), False)
                    self.assertIs(security.get("runAsNonRoot"), True)
                    self.assertIsInstance(security.get("runAsUser"), int)
                    self.assertGreater(security["runAsUser"], 0)
                    self.assertEqual(security.get("capabilities", {}).get("drop"),
                                     ["ALL"])
                    self.assertFalse(security["capabilities"].get("add"))
                    self.assertEqual(security.get("seccompProfile", {}).get("type"),
                                     "RuntimeDefault")
                    self.assertIs(security.get("readOnlyRootFilesystem"), True)
                    self.assertFalse(security.get("privileged"))
                    for port in container.get("ports", []):
                        self.assertNotIn("hostPort", port)
                    # The read-only root leaves /tmp writable.
                    self.assertIn("/tmp", {m["mountPath"]
                                           for m in container["volumeMounts"]})

    def test_checkpoint_volume_reaches_every_rank(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                template = pod_template(workload_of(objects))
                volumes = {v["name"]: v for v in template["spec"]["volumes"]}
                container = self.container(overlay)
                for mount in container["volumeMounts"]:
                    self.assertIn(mount["name"], volumes)
                claim = volumes["checkpoints"]["persistentVolumeClaim"]["claimName"]
                pvc = kustomize_lite.find(objects, "PersistentVolumeClaim", claim)
                self.assert_every_rank_mounts(pvc, template)
                self.assertIn("cpu", container["resources"]["requests"])
                self.assertIn("memory", container["resources"]["requests"])

    def assert_every_rank_mounts(self, pvc, template):
        """ReadWriteMany, or ReadWriteOnce with every rank required on one
        node (ReadWriteOncePod would admit a single rank)."""
        modes = pvc["spec"]["accessModes"]
        if "ReadWriteMany" in modes:
            return
        self.assertEqual(modes, ["ReadWriteOnce"])
        terms = (template["spec"].get("affinity", {}).get("podAffinity", {})
                 .get("requiredDuringSchedulingIgnoredDuringExecution", []))
        self.assertTrue(any(t["topologyKey"] == "kubernetes.io/hostname"
                            and selects(t["labelSelector"],
                                        template["metadata"]["labels"])
                            for t in terms),
                        "ReadWriteOnce needs every rank on the volume's node")

    def test_documented_storage_knob(self):
        """docs/deploy.md's example overlay (a directory beside the shipped
        overlays) renders: ReadWriteMany on the named class, ranks free to
        spread over nodes."""
        with open(DEPLOY_DOC, encoding="utf-8") as f:
            blocks = kustomization_blocks(f.read())
        knobs = [b for b in blocks if "../../components/shared-storage"
                 in b.get("components", [])]
        self.assertEqual(len(knobs), 1, "docs/deploy.md: one overlay using "
                         "components/shared-storage")
        objects = render_beside_overlays(knobs[0])
        pvc = kustomize_lite.find(objects, "PersistentVolumeClaim",
                                  "tally-checkpoints")
        self.assertEqual(pvc["spec"]["accessModes"], ["ReadWriteMany"])
        self.assertTrue(pvc["spec"].get("storageClassName"))
        template = pod_template(workload_of(objects))
        self.assertNotIn("affinity", template["spec"])
        self.assert_every_rank_mounts(pvc, template)

    def test_disruption_budget_keeps_the_world_whole(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                workload = workload_of(objects)
                labels = pod_template(workload)["metadata"]["labels"]
                budgets = [b for b in of_kind(objects, "PodDisruptionBudget")
                           if selects(b["spec"]["selector"], labels)]
                self.assertEqual(len(budgets), 1)
                spec = budgets[0]["spec"]
                self.assertTrue(spec.get("maxUnavailable") == 0
                                or spec.get("minAvailable") == world_size(workload),
                                spec)

    def test_network_policy_keeps_rank_ports_to_the_job(self):
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                objects = self.rendered[overlay]
                policies = of_kind(objects, "NetworkPolicy")
                labels = pod_template(workload_of(objects))["metadata"]["labels"]
                ports = {p["name"]: (p["name"], p["containerPort"])
                         for p in self.container(overlay)["ports"]}
                peer = {"labels": labels, "namespace_labels": {},
                        "same_namespace": True}
                neighbour = {"labels": {"app": "other"}, "namespace_labels": {},
                             "same_namespace": True}
                stranger = {"labels": {"app": "other"},
                            "namespace_labels": {"name": "elsewhere"},
                            "same_namespace": False}
                admits = lambda port, source: network_admits(
                    policies, labels, port, source)
                for port in list(ports.values()) + [EPHEMERAL_PORT]:
                    self.assertTrue(admits(port, peer), port)
                for source in (neighbour, stranger):
                    # Clients and Prometheus, under the default knob.
                    self.assertTrue(admits(ports["grpc"], source))
                    self.assertTrue(admits(ports["metrics"], source))
                    # TCPStore, Gloo and NCCL: the job's pods only.
                    self.assertFalse(admits(ports["rendezvous"], source))
                    self.assertFalse(admits(EPHEMERAL_PORT, source))

    def test_gpu_pods_get_a_memory_backed_dev_shm(self):
        gpu_overlays = []
        for overlay in OVERLAYS:
            container = self.container(overlay)
            if "nvidia.com/gpu" not in container["resources"].get("limits", {}):
                continue
            gpu_overlays.append(overlay)
            with self.subTest(overlay=overlay):
                volumes = {v["name"]: v for v in self.pod_spec(overlay)["volumes"]}
                shm = [m for m in container["volumeMounts"]
                       if m["mountPath"] == "/dev/shm"]
                self.assertEqual(len(shm), 1)
                empty_dir = volumes[shm[0]["name"]]["emptyDir"]
                self.assertEqual(empty_dir["medium"], "Memory")
                self.assertIn("sizeLimit", empty_dir)
                self.assertTrue(container["image"].endswith("-cuda"))
        self.assertEqual(gpu_overlays, ["lws-cuda"])

    def test_tls_and_auth_secrets_are_wired_to_flags(self):
        for overlay in filter(self.uses_tls, OVERLAYS):
            with self.subTest(overlay=overlay):
                container = self.container(overlay)
                flags = self.parsed_args(overlay)
                mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
                secrets = {v["name"]: v["secret"]["secretName"]
                           for v in self.pod_spec(overlay)["volumes"] if "secret" in v}
                self.assertEqual(secrets, {"tls": "tally-tls",
                                           "auth-tokens": "tally-auth-tokens",
                                           "metrics-auth": "tally-metrics-auth"})
                for flag, volume, key in [("--tls-cert", "tls", "tls.crt"),
                                          ("--tls-key", "tls", "tls.key"),
                                          ("--tls-client-ca", "tls", "ca.crt"),
                                          ("--auth-tokens-file", "auth-tokens",
                                           "tokens"),
                                          ("--metrics-auth-file", "metrics-auth",
                                           "credentials")]:
                    self.assertEqual(flags[flag], f"{mounts[volume]}/{key}")

    def test_tenant_metrics_need_basic_auth(self):
        """tally-server refuses --auth-tokens-file on a non-loopback --host
        without --metrics-auth-file (/metrics labels name every tenant's model
        ids): the credentials file lies in a mounted Secret, and Prometheus
        scrapes with the username and password of that same Secret."""
        tenant_overlays = []
        for overlay in OVERLAYS:
            with self.subTest(overlay=overlay):
                container = self.container(overlay)
                flags = self.parsed_args(overlay)
                monitor = kustomize_lite.find(self.rendered[overlay],
                                              "PodMonitor", "tally")
                endpoints = monitor["spec"]["podMetricsEndpoints"]
                if "--auth-tokens-file" not in flags:
                    for endpoint in endpoints:
                        self.assertNotIn("basicAuth", endpoint)
                    continue
                tenant_overlays.append(overlay)
                names = [a.partition("=")[0] for a in container["args"]]
                self.assertEqual(names.count("--metrics-auth-file"), 1)
                path = flags["--metrics-auth-file"]
                secrets = {v["name"]: v["secret"]
                           for v in self.pod_spec(overlay)["volumes"]
                           if "secret" in v}
                holders = [m for m in container["volumeMounts"]
                           if m["name"] in secrets and path.startswith(
                               m["mountPath"].rstrip("/") + "/")]
                self.assertEqual(len(holders), 1,
                                 f"{path} is not in one mounted Secret volume")
                mount = holders[0]
                self.assertIs(mount.get("readOnly"), True)
                secret = secrets[mount["name"]]
                relative = path[len(mount["mountPath"].rstrip("/")) + 1:]
                # A key of the Secret: directly, or through `items`.
                items = {i["path"]: i["key"] for i in secret.get("items", [])}
                if "items" in secret:
                    self.assertIn(relative, items, path)
                else:
                    self.assertNotIn("/", relative, path)
                for endpoint in endpoints:
                    auth = endpoint.get("basicAuth")
                    self.assertIsNotNone(auth, "PodMonitor scrapes without "
                                         "basicAuth: every scrape gets 401")
                    self.assertEqual(set(auth), {"username", "password"})
                    for part in ("username", "password"):
                        self.assertEqual(auth[part]["name"],
                                         secret["secretName"], part)
                        if "items" in secret:
                            self.assertIn(auth[part]["key"], items.values(), part)
                        self.assertTrue(auth[part]["key"], part)
                    self.assertNotEqual(auth["username"]["key"],
                                        auth["password"]["key"])
        self.assertIn("lws-production", tenant_overlays)


class AlertRuleTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        with open(os.path.join(MONITORING_DIR, "prometheusrule.yaml"),
                  encoding="utf-8") as f:
            cls.rules = yaml.safe_load(f)["spec"]
        cls.alerts = {r["alert"]: r for g in cls.rules["groups"] for r in g["rules"]}

    def test_alert_rules_pass_promtool(self):
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "rules.yml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(self.rules, f)
            shutil.copy(os.path.join(SOURCE_DIR, "tests", "deploy", "alerts_test.yml"),
                        tmp)
            for command in (["promtool", "check", "rules", "rules.yml"],
                            ["promtool", "test", "rules", "alerts_test.yml"]):
                result = subprocess.run(command, cwd=tmp, capture_output=True,
                                        text=True, check=False)
                self.assertEqual(result.returncode, 0,
                                 f"{' '.join(command)}:\n{result.stdout}{result.stderr}")
        with open(os.path.join(SOURCE_DIR, "tests", "deploy", "alerts_test.yml"),
                  encoding="utf-8") as f:
            tested = {t["alertname"] for case in yaml.safe_load(f)["tests"]
                      for t in case["alert_rule_test"]}
        self.assertEqual(set(self.alerts), tested, "every alert needs a promtool test")

    def test_alerts_use_metrics_the_server_registers(self):
        with open(os.path.join(SOURCE_DIR, "server", "metrics.cc"),
                  encoding="utf-8") as f:
            registered = set(re.findall(r'"(tally_[a-z_]+)"', f.read()))
        for name, rule in self.alerts.items():
            for metric in re.findall(r"\btally_[a-z_]+", rule["expr"]):
                self.assertIn(re.sub(r"_(bucket|count|sum)$", "", metric),
                              registered, name)

    def test_metrics_doc_quotes_every_alert(self):
        with open(os.path.join(SOURCE_DIR, "docs", "metrics.md"),
                  encoding="utf-8") as f:
            doc = f.read()
        for name, rule in self.alerts.items():
            self.assertIn(f"# {name}", doc)
            self.assertIn(rule["expr"].rstrip("\n"), doc,
                          f"docs/metrics.md: {name}'s expression is stale")

    def test_checkpoint_and_spike_alerts(self):
        stale = self.alerts["TallyCheckpointStale"]["expr"]
        # Client saves, periodic and exit checkpoints all count.
        self.assertIn("tally_checkpoint_last_success_timestamp_seconds", stale)
        self.assertNotIn("SaveCheckpoint", stale)
        # A single spiking step is the clipper's business; a sustained one
        # is an alert.
        self.assertIn("for", self.alerts["TallyGradNormSpike"])


def documented_metrics(markdown):
    """The metrics docs/metrics.md's two tables document.

    Args:
        markdown: the text of docs/metrics.md.

    Returns:
        {name: (labels, per_rank)}: the labels the table names for the metric
        (`rank` and the scrape's `namespace` go without saying) and whether
        every rank exports it ("Rank-level metrics") or rank 0 alone
        ("Request-level metrics").
    """
    metrics = {}
    for section in re.split(r"^## ", markdown, flags=re.M):
        per_rank = section.startswith("Rank-level metrics")
        if not per_rank and not section.startswith("Request-level metrics"):
            continue
        # | name | type | labels | ... or | name | type | unit | labels | ...
        labels_cell = 2 if per_rank else 1
        for name, rest in re.findall(r"^\| `(tally_[a-z0-9_]+)` \|(.*)$", section,
                                     re.M):
            labels = set(re.findall(r"`([a-z_]+)`", rest.split("|")[labels_cell]))
            metrics[name] = (labels, per_rank)
    return metrics


def selectors(expr):
    """The tally metrics `expr` selects, each with its label matchers.

    Args:
        expr: a PromQL expression (Grafana variables left in).

    Returns:
        [(metric name, {label: (operator, value)})], in order of appearance.
    """
    return [(name, {label: (op, value) for label, op, value in re.findall(
        r'([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)"', matchers)})
            for name, matchers in re.findall(
                r"\b(tally_[a-z0-9_]+)(?:\{([^}]*)\})?", expr)]


class DashboardTest(unittest.TestCase):
    """deploy/k8s/base/grafana-dashboard.json against docs/metrics.md.

    The dashboard has `namespace`, `model_id` and `rank` variables and every
    query honours them: `namespace` everywhere, `model_id` wherever the metric
    has that label, `rank` on the per-rank metrics (and not on rank 0's
    request-level ones, which a rank filter would blank); it queries only
    documented metrics, in valid PromQL; its RL panels plot every series of
    the `tally_policy_*` families and its memory admission panels the
    resident bytes, the admission ledger and limits, and the refusals.
    """

    VARIABLES = ("namespace", "model_id", "rank")
    MEMORY_GAUGES = {"tally_rank_parameter_bytes", "tally_rank_gradient_bytes",
                     "tally_rank_optimizer_state_bytes"}

    @classmethod
    def setUpClass(cls):
        with open(os.path.join(K8S_DIR, "base", "grafana-dashboard.json"),
                  encoding="utf-8") as f:
            cls.dashboard = json.load(f)
        with open(os.path.join(SOURCE_DIR, "docs", "metrics.md"),
                  encoding="utf-8") as f:
            cls.doc = f.read()
        cls.documented = documented_metrics(cls.doc)
        cls.variables = {v["name"]: v for v in cls.dashboard["templating"]["list"]}
        cls.panels = cls.dashboard["panels"]

    def metric(self, name):
        """The documented metric `name` is a series of (a histogram's `_bucket`...)."""
        if name not in self.documented:
            name = re.sub(r"_(bucket|count|sum)$", "", name)
        self.assertTrue(name in self.documented, f"{name}: not in docs/metrics.md")
        return name

    def panel_selectors(self, title_prefix=""):
        """(panel title, expr, metric, matchers) of the panels' tally selectors."""
        return [(p["title"], t["expr"], self.metric(name), matchers)
                for p in self.panels if p["title"].startswith(title_prefix)
                for t in p["targets"] for name, matchers in selectors(t["expr"])]

    def test_namespace_model_and_rank_variables(self):
        for name in self.VARIABLES:
            with self.subTest(variable=name):
                variable = self.variables[name]
                self.assertEqual(variable["type"], "query")
                self.assertEqual(variable["label"], name)
                self.assertEqual(variable["datasource"]["uid"], "${datasource}")
                # Several values or all; "All" also matches a series without
                # the label (a Prometheus outside Kubernetes: no namespace).
                self.assertTrue(variable["multi"] and variable["includeAll"])
                self.assertEqual(variable["allValue"], ".*")
                query = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"])
                self.assertIsNotNone(query, variable["query"])
                self.assertEqual(query.group(2), name)
                (metric, matchers), = selectors(query.group(1))
                self.metric(metric)
                if name != "namespace":
                    self.assertEqual(matchers.get("namespace"), ("=~", "$namespace"))
        self.assertIn("model_id", self.documented["tally_model_step"][0])

    def test_every_query_honours_the_variables(self):
        queried = self.panel_selectors()
        self.assertGreater(len({expr for _, expr, _, _ in queried}), 10)
        for title, expr, metric, matchers in queried:
            with self.subTest(panel=title, metric=metric):
                labels, per_rank = self.documented[metric]
                self.assertEqual(matchers.get("namespace"), ("=~", "$namespace"), expr)
                if "model_id" in labels:
                    self.assertEqual(matchers.get("model_id"), ("=~", "$model_id"), expr)
                if per_rank:
                    self.assertEqual(matchers.get("rank"), ("=~", "$rank"), expr)
                else:
                    self.assertNotIn("rank", matchers, f"{expr}: rank 0 only")

    def test_queries_are_valid_promql(self):
        exprs = [t["expr"] for p in self.panels for t in p["targets"]]
        exprs += [re.fullmatch(r"label_values\((.*), \w+\)", self.variables[name]["query"])
                  .group(1) for name in self.VARIABLES]
        # What Grafana sends with every variable at "All".
        rules = {"groups": [{"name": "dashboard", "rules": [
            {"record": f"dashboard:query{i}",
             "expr": re.sub(r"\$(namespace|model_id|rank)\b", ".*", expr)
                     .replace("$__rate_interval", "1m")}
            for i, expr in enumerate(exprs)]}]}
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "dashboard.yml"), "w", encoding="utf-8") as f:
                yaml.safe_dump(rules, f)
            result = subprocess.run(["promtool", "check", "rules", "dashboard.yml"],
                                    cwd=tmp, capture_output=True, text=True,
                                    check=False)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_rl_panels_plot_every_policy_stat(self):
        families = {name for name in self.documented
                    if name.startswith("tally_policy_")}
        self.assertEqual(len(families), 4, families)
        plotted = set()
        for title, expr, metric, matchers in self.panel_selectors("RL:"):
            self.assertIn(metric, families, title)
            # Every statistic of the family: no filter on its label.
            self.assertFalse({"stat", "estimator"} & set(matchers), expr)
            plotted.add(metric)
        self.assertEqual(plotted, families)

    def test_memory_admission_panels(self):
        queried = {metric for _, _, metric, _ in
                   self.panel_selectors("Memory admission:")}
        self.assertTrue(self.MEMORY_GAUGES <= queried)
        self.assertTrue({"tally_memory_admitted_bytes", "tally_memory_limit_bytes",
                         "tally_memory_refusals_total"} <= queried)

    def test_panels_have_distinct_ids_and_do_not_overlap(self):
        self.assertEqual(len({p["id"] for p in self.panels}), len(self.panels))
        for panel in self.panels:
            self.assertLessEqual(panel["gridPos"]["x"] + panel["gridPos"]["w"], 24,
                                 panel["title"])
        for a, b in itertools.combinations(self.panels, 2):
            ga, gb = a["gridPos"], b["gridPos"]
            self.assertTrue(ga["x"] + ga["w"] <= gb["x"] or gb["x"] + gb["w"] <= ga["x"]
                            or ga["y"] + ga["h"] <= gb["y"] or gb["y"] + gb["h"] <= ga["y"],
                            f"{a['title']} overlaps {b['title']}")


if __name__ == "__main__":
    unittest.main()
