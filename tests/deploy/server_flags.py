"""What tally-server's command line accepts, for the deploy tests.

From `tally-server --help` when the binary is built (TALLY_SERVER, or
build/server/tally-server in the source tree); otherwise from the flag table
(Sections()) in server/flags.cc and the defaults in server/server.h, which the
flags quote, so the manifests and the documented commands are checked before
the build finishes.

    flags = server_flags.load()
    flags.names                     # {"--host", "--grpc-port", ...}
    flags.parse(["--host", "0.0.0.0", "--demo-model"])
        # {"--host": "0.0.0.0", "--demo-model": "true"}
    flags.defaults["--grpc-port"]   # "50051"
"""

import os
import re
import subprocess

SOURCE_DIR = os.environ.get("TALLY_SOURCE_DIR") or os.path.abspath(
    os.path.join(os.path.dirname(__file__), "..", ".."))


def server_binary():
    """The tally-server to run, or None when it is not built yet."""
    path = os.environ.get("TALLY_SERVER") or os.path.join(
        SOURCE_DIR, "build", "server", "tally-server")
    return path if os.access(path, os.X_OK) else None


class ServerFlags:
    """names: every --flag; valued: the flags that take a value (the others
    are booleans); defaults: {--flag: default} for the flags whose default
    the source states; source: where this came from."""

    def __init__(self, names, valued, defaults, source):
        self.names = frozenset(names)
        self.valued = frozenset(valued)
        self.defaults = dict(defaults)
        self.source = source

    def parse(self, args):
        """{--flag: value} as ParseServerFlags reads `args`: `--flag=value`,
        `--flag value` for valued flags, bare booleans as "true". Raises
        ValueError on what the server would refuse by name."""
        parsed = {}
        position = 0
        while position < len(args):
            arg = args[position]
            position += 1
            if not arg.startswith("--"):
                raise ValueError(f"unexpected argument {arg!r}")
            name, has_value, value = arg.partition("=")
            if name not in self.names:
                raise ValueError(f"unknown flag {name}")
            if not has_value:
                if name not in self.valued:
                    value = "true"
                elif position < len(args):
                    value = args[position]
                    position += 1
                else:
                    raise ValueError(f"{name} needs a value")
            parsed[name] = value
        return parsed


def load():
    binary = server_binary()
    if binary:
        return from_help(subprocess.run([binary, "--help"], check=True,
                                        capture_output=True, text=True).stdout,
                         f"{binary} --help")
    with open(os.path.join(SOURCE_DIR, "server", "flags.cc"),
              encoding="utf-8") as f:
        flags_cc = f.read()
    with open(os.path.join(SOURCE_DIR, "server", "server.h"),
              encoding="utf-8") as f:
        server_h = f.read()
    return from_source(flags_cc, server_h)


def from_help(text, source):
    """Flag lines are `  --name VALUE  help` (VALUE absent for booleans), the
    help wrapped onto lines indented further and ending in `(default: X)`;
    `none` there means no default value."""
    names, valued, defaults = set(), set(), {}
    flag = None
    for line in text.splitlines():
        match = re.match(r"  (--[a-z0-9-]+)(?: ([A-Z]+))?", line)
        if match:
            flag = match.group(1)
            names.add(flag)
            if match.group(2):
                valued.add(flag)
        elif not line.startswith(" "):
            flag = None  # a section title or the text before the flags
        default = re.search(r"\(default: ([^)]*)\)", line)
        if flag and default and default.group(1) != "none":
            defaults[flag] = default.group(1)
    # Handled before the flag table (server/flags.cc), so not in it.
    names.difference_update({"--help", "--version"})
    return ServerFlags(names, valued, defaults, source)


def from_source(flags_cc, server_h):
    """The flag table's {"name", "VALUE" or nullptr} entries (Sections() in
    server/flags.cc), and the ServerOptions member initializers with literal
    values (`int grpc_port = 50051;`)."""
    names, valued = set(), set()
    for name, value_name in re.findall(
            r'\{"([a-z][a-z0-9-]*)",\s*(nullptr|"[A-Z]+")', flags_cc):
        names.add(f"--{name}")
        if value_name != "nullptr":
            valued.add(f"--{name}")
    defaults = {}
    for member, value in re.findall(r'^\s+[\w:<>]+ (\w+) = ("[^"]*"|[-0-9.]+);',
                                    server_h, re.M):
        flag = "--" + member.replace("_", "-")
        if flag in names:
            defaults[flag] = value.strip().strip('"')
    return ServerFlags(names, valued, defaults,
                       "server/flags.cc and server/server.h (no binary)")
