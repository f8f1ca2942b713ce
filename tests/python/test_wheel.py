"""The wheel `make` builds (build/dist/tally_client-*.whl) installs offline:
`pip install` of it into a fresh venv made with --system-site-packages (the
interpreter's grpcio and protobuf, Debian's), with pip's index switched off,
then the installed package imports from the venv, holds its generated
modules, stubs and py.typed, installs no top-level `tally` package, and
makes a call whose failure comes back as its status code's class."""

import glob
import os
import socket
import subprocess
import sys
import tempfile
import unittest
import zipfile


# Run by the venv's python: a call to a port where nothing listens fails
# UNAVAILABLE, raised as UnavailableError.
PROBE = """\
import importlib.util, os, sys
import tally_client
from tally_client import RetryPolicy, ServerClient, UnavailableError, pb
print(os.path.dirname(tally_client.__file__))
print(importlib.util.find_spec("tally") is None)
print(tally_client.parse_dtype("bf16") == pb.DTYPE_BFLOAT16)
server = ServerClient(sys.argv[1], timeout=30,
                      retry=RetryPolicy(max_attempts=1))
try:
    server.server_info()
except UnavailableError as error:
    print(type(error).__name__, error.method)
"""


def venv_missing_reason():
    """Why no venv can be made (python3-venv missing), or None."""
    # pylint: disable=import-outside-toplevel,unused-import
    try:
        import ensurepip
        import venv
    except ImportError as error:
        return (f"{error}: install Debian's python3-venv to test the wheel's "
                f"install")
    return None


class WheelTest(unittest.TestCase):

    def setUp(self):
        # Set by tests/CMakeLists.txt: empty when the build makes no wheel.
        wheel_dir = os.environ.get("TALLY_PYTHON_WHEEL_DIR")
        if wheel_dir is None:
            raise RuntimeError("TALLY_PYTHON_WHEEL_DIR is not set: run this "
                               "test through ctest")
        if not wheel_dir:
            self.skipTest("the build makes no wheel: its Python lacks pip, "
                          "setuptools or wheel (CMake's configure output "
                          "says which)")
        wheels = glob.glob(os.path.join(wheel_dir, "tally_client-*.whl"))
        self.assertEqual(len(wheels), 1, f"build the wheel first (make): "
                         f"{wheels}")
        self.wheel = wheels[0]
        temp = tempfile.TemporaryDirectory(prefix="tally_wheel_")
        self.addCleanup(temp.cleanup)
        self.temp = temp.name
        # The source tree stays off the path: only the venv's package counts.
        self.env = {name: value for name, value in os.environ.items()
                    if name != "PYTHONPATH"}
        self.env.update(PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")

    def test_the_wheel_holds_the_package_and_its_typing_files_only(self):
        with zipfile.ZipFile(self.wheel) as wheel:
            names = wheel.namelist()
        self.assertEqual(sorted({name.split("/")[0] for name in names}),
                         ["tally_client",
                          os.path.basename(self.wheel).split("-py3")[0]
                          + ".dist-info"])
        proto = "tally_client/_proto/tally/"
        for name in ("tally_client/py.typed", "tally_client/server.py",
                     proto + "v1/trainer_pb2.py", proto + "v1/trainer_pb2.pyi",
                     proto + "v1/trainer_pb2_grpc.py",
                     proto + "rpc/error_details_pb2.pyi",
                     proto + "rpc/status_pb2.pyi"):
            self.assertIn(name, names)

    def test_pip_installs_it_offline_into_a_fresh_venv(self):
        reason = venv_missing_reason()
        if reason:
            self.skipTest(reason)
        venv = os.path.join(self.temp, "venv")
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages",
                        venv], env=self.env, check=True, cwd=self.temp)
        python = os.path.join(venv, "bin", "python")
        install = subprocess.run([python, "-m", "pip", "install", self.wheel],
                                 env=self.env, cwd=self.temp,
                                 capture_output=True, text=True, check=False)
        self.assertEqual(install.returncode, 0, install.stdout + install.stderr)
        # A bound socket that does not listen: connections are refused, and
        # no other process can take the port while the probe runs.
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            probe = subprocess.run(
                [python, "-c", PROBE, f"127.0.0.1:{closed.getsockname()[1]}"],
                env=self.env, cwd=self.temp, capture_output=True, text=True,
                check=False)
        self.assertEqual(probe.returncode, 0, probe.stderr)
        package, no_tally, bf16, error = probe.stdout.splitlines()
        self.assertTrue(package.startswith(venv + os.sep), package)
        self.assertEqual((no_tally, bf16), ("True", "True"))
        self.assertEqual(error, "UnavailableError GetServerInfo")


if __name__ == "__main__":
    unittest.main()
