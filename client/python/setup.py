"""Generates the tally.v1 gRPC stubs (and google.rpc's error details, as
tally.rpc) from ../../proto at build time.

protoc and grpc_python_plugin come from Debian's protobuf-compiler and
protobuf-compiler-grpc (or set PROTOC / GRPC_PYTHON_PLUGIN); the stubs are
written into the build tree as the `tally.v1` package, never into the source.
"""

import os
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
PROTO_ROOT = os.environ.get("TALLY_PROTO_ROOT",
                            os.path.join(HERE, "..", "..", "proto"))
PROTOS = ["tally/v1/trainer.proto"]
# Generated as tally.rpc: a `google` package would shadow protobuf's.
RPC_PROTOS = ["rpc/status.proto", "rpc/error_details.proto"]


def _tool(variable, name):
    path = os.environ.get(variable) or shutil.which(name)
    if not path:
        raise RuntimeError(f"{name} not found: install it or set {variable}")
    return path


class BuildWithStubs(build_py):
    """build_py that also writes tally/v1/*_pb2*.py into build_lib."""

    def run(self):
        super().run()
        out = self.build_lib
        os.makedirs(os.path.join(out, "tally", "v1"), exist_ok=True)
        subprocess.run(
            [_tool("PROTOC", "protoc"), f"--proto_path={PROTO_ROOT}",
             f"--python_out={out}", f"--grpc_python_out={out}",
             f"--plugin=protoc-gen-grpc_python="
             f"{_tool('GRPC_PYTHON_PLUGIN', 'grpc_python_plugin')}"]
            + [os.path.join(PROTO_ROOT, p) for p in PROTOS], check=True)
        google = os.path.join(PROTO_ROOT, "google")
        subprocess.run(
            [_tool("PROTOC", "protoc"), f"--proto_path={google}",
             f"--python_out={os.path.join(out, 'tally')}"]
            + [os.path.join(google, p) for p in RPC_PROTOS], check=True)
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
