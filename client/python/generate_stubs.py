"""Generates tally_client's protobuf and gRPC modules (with .pyi stubs) from
proto/: the one generator of both setup.py (the wheel, `pip install`) and
CMake (build/python_stubs, which the tests put on PYTHONPATH).

The modules live inside the client package, as tally_client._proto.tally.v1
(trainer.proto) and tally_client._proto.tally.rpc (google.rpc's status and
error details: a `google` package would shadow protobuf's), so that nothing
installs as a top-level `tally` package. protoc derives a module's name, and
the imports between generated modules, from the .proto file's path relative
to --proto_path, so the protos are copied into a temporary tree under that
path first; their package names (tally.v1, google.rpc) stay as they are.

    python3 generate_stubs.py --protoc /usr/bin/protoc \\
        --grpc-python-plugin /usr/bin/grpc_python_plugin \\
        --proto-root proto --out build/python_stubs
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Sequence

# The package the generated modules belong to, as a path.
PROTO_PACKAGE = os.path.join("tally_client", "_proto")
# (source under the proto root, path under PROTO_PACKAGE, has a service)
PROTOS = (
    ("tally/v1/trainer.proto", "tally/v1/trainer.proto", True),
    ("google/rpc/status.proto", "tally/rpc/status.proto", False),
    ("google/rpc/error_details.proto", "tally/rpc/error_details.proto", False),
)
# Packages that hold only generated modules and need an __init__.py.
PACKAGES = ("", "tally", "tally/v1", "tally/rpc")


class GenerateError(Exception):
    """A proto is missing or protoc failed; the message says which."""


def _run(command: Sequence[str]) -> None:
    """Runs protoc's command line `command`; raises GenerateError naming it
    when it cannot start or fails."""
    try:
        failed = subprocess.run(list(command), check=False).returncode != 0
    except OSError as error:
        raise GenerateError(f"{command[0]}: {error}") from error
    if failed:
        raise GenerateError(f"generating the Python stubs failed: "
                            f"{' '.join(command)}")


def generate(protoc: Sequence[str], proto_root: str, out: str) -> None:
    """Writes the modules, their .pyi stubs and the packages' __init__.py
    files under `out`/tally_client/_proto (never tally_client/__init__.py).

    Args:
        protoc: the protoc command line that can also write gRPC stubs (the
            program and the options that make --grpc_python_out work).
        proto_root: the directory holding tally/v1/trainer.proto.
        out: the directory the tally_client package tree goes into.

    Raises:
        GenerateError: a proto is missing or protoc failed.
    """
    with tempfile.TemporaryDirectory(prefix="tally_protos_") as stage:
        staged, services = [], []
        for source, target, has_service in PROTOS:
            source_path = os.path.join(proto_root, source)
            if not os.path.isfile(source_path):
                raise GenerateError(f"{source_path} not found")
            relative = os.path.join(PROTO_PACKAGE, target)
            os.makedirs(os.path.dirname(os.path.join(stage, relative)),
                        exist_ok=True)
            shutil.copyfile(source_path, os.path.join(stage, relative))
            staged.append(relative)
            if has_service:
                services.append(relative)
        os.makedirs(out, exist_ok=True)
        common = list(protoc) + [f"--proto_path={stage}"]
        _run(common + [f"--python_out={out}", f"--pyi_out={out}"] + staged)
        _run(common + [f"--grpc_python_out={out}"] + services)
    for package in PACKAGES:
        init = os.path.join(out, PROTO_PACKAGE, package, "__init__.py")
        if not os.path.exists(init):
            with open(init, "w", encoding="utf-8"):
                pass


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--protoc", required=True, help="protoc's path")
    parser.add_argument("--grpc-python-plugin", required=True,
                        help="grpc_python_plugin's path")
    parser.add_argument("--proto-root", required=True,
                        help="the directory holding tally/v1/trainer.proto")
    parser.add_argument("--out", required=True,
                        help="where the tally_client/_proto tree goes")
    args = parser.parse_args(argv)
    protoc = [args.protoc,
              f"--plugin=protoc-gen-grpc_python={args.grpc_python_plugin}"]
    try:
        generate(protoc, args.proto_root, args.out)
    except GenerateError as error:
        print(f"generate_stubs: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
