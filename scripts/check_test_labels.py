#!/usr/bin/env python3
"""Fails when a ctest test of the build has no label.

Every test carries one of the labels `ctest -L` chooses by (unit, golden,
e2e, python, fuzz, deploy, cuda, sanitizer, bench; README.md, "Tests"), so
that a new test is never left out of `make check` or of a label's run by accident.
Reads `ctest --show-only=json-v1`, which lists the tests that
gtest_discover_tests found in the built binaries too.

  python3 scripts/check_test_labels.py --build-dir build
  python3 scripts/check_test_labels.py --json tests.json  # a saved listing

Exit status: 0 when every test has a label, 1 when one has none (each named),
2 for a bad flag or a listing that cannot be read.
"""

import argparse
import json
import subprocess
import sys


def read_listing(args):
    """The json-v1 listing: from --json, or from ctest in --build-dir."""
    if args.json:
        with open(args.json, encoding="utf-8") as listing:
            return json.load(listing)
    result = subprocess.run(
        [args.ctest, "--show-only=json-v1"], cwd=args.build_dir,
        capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise ValueError(f"{args.ctest} --show-only=json-v1 in "
                         f"{args.build_dir} failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


def unlabeled_tests(listing):
    """Names of the tests in `listing` whose LABELS property is empty."""
    unlabeled = []
    for test in listing.get("tests", []):
        labels = []
        for prop in test.get("properties", []):
            if prop.get("name") == "LABELS":
                labels = prop.get("value") or []
        if not labels:
            unlabeled.append(test.get("name", "<unnamed>"))
    return unlabeled


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build-dir", default=".",
                        help="the CMake build directory (default: .)")
    parser.add_argument("--ctest", default="ctest",
                        help="the ctest executable (default: ctest)")
    parser.add_argument("--json", help="a saved --show-only=json-v1 listing")
    args = parser.parse_args()
    try:
        listing = read_listing(args)
    except (OSError, ValueError) as error:
        print(f"check_test_labels: {error}", file=sys.stderr)
        return 2
    unlabeled = unlabeled_tests(listing)
    count = len(listing.get("tests", []))
    if not unlabeled:
        print(f"check_test_labels: all {count} tests have a label")
        return 0
    for name in unlabeled:
        hint = (" (its binary is not built)" if name.endswith("_NOT_BUILT")
                else "")
        print(f"unlabeled test: {name}{hint}", file=sys.stderr)
    print(f"check_test_labels: {len(unlabeled)} of {count} tests have no "
          "label; give them one (LABELS, or tally_test(... LABEL ...))",
          file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
