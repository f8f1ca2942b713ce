"""Generates the tally.v1 gRPC stubs (and google.rpc's error details, as
tally.rpc) from ../../proto at build time, with generate_stubs.py.

The stubs (modules and .pyi) are written into the build tree as the
tally_client._proto package, never into the source, so an installed client
always matches the proto/ it was built from. Set TALLY_PROTO_ROOT when building a copy of this directory that has no
../../proto beside it. The first generator found is used:

1. PROTOC (and GRPC_PYTHON_PLUGIN, else grpc_python_plugin on PATH), when set;
2. the grpc_tools module (pip's grpcio-tools, which bundles protoc and the
   gRPC plugin), when the building Python can import it: no system protoc,
   and its code suits the protobuf and grpcio pip installed beside it;
3. protoc and grpc_python_plugin on PATH (Debian's protobuf-compiler and
   protobuf-compiler-grpc).

Without any, the build stops with a message naming what to install.
"""

import importlib.util
import os
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import ExecError, FileError, PlatformError

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.environ.get(
    "TALLY_PROTO_ROOT", os.path.join(HERE, "..", "..", "proto")))
sys.path.insert(0, HERE)
import generate_stubs  # pylint: disable=wrong-import-position

NO_GENERATOR = """\
tally-client generates its gRPC stubs from proto/ at build time and found no
generator. Install one of:
  - grpcio-tools (bundles protoc; no system protoc needed):
      pip install grpcio-tools setuptools wheel
      pip install --no-build-isolation ./client/python
    (pip's default build isolation hides the grpcio-tools of your environment)
  - Debian/Ubuntu: apt-get install protobuf-compiler protobuf-compiler-grpc
or point PROTOC and GRPC_PYTHON_PLUGIN at protoc and grpc_python_plugin.
Missing: {missing}."""


def protoc_command():
    """The protoc command line that can also write gRPC stubs.

    Returns:
        A list: the program and the options that make `--grpc_python_out`
        work, to which protoc's usual arguments are appended.

    Raises:
        PlatformError: no generator was found; the message names what to
            install.
    """
    protoc = os.environ.get("PROTOC")
    if not protoc and importlib.util.find_spec("grpc_tools") is not None:
        # Adds the well-known types (google/protobuf/*.proto) to the path.
        return [sys.executable, "-m", "grpc_tools.protoc"]
    protoc = protoc or shutil.which("protoc")
    plugin = (os.environ.get("GRPC_PYTHON_PLUGIN")
              or shutil.which("grpc_python_plugin"))
    if protoc and plugin:
        return [protoc, f"--plugin=protoc-gen-grpc_python={plugin}"]
    missing = [name for name, path in (("protoc", protoc),
                                       ("grpc_python_plugin", plugin)) if not path]
    if not os.environ.get("PROTOC"):
        missing.append("the grpc_tools module")
    raise PlatformError(NO_GENERATOR.format(missing=", ".join(missing)))


class BuildWithStubs(build_py):
    """build_py that also writes tally_client/_proto/** into build_lib."""

    def run(self):
        trainer = os.path.join(PROTO_ROOT, generate_stubs.PROTOS[0][0])
        if not os.path.isfile(trainer):
            raise FileError(
                f"{trainer} not found: build from a tally checkout "
                "(client/python beside proto/), or set TALLY_PROTO_ROOT to "
                "its proto/ directory")
        protoc = protoc_command()
        super().run()
        try:
            generate_stubs.generate(protoc, PROTO_ROOT, self.build_lib)
        except generate_stubs.GenerateError as error:
            raise ExecError(str(error)) from error


setup(cmdclass={"build_py": BuildWithStubs})
