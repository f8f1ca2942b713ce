"""client/python installs as a package whose stubs are generated from proto/
at build time: `pip install` (no network, no build isolation) of a copy of
the package into a temporary target, then the installed client must import
and its generated stubs must describe the API in proto/tally/v1/trainer.proto.

The generator is Debian's protoc and grpc_python_plugin, or, with neither on
PATH, the grpc_tools module (pip's grpcio-tools; a stand-in here, as PyPI is
out of reach); with no generator at all, or no proto/, the build fails with a
message saying what to install or set.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ["TALLY_SOURCE_DIR"]

# `python -m grpc_tools.protoc ARGS` as grpcio-tools has it: protoc ARGS with
# the gRPC plugin built in.
FAKE_GRPC_TOOLS = """\
import subprocess
import sys

if __name__ == "__main__":
    sys.exit(subprocess.call(
        [{protoc!r}, "--plugin=protoc-gen-grpc_python={plugin}"] + sys.argv[1:]))
"""


class PythonPackageTest(unittest.TestCase):

    def setUp(self):
        temp = tempfile.TemporaryDirectory(prefix="tally_pkg_")
        self.addCleanup(temp.cleanup)
        self.temp = temp.name
        # client/python as in a checkout, but with no ../../proto beside it.
        self.package = os.path.join(self.temp, "client", "python")
        shutil.copytree(os.path.join(SOURCE_DIR, "client", "python"), self.package,
                        ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                      "__pycache__"))
        self.target = os.path.join(self.temp, "site")
        # A PATH with neither protoc nor grpc_python_plugin.
        self.bare_path = os.path.join(self.temp, "bin")
        os.mkdir(self.bare_path)

    def pip_install(self, **env):
        """pip-installs the package copy into self.target.

        Args:
            **env: variables to set for pip (and setup.py) on top of this
                process's environment, less PYTHONPATH and the variables
                setup.py reads.

        Returns:
            The completed pip process, its output captured.
        """
        base = {name: value for name, value in os.environ.items()
                if name not in ("PYTHONPATH", "TALLY_PROTO_ROOT", "PROTOC",
                                "GRPC_PYTHON_PLUGIN")}
        base.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
        return subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps",
             "--no-build-isolation", "--target", self.target, self.package],
            env=dict(base, **env), capture_output=True, text=True, check=False)

    def assert_installed_stubs_match_the_proto(self):
        """The installed client imports and its stubs have proto/'s RPCs."""
        with open(os.path.join(SOURCE_DIR, "proto", "tally", "v1",
                               "trainer.proto"), encoding="utf-8") as f:
            rpcs = sorted(re.findall(r"^\s*rpc (\w+)\(", f.read(), re.M))
        probe = subprocess.run(
            [sys.executable, "-c",
             "import tally_client\n"
             "from tally_client._proto.tally.v1 import trainer_pb2 as pb\n"
             "print(' '.join(sorted(m.name for m in "
             "pb.DESCRIPTOR.services_by_name['Trainer'].methods)))\n"
             "print(tally_client.TrainingClient.__module__)"],
            env={"PYTHONPATH": self.target, "PATH": os.environ["PATH"]},
            cwd=self.temp, capture_output=True, text=True, check=False)
        self.assertEqual(probe.returncode, 0, probe.stderr)
        methods, module = probe.stdout.splitlines()
        self.assertEqual(methods.split(), rpcs)
        self.assertEqual(module, "tally_client.client")

    def test_pip_install_generates_the_stubs(self):
        result = self.pip_install(TALLY_PROTO_ROOT=os.path.join(SOURCE_DIR, "proto"))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assert_installed_stubs_match_the_proto()

    def test_grpc_tools_replaces_a_system_protoc(self):
        fake = os.path.join(self.temp, "fake_grpc_tools")
        os.makedirs(os.path.join(fake, "grpc_tools"))
        open(os.path.join(fake, "grpc_tools", "__init__.py"), "w",
             encoding="utf-8").close()
        with open(os.path.join(fake, "grpc_tools", "protoc.py"), "w",
                  encoding="utf-8") as f:
            f.write(FAKE_GRPC_TOOLS.format(protoc=shutil.which("protoc"),
                                           plugin=shutil.which("grpc_python_plugin")))
        result = self.pip_install(TALLY_PROTO_ROOT=os.path.join(SOURCE_DIR, "proto"),
                                  PATH=self.bare_path, PYTHONPATH=fake)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assert_installed_stubs_match_the_proto()

    def test_without_a_generator_the_build_says_what_to_install(self):
        if importlib.util.find_spec("grpc_tools") is not None:
            self.skipTest("grpcio-tools is installed: a generator is always found")
        result = self.pip_install(TALLY_PROTO_ROOT=os.path.join(SOURCE_DIR, "proto"),
                                  PATH=self.bare_path)
        self.assertNotEqual(result.returncode, 0)
        output = result.stdout + result.stderr
        for advice in ("pip install grpcio-tools", "--no-build-isolation",
                       "protobuf-compiler protobuf-compiler-grpc",
                       "Missing: protoc, grpc_python_plugin, the grpc_tools module"):
            self.assertIn(advice, output)
        self.assertFalse(os.path.exists(os.path.join(self.target, "tally_client")))

    def test_without_proto_the_build_names_tally_proto_root(self):
        result = self.pip_install()
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("TALLY_PROTO_ROOT", result.stdout + result.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.target, "tally_client")))


if __name__ == "__main__":
    unittest.main()
