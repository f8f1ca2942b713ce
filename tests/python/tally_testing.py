"""Shared helpers of tally's Python tests: tally-server processes per test, the
generated gRPC stubs, and a numpy-only safetensors reader.

The tests run under Debian's /usr/bin/python3 with the environment that
tests/CMakeLists.txt sets (TALLY_SERVER, TALLY_SOURCE_DIR, TALLY_PYTHON_STUBS).

    from tally_testing import ServerTestCase, pb, read_safetensors

    class MyTest(ServerTestCase):
        def test_something(self):
            self.start_server(demo_model=True)
            info = self.stub.GetModel(pb.GetModelRequest(model_id="demo"))
            weights = read_safetensors("/some/dir/model.safetensors")

        def test_two_servers(self):
            single = self.start_server(name="single")
            sharded = self.start_server(
                name="sharded",
                extra_args=["--nproc-per-node", "4", "--dp-shard", "2", "--tp", "2"])
            single.stub.CreateModel(...)
            sharded.stub.CreateModel(...)

tearDown stops every server with SIGTERM and fails the test unless each exits 0.
"""

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
import unittest

import numpy as np


def required_env(name):
    """The value of environment variable `name`; fails loudly when unset, so
    a misconfigured run can never pass by skipping."""
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"environment variable {name} is not set; run this test through "
            f"ctest (tests/CMakeLists.txt sets it) or export it yourself")
    return value


def _import_stubs():
    stubs_dir = required_env("TALLY_PYTHON_STUBS")
    if stubs_dir not in sys.path:
        sys.path.insert(0, stubs_dir)
    # pylint: disable-next=import-outside-toplevel
    from tally_client._proto.tally.v1 import trainer_pb2, trainer_pb2_grpc
    return trainer_pb2, trainer_pb2_grpc


pb, pb_grpc = _import_stubs()

_SAFETENSORS_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2",
                       "I64": "<i8", "I32": "<i4"}


def read_safetensors(path):
    """Every tensor of a safetensors file as {name: numpy array}, read with
    struct + json + numpy only (the safetensors package is deliberately not
    used, so the file format is checked independently of tally's writer)."""
    with open(path, "rb") as f:
        data = f.read()
    (header_size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + header_size].decode("utf-8"))
    header.pop("__metadata__", None)
    buffer = data[8 + header_size:]
    tensors = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]])
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * dtype.itemsize:
            raise ValueError(f"{path}: tensor {name} has {end - begin} bytes "
                             f"for shape {info['shape']} of {info['dtype']}")
        tensors[name] = np.frombuffer(buffer[begin:end], dtype=dtype).reshape(
            info["shape"]).copy()
    return tensors


def read_json(path):
    with open(path, "r", encoding="utf-8") as f:
        return json.load(f)


