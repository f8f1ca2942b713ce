"""--log-format json on a real 2-rank server, start to SIGTERM.

Every line the launcher and its ranks write parses as one JSON object with
time, level, rank, model, request_id and message (no "[rank r] " prefix);
both ranks and the launcher (rank null) speak, and no process logs the same
message twice (the rank line was once logged twice per rank).
"""

import collections
import json
import re
import unittest

from tally_testing import ServerTestCase

FIELDS = ["time", "level", "rank", "model", "request_id", "message"]


class JsonLogTest(ServerTestCase):

    def test_every_line_is_one_json_object(self):
        connection = self.start_server(
            demo_model=True,
            extra_args=["--log-format", "json", "--nproc-per-node", "2",
                        "--dp-shard", "2"])
        code = connection.server.terminate()
        self.assertEqual(code, 0, connection.server.log_tail())
        with open(connection.server.log_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
        self.assertTrue(lines)
        seen = collections.Counter()
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                self.fail(f"not a JSON line: {line!r}")
            self.assertEqual(list(record), FIELDS, line)
            self.assertRegex(record["time"],
                             r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
            self.assertIn(record["level"], {"debug", "info", "warning", "error"})
            self.assertIn(record["rank"], {None, 0, 1})
            seen[(record["rank"], record["message"])] += 1
        self.assertEqual({rank for rank, _ in seen}, {None, 0, 1})
        self.assertEqual([k for k, n in seen.items() if n > 1], [])
        for rank in (0, 1):
            joined = [m for r, m in seen if r == rank
                      and re.match(rf"rank {rank} of 2 \(", m)]
            self.assertEqual(len(joined), 1, seen)


if __name__ == "__main__":
    unittest.main()
