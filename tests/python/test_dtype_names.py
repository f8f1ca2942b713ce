"""The Python client's dtype spellings are the C++ table's.

tally_client/dtypes.py keeps its own copy of the spellings tallyctl reads
from base/dtype_names.h. tallyctl lists the C++ table's spellings when
`export --dtype` gets an unknown one ("float32 (fp32), ... or float16
(fp16)"); this test reads that list and compares it, both ways, with what
parse_dtype accepts.
"""

import re
import subprocess
import unittest

from tally_client import dtypes
from tally_testing import pb, required_env


def cpp_spellings():
    """{name: short name} as tallyctl's --dtype error lists them."""
    result = subprocess.run(
        [required_env("TALLY_CTL"), "export", "model", "/nonexistent",
         "--target", "127.0.0.1:1", "--dtype", "no-such-dtype"],
        capture_output=True, text=True, timeout=60, check=False)
    if result.returncode != 2:
        raise AssertionError(f"expected exit 2, got {result.returncode}: "
                             f"{result.stderr}")
    pairs = re.findall(r"(\w+) \((\w+)\)", result.stderr)
    if not pairs:
        raise AssertionError(f"no spellings in: {result.stderr}")
    return dict(pairs)


class DTypeNamesTest(unittest.TestCase):

    def test_python_accepts_every_cpp_spelling(self):
        for name, short in cpp_spellings().items():
            expected = pb.DType.Value("DTYPE_" + name.upper())
            for spelling in (name, short, name.upper(), short.upper()):
                self.assertEqual(dtypes.parse_dtype(spelling), expected,
                                 spelling)

    def test_python_has_no_spelling_the_cpp_table_lacks(self):
        table = cpp_spellings()
        cpp = set(table) | set(table.values())
        # pylint: disable-next=protected-access
        self.assertEqual(set(dtypes._SHORT_NAMES), cpp)


if __name__ == "__main__":
    unittest.main()
