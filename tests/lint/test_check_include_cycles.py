"""Tests of scripts/check_include_cycles.py on small trees written here."""

import contextlib
import io
import os
import sys
import tempfile
import unittest

SOURCE_DIR = os.environ.get(
    "TALLY_SOURCE_DIR",
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
        __file__)))))
sys.path.insert(0, os.path.join(SOURCE_DIR, "scripts"))

import check_include_cycles  # noqa: E402


class CheckIncludeCyclesTest(unittest.TestCase):

    def setUp(self):
        directory = tempfile.TemporaryDirectory()
        self.addCleanup(directory.cleanup)
        self.root = directory.name

    def write(self, path, *includes):
        full = os.path.join(self.root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as source:
            for included in includes:
                source.write(f'#include "{included}"\n')
            source.write("#include <vector>\n#include \"absl/status/status.h\"\n")

    def check(self, *dirs, rooms_under=("runtime",)):
        """(exit status, output lines) of the checker over `dirs`."""
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = check_include_cycles.main(
                ["--root", self.root, "--dirs", *dirs,
                 "--rooms-under", *rooms_under])
        return status, out.getvalue().splitlines()

    def test_tree_without_cycle_passes(self):
        # a.cc includes its own header; b includes a, c includes b and a.
        self.write("lib/a.h")
        self.write("lib/a.cc", "lib/a.h")
        self.write("lib/b.h", "lib/a.h")
        self.write("lib/b.cc", "lib/b.h")
        self.write("lib/c.cc", "lib/b.h", "lib/a.h")
        self.assertEqual(self.check("lib"), (0, []))

    def test_cycle_through_a_source_file_fails(self):
        # x.h + x.cc are one node: x.cc -> y.h -> z.h -> x.h closes a cycle.
        self.write("lib/x.h")
        self.write("lib/x.cc", "lib/x.h", "lib/y.h")
        self.write("lib/y.h", "lib/z.h")
        self.write("lib/z.h", "lib/x.h")
        status, lines = self.check("lib")
        self.assertEqual(status, 1)
        self.assertIn("include cycle: lib/x -> lib/y -> lib/z -> lib/x", lines)

    def test_every_cycle_is_printed(self):
        # Two cycles sharing node p, and one between other directories.
        self.write("one/p.h", "one/q.h", "one/r.h")
        self.write("one/q.h", "one/p.h")
        self.write("one/r.h")
        self.write("one/r.cc", "one/r.h", "one/p.h")
        self.write("one/s.h", "two/t.h")
        self.write("two/t.h")
        self.write("two/t.cc", "two/t.h", "one/s.h")
        status, lines = self.check("one", "two")
        self.assertEqual(status, 1)
        cycles = [line for line in lines if line.startswith("include cycle")]
        self.assertEqual(cycles, [
            "include cycle: one/p -> one/q -> one/p",
            "include cycle: one/p -> one/r -> one/p",
            "include cycle: one/s -> two/t -> one/s",
        ])

    def test_relative_include_is_resolved(self):
        self.write("lib/sub/m.h", "../n.h")
        self.write("lib/n.cc", "lib/sub/m.h")
        self.write("lib/n.h")
        status, lines = self.check("lib")
        self.assertEqual(status, 1)
        self.assertIn("include cycle: lib/n -> lib/sub/m -> lib/n", lines)

    def test_headers_outside_the_checked_dirs_are_ignored(self):
        # other/ is not checked, so the cycle through it is not seen.
        self.write("lib/a.cc", "other/b.h")
        self.write("lib/a.h")
        self.write("other/b.h", "lib/a.h")
        self.assertEqual(self.check("lib"), (0, []))

    def write_rooms_both_ways(self):
        """rt/a and rt/b include each other through different files: no
        file cycle, a room cycle."""
        self.write("rt/a/x.h", "rt/b/y.h")
        self.write("rt/b/y.h")
        self.write("rt/b/z.cc", "rt/a/w.h")
        self.write("rt/a/w.h")

    def test_rooms_that_include_each_other_fail(self):
        self.write_rooms_both_ways()
        status, lines = self.check("rt", rooms_under=("rt",))
        self.assertEqual(status, 1)
        self.assertFalse(any(line.startswith("include cycle") for line in lines))
        self.assertIn("room cycle: rt/a -> rt/b -> rt/a (rt/a/x includes "
                      "rt/b/y; rt/b/z includes rt/a/w)", lines)

    def test_rooms_are_the_directories_below_rooms_under(self):
        # Without rooms under rt, rt is one room and nothing circles.
        self.write_rooms_both_ways()
        self.assertEqual(self.check("rt", rooms_under=()), (0, []))

    def test_a_test_may_include_a_higher_room(self):
        # A test is a leaf, not part of its room's library.
        self.write("rt/a/w.h")
        self.write("rt/a/w_test.cc", "rt/a/w.h", "rt/b/y.h")
        self.write("rt/b/y.h", "rt/a/w.h")
        self.assertEqual(self.check("rt", rooms_under=("rt",)), (0, []))

    def test_missing_directory_is_a_usage_error(self):
        with contextlib.redirect_stderr(io.StringIO()) as err:
            with self.assertRaises(SystemExit) as exit_:
                self.check("absent")
        self.assertEqual(exit_.exception.code, 2)
        self.assertIn("--dirs: absent", err.getvalue())


if __name__ == "__main__":
    unittest.main()
