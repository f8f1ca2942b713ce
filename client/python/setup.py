"""Generates the tally.v1 gRPC stubs (and google.rpc's error details, as
tally.rpc) from ../../proto at build time.

The stubs are written into the build tree as the `tally` package, never into
the source, so an installed client always matches the proto/ it was built
from. Set TALLY_PROTO_ROOT when building a copy of this directory that has no
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
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.errors import ExecError, FileError, PlatformError

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.path.normpath(os.environ.get(
    "TALLY_PROTO_ROOT", os.path.join(HERE, "..", "..", "proto")))
PROTOS = ["tally/v1/trainer.proto"]
# Generated as tally.rpc: a `google` package would shadow protobuf's.
RPC_PROTOS = ["rpc/status.proto", "rpc/error_details.proto"]

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


def run_protoc(command):
    """Runs a generator command line.

    Args:
        command: the program and its arguments.

    Raises:
        ExecError: the generator failed; the message holds the command.
    """
    try:
        failed = subprocess.run(command, check=False).returncode != 0
    except OSError as error:
        raise ExecError(f"{command[0]}: {error}") from error
    if failed:
        raise ExecError(f"generating the gRPC stubs failed: {' '.join(command)}")


class BuildWithStubs(build_py):
    """build_py that also writes tally/v1/*_pb2*.py into build_lib."""

    def run(self):
        if not os.path.isfile(os.path.join(PROTO_ROOT, PROTOS[0])):
            raise FileError(
                f"{os.path.join(PROTO_ROOT, PROTOS[0])} not found: build from "
                "a tally checkout (client/python beside proto/), or set "
                "TALLY_PROTO_ROOT to its proto/ directory")
        protoc = protoc_command()
        super().run()
        out = self.build_lib
        os.makedirs(os.path.join(out, "tally", "v1"), exist_ok=True)
        run_protoc(protoc + [f"--proto_path={PROTO_ROOT}", f"--python_out={out}",
                             f"--grpc_python_out={out}"]
                   + [os.path.join(PROTO_ROOT, p) for p in PROTOS])
        google = os.path.join(PROTO_ROOT, "google")
        run_protoc(protoc + [f"--proto_path={google}",
                             f"--python_out={os.path.join(out, 'tally')}"]
                   + [os.path.join(google, p) for p in RPC_PROTOS])
        for package in ("tally", os.path.join("tally", "v1"),
                        os.path.join("tally", "rpc")):
            init = os.path.join(out, package, "__init__.py")
            if not os.path.exists(init):
                open(init, "w", encoding="utf-8").close()

    def find_package_modules(self, package, package_dir):
        # tally/ and tally/v1/ exist only in the build tree.
        if package.startswith("tally") and not package.startswith("tally_"):
            return []
        return super().find_package_modules(package, package_dir)

    def check_package(self, package, package_dir):
        if package.startswith("tally") and not package.startswith("tally_"):
            return None
        return super().check_package(package, package_dir)


setup(cmdclass={"build_py": BuildWithStubs})
