"""client/python installs as a package whose stubs are generated from proto/
at build time: `pip install` (no network, no build isolation) of a copy of
the package into a temporary target, then the installed client must import
and its generated stubs must describe the API in proto/tally/v1/trainer.proto.
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ["TALLY_SOURCE_DIR"]


class PythonPackageTest(unittest.TestCase):

    def test_pip_install_generates_the_stubs(self):
        with tempfile.TemporaryDirectory(prefix="tally_pkg_") as temp:
            package = os.path.join(temp, "src")
            shutil.copytree(os.path.join(SOURCE_DIR, "client", "python"), package,
                            ignore=shutil.ignore_patterns("build", "*.egg-info",
                                                          "__pycache__"))
            target = os.path.join(temp, "site")
            env = dict(os.environ,
                       TALLY_PROTO_ROOT=os.path.join(SOURCE_DIR, "proto"),
                       PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
            env.pop("PYTHONPATH", None)
            result = subprocess.run(
                [sys.executable, "-m", "pip", "install", "--no-deps",
                 "--no-build-isolation", "--target", target, package],
                env=env, capture_output=True, text=True, check=False)
            self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
            with open(os.path.join(SOURCE_DIR, "proto", "tally", "v1",
                                   "trainer.proto"), encoding="utf-8") as f:
                rpcs = sorted(re.findall(r"^\s*rpc (\w+)\(", f.read(), re.M))
            probe = subprocess.run(
                [sys.executable, "-c",
                 "import tally_client\n"
                 "from tally.v1 import trainer_pb2 as pb\n"
                 "print(' '.join(sorted(m.name for m in "
                 "pb.DESCRIPTOR.services_by_name['Trainer'].methods)))\n"
                 "print(tally_client.TrainingClient.__module__)"],
                env={"PYTHONPATH": target, "PATH": os.environ["PATH"]},
                cwd=temp, capture_output=True, text=True, check=False)
            self.assertEqual(probe.returncode, 0, probe.stderr)
            methods, module = probe.stdout.splitlines()
            self.assertEqual(methods.split(), rpcs)
            self.assertEqual(module, "tally_client.client")


if __name__ == "__main__":
    unittest.main()
