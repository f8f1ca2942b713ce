"""A 4-rank tally world spread over two network namespaces ("hosts").

Two namespaces joined by a veth pair (iproute2) stand for two machines:
ranks 0 and 1 run in the first, ranks 2 and 3 in the second, each started
like a Kubernetes pod would be (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
GLOO_SOCKET_IFNAME), with MASTER_ADDR the first namespace's veth address, so
the rendezvous and every collective cross the link. A client inside the first
namespace trains a tiny Llama for a few steps; the grad norms and losses must
equal those of a single-rank server trained on the same data.

Skipped, with the reason printed, where network namespaces cannot be created
(not root, no CAP_NET_ADMIN, no iproute2).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest

from tally_testing import TINY_LLAMA, TallyServer, read_json, required_env

WORLD = 4
MESH = ["--dp-shard", "2", "--tp", "2"]
STEPS = 3
SUBNET = "10.213.77"
MASTER_PORT = 29613

# Runs inside a namespace (or not): trains and prints one JSON line per step.
CLIENT_SCRIPT = r"""
import json, sys
from tally_client import TrainingClient, sample, wait_for_serving
target, config, steps = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
wait_for_serving(target, timeout=60)
client = TrainingClient(target, "tiny")
client.create_model(config=config, seed=5, default_max_grad_norm=1.0)
vocab = config["vocab_size"]
for s in range(steps):
    calls = []
    for c in range(3):
        text = [(s * 5 + c * 17 + t * t) % vocab for t in range(6 + 4 * c + s)]
        calls.append(client.forward_backward([sample(text[:-1], text[1:])]))
    step = client.optim_step(adam={"learning_rate": 1e-2}).result()
    print(json.dumps({"grad_norm": step.grad_norm,
                      "losses": [f.result().loss_mean for f in calls]}), flush=True)
"""


def run(*args):
    return subprocess.run(list(args), capture_output=True, text=True, check=False)


class Namespaces:
    """Two namespaces a and b joined by veth pair (a: .1, b: .2)."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}"
        self.names = [f"tally-a-{tag}", f"tally-b-{tag}"]
        self.devices = [f"tva{tag}", f"tvb{tag}"]
        self.addresses = [f"{SUBNET}.1", f"{SUBNET}.2"]
        self.created = []

    def create(self):
        """None on success, else why namespaces cannot be made here."""
        if shutil.which("ip") is None:
            return "iproute2's `ip` is not installed"
        if os.geteuid() != 0:
            return "not root: creating network namespaces needs CAP_NET_ADMIN"
        for name in self.names:
            result = run("ip", "netns", "add", name)
            if result.returncode != 0:
                return f"`ip netns add` failed: {result.stderr.strip()}"
            self.created.append(name)
        steps = [
            ["ip", "link", "add", self.devices[0], "type", "veth",
             "peer", "name", self.devices[1]],
        ]
        for name, device, address in zip(self.names, self.devices, self.addresses):
            steps += [["ip", "link", "set", device, "netns", name],
                      ["ip", "-n", name, "addr", "add", f"{address}/24", "dev", device],
                      ["ip", "-n", name, "link", "set", device, "up"],
                      ["ip", "-n", name, "link", "set", "lo", "up"]]
        for step in steps:
            result = run(*step)
            if result.returncode != 0:
                return f"`{' '.join(step)}` failed: {result.stderr.strip()}"
        return None

    def delete(self):
        for name in self.created:  # deleting a namespace removes its veth end
            run("ip", "netns", "delete", name)


class MultiHostRendezvousTest(unittest.TestCase):

    def setUp(self):
        self.namespaces = Namespaces()
        self.addCleanup(self.namespaces.delete)
        reason = self.namespaces.create()
        if reason:
            print(f"\nSKIPPED multi-host rendezvous: {reason}", file=sys.stderr)
            self.skipTest(reason)
        self.temp = tempfile.mkdtemp(prefix="tally_netns_")
        self.addCleanup(shutil.rmtree, self.temp, True)
        self.processes = []

    def start_rank(self, rank):
        host = rank * 2 // WORLD  # ranks 0, 1 -> namespace a; 2, 3 -> b
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(WORLD),
                   MASTER_ADDR=self.namespaces.addresses[0],
                   MASTER_PORT=str(MASTER_PORT),
                   GLOO_SOCKET_IFNAME=self.namespaces.devices[host])
        log = open(os.path.join(self.temp, f"rank{rank}.log"), "wb")
        self.addCleanup(log.close)
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces.names[host],
             required_env("TALLY_SERVER"), "--grpc-port", "0", "--metrics-port", "0",
             "--port-file", os.path.join(self.temp, "ports.json"),
             "--rendezvous-timeout-secs", "60"] + MESH,
            env=env, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        self.addCleanup(lambda: process.poll() is None and process.kill())

    def logs(self):
        text = ""
        for rank in range(WORLD):
            with open(os.path.join(self.temp, f"rank{rank}.log"), "rb") as f:
                text += f"--- rank {rank}\n" + f.read()[-2000:].decode("utf-8", "replace")
        return text

    def train(self, namespace, target):
        prefix = ["ip", "netns", "exec", namespace] if namespace else []
        result = subprocess.run(
            prefix + [sys.executable, "-c", CLIENT_SCRIPT, target,
                      json.dumps(TINY_LLAMA), str(STEPS)],
            capture_output=True, text=True, timeout=120, check=False)
        self.assertEqual(result.returncode, 0, result.stderr + "\n" + (
            self.logs() if namespace else ""))
        return [json.loads(line) for line in result.stdout.splitlines()]

    def test_four_ranks_on_two_hosts_train_like_one_rank(self):
        for rank in range(WORLD):
            self.start_rank(rank)
        port_file = os.path.join(self.temp, "ports.json")
        deadline = time.monotonic() + 90
        while not os.path.exists(port_file):
            for rank, process in enumerate(self.processes):
                if process.poll() is not None:
                    self.fail(f"rank {rank} exited with {process.returncode}:\n"
                              f"{self.logs()}")
            if time.monotonic() > deadline:
                self.fail(f"no rank 0 port file after 90 s:\n{self.logs()}")
            time.sleep(0.1)
        grpc_port = read_json(port_file)["grpc_port"]
        distributed = self.train(self.namespaces.names[0],
                                 f"127.0.0.1:{grpc_port}")

        reference_server = TallyServer(os.path.join(self.temp, "reference"))
        self.addCleanup(reference_server.kill)
        reference = self.train(None, f"localhost:{reference_server.grpc_port}")
        self.assertEqual(reference_server.terminate(), 0)

        self.assertEqual(len(distributed), STEPS)
        for got, want in zip(distributed, reference):
            self.assertAlmostEqual(got["grad_norm"], want["grad_norm"],
                                   delta=1e-5 * want["grad_norm"])
            for got_loss, want_loss in zip(got["losses"], want["losses"]):
                self.assertAlmostEqual(got_loss, want_loss, delta=1e-5 * want_loss)
        # Rank 0 stops the world on SIGTERM; every rank exits 0.
        self.processes[0].terminate()
        for rank, process in enumerate(self.processes):
            self.assertEqual(process.wait(timeout=60), 0,
                             f"rank {rank}:\n{self.logs()}")


if __name__ == "__main__":
    unittest.main()
