"""mypy checks tally_client with its own hints and the generated messages'
.pyi stubs: every function annotated (--disallow-untyped-defs), every call
consistent with them. The generated modules themselves (protoc's and the
gRPC plugin's code) are not checked. Skips, saying so, without mypy
(Debian's `mypy` package)."""

import os
import shutil
import subprocess
import tempfile
import unittest

from tally_testing import required_env

SOURCE_DIR = required_env("TALLY_SOURCE_DIR")
STUBS_DIR = required_env("TALLY_PYTHON_STUBS")

MYPY_CONFIG = """\
[mypy]
disallow_untyped_defs = True
disallow_incomplete_defs = True
check_untyped_defs = True
warn_unused_ignores = True
namespace_packages = True
explicit_package_bases = True
# Installed packages are not read: grpc and protobuf ship no type
# information in Debian 12, and numpy's and torch's take minutes.
no_site_packages = True
ignore_missing_imports = True

[mypy-tally_client._proto.*]
ignore_errors = True
"""


class TypeCheckTest(unittest.TestCase):

    def test_mypy_finds_no_errors(self):
        mypy = shutil.which("mypy")
        if mypy is None:
            self.skipTest("mypy is not installed (Debian: apt-get install mypy)")
        with tempfile.TemporaryDirectory(prefix="tally_mypy_") as temp:
            config = os.path.join(temp, "mypy.ini")
            with open(config, "w", encoding="utf-8") as f:
                f.write(MYPY_CONFIG)
            result = subprocess.run(
                [mypy, "--config-file", config, "--cache-dir",
                 os.path.join(temp, "cache"), "-p", "tally_client"],
                env=dict(os.environ, MYPYPATH=STUBS_DIR),
                cwd=os.path.join(SOURCE_DIR, "client", "python"),
                capture_output=True, text=True, check=False)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("Success: no issues found", result.stdout)


if __name__ == "__main__":
    unittest.main()