class TallyServer:
    """One tally-server process listening on free ports chosen by the OS."""

    START_TIMEOUT_SECS = 60.0
    STOP_TIMEOUT_SECS = 30.0

    def __init__(self, work_dir, demo_model=False, extra_args=()):
        """`extra_args` go to tally-server after the port flags, e.g.
        ["--nproc-per-node", "4", "--dp-shard", "2", "--tp", "2"]."""
        os.makedirs(work_dir, exist_ok=True)
        self.work_dir = work_dir
        self.log_path = os.path.join(work_dir, "server.log")
        port_file = os.path.join(work_dir, "ports.json")
        args = [required_env("TALLY_SERVER"), "--grpc-port", "0", "--metrics-port", "0",
                "--port-file", port_file]
        if demo_model:
            args.append("--demo-model")
        args.extend(extra_args)
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(args, stdout=self._log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.START_TIMEOUT_SECS
        ports = None
        while ports is None:
            if self.process.poll() is not None:
                self.kill()
                raise RuntimeError(
                    f"tally-server exited with {self.process.returncode} "
                    f"before serving:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"tally-server wrote no port file within "
                    f"{self.START_TIMEOUT_SECS}s:\n{self.log_tail()}")
            try:
                ports = read_json(port_file)
            except (OSError, ValueError):  # absent or half written
                time.sleep(0.05)
        self.grpc_port = int(ports["grpc_port"])
        self.metrics_port = int(ports["metrics_port"])

    def log_tail(self, max_bytes=4000):
        try:
            with open(self.log_path, "rb") as f:
                return f.read()[-max_bytes:].decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def kill(self):
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self._log.close()

    def terminate(self):
        """SIGTERM, then wait; returns the exit code (SIGKILL on timeout)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=self.STOP_TIMEOUT_SECS)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(
                    f"tally-server ignored SIGTERM for "
                    f"{self.STOP_TIMEOUT_SECS}s:\n{self.log_tail()}")
        self._log.close()
        return self.process.returncode


class ServerConnection:
    """A started TallyServer with its channel and Trainer stub."""

    def __init__(self, server, channel, stub):
        self.server = server
        self.channel = channel
        self.stub = stub


class SharedServerTestCase(unittest.TestCase):
    """One tally-server started with SERVER_ARGS for all of a class's tests
    (cls.tally, cls.target, cls.temp); tearDownClass asserts its clean
    SIGTERM exit."""

    SERVER_ARGS = ()
    TEMP_PREFIX = "tally_shared_"

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.temp = tempfile.mkdtemp(prefix=cls.TEMP_PREFIX)
        cls.tally = TallyServer(os.path.join(cls.temp, "server"),
                                extra_args=list(cls.SERVER_ARGS))
        cls.target = f"localhost:{cls.tally.grpc_port}"

    @classmethod
    def tearDownClass(cls):
        code = cls.tally.terminate()
        shutil.rmtree(cls.temp, ignore_errors=True)
        super().tearDownClass()
        if code != 0:
            raise AssertionError(f"tally-server exited with {code}:\n"
                                 f"{cls.tally.log_tail()}")


class ServerTestCase(unittest.TestCase):
    """Gives each test a temp dir and, on start_server(), a tally-server with
    a connected Trainer stub; tearDown asserts a clean SIGTERM exit of every
    server the test started."""

    def setUp(self):
        super().setUp()
        self.temp_dir = tempfile.mkdtemp(prefix="tally_pytest_")
        self.server = None
        self.channel = None
        self.stub = None
        self._connections = []

    def start_server(self, demo_model=False, extra_args=(), name=None):
        """Starts a server in the test's temp dir (its subdirectory `name`
        when given, so that several servers can run side by side) and returns
        its ServerConnection. The first server is also self.server /
        self.channel / self.stub."""
        import grpc  # pylint: disable=import-outside-toplevel
        work_dir = self.temp_dir if name is None else os.path.join(self.temp_dir, name)
        server = TallyServer(work_dir, demo_model=demo_model, extra_args=extra_args)
        # Kills the process even when the test (or tearDown's check) fails.
        self.addCleanup(server.kill)
        channel = grpc.insecure_channel(f"localhost:{server.grpc_port}")
        connection = ServerConnection(server, channel, pb_grpc.TrainerStub(channel))
        self._connections.append(connection)
        grpc.channel_ready_future(channel).result(timeout=30)
        if self.server is None:
            self.server, self.channel, self.stub = server, channel, connection.stub
        return connection

    def tearDown(self):
        try:
            for connection in self._connections:
                connection.channel.close()
            # Every server is stopped before any failure is reported.
            failures = []
            for connection in self._connections:
                code = connection.server.terminate()
                if code != 0:
                    failures.append(f"tally-server exited with {code} on SIGTERM:"
                                    f"\n{connection.server.log_tail()}")
            self.assertFalse(failures, "\n".join(failures))
        finally:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            super().tearDown()


# The tiny Llama (HF LlamaConfig fields) the Python tests train.
TINY_LLAMA = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 64,
}
