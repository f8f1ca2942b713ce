"""The documented `docker run` commands start a reachable tally-server.

Every `docker run` line of docs/deploy.md, README.md and the Dockerfiles'
headers is parsed: the image enters tally-server (ENTRYPOINT, no CMD that the
arguments would replace unnoticed), every argument is a tally-server flag
(`tally-server --help`, or server/flags.cc before the build), the server
listens beyond the container's loopback (the default --host is 127.0.0.1,
which `-p` cannot reach) with the explicit plaintext opt-in or TLS, each
published container port is a port the server serves and the image EXPOSEs,
and a plaintext port is published on the host's loopback only.
"""

import ipaddress
import os
import re
import shlex
import unittest

import server_flags
from server_flags import SOURCE_DIR
from test_docker_build import DOCKER_DIR, DOCKERFILES, stages

DOCUMENTS = [os.path.join(SOURCE_DIR, "docs", "deploy.md"),
             os.path.join(SOURCE_DIR, "README.md")] + [
                 os.path.join(DOCKER_DIR, name) for name in DOCKERFILES]
# `docker run` options that take a value (the ones a quickstart may use).
DOCKER_VALUED = {"-p", "--publish", "-e", "--env", "-v", "--volume", "--name",
                 "--gpus", "--shm-size", "--network", "-u", "--user",
                 "--entrypoint"}


def docker_runs(path):
    """The `docker run ...` command lines of `path`, continuations joined and
    comment markers of Dockerfile headers dropped."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"\\\n\s*#?", " ", f.read())
    return [shlex.split(m) for m in
            re.findall(r"^[#\s]*(docker run .*?)\s*$", text, re.M)]


def split_docker_run(words):
    """(docker options {name: [values]}, image, arguments after the image)."""
    options = {}
    position = 2  # after "docker run"
    while words[position].startswith("-"):
        name, has_value, value = words[position].partition("=")
        position += 1
        if name in DOCKER_VALUED and not has_value:
            value = words[position]
            position += 1
        options.setdefault(name, []).append(value)
    return options, words[position], words[position + 1:]


def published(options):
    """[(host address or "", container port)] of -p / --publish."""
    result = []
    for spec in options.get("-p", []) + options.get("--publish", []):
        parts = spec.split("/")[0].split(":")
        host = parts[0] if len(parts) == 3 else ""
        result.append((host, int(parts[-1])))
    return result


def is_loopback(host):
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class DockerQuickstartTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.flags = server_flags.load()
        cls.commands = [(os.path.relpath(path, SOURCE_DIR), words)
                        for path in DOCUMENTS for words in docker_runs(path)]

    def test_the_deploy_doc_has_a_quickstart(self):
        sources = {source for source, _ in self.commands}
        self.assertIn(os.path.join("docs", "deploy.md"), sources)

    def test_images_enter_tally_server(self):
        for name in DOCKERFILES:
            with self.subTest(dockerfile=name):
                runtime = stages(os.path.join(DOCKER_DIR, name))["runtime"]
                keywords = dict(runtime)
                self.assertEqual(keywords.get("ENTRYPOINT"),
                                 '["/usr/local/bin/tally-server"]')
                # Arguments to `docker run` replace CMD wholesale: a default
                # there would silently vanish.
                self.assertNotIn("CMD", keywords)

    def test_documented_commands_reach_the_server(self):
        exposed = set()
        for name in DOCKERFILES:
            for keyword, rest in stages(os.path.join(DOCKER_DIR, name))["runtime"]:
                if keyword == "EXPOSE":
                    exposed.update(int(p.split("/")[0]) for p in rest.split())
        for source, words in self.commands:
            with self.subTest(source=source, command=" ".join(words)):
                options, image, args = split_docker_run(words)
                self.assertIn("tally-server", image)
                flags = self.flags.parse(args)  # raises on an unknown flag
                setting = lambda flag: flags.get(flag, self.flags.defaults[flag])
                tls = "--tls-cert" in flags and "--tls-key" in flags
                self.assertFalse(is_loopback(setting("--host")),
                                 "the server must listen beyond the container's "
                                 "loopback for -p to reach it")
                self.assertTrue(tls or "--allow-insecure-remote" in flags,
                                "tally-server refuses a non-loopback plaintext --host "
                                "without --allow-insecure-remote")
                served = {int(setting("--grpc-port")), int(setting("--metrics-port"))}
                ports = published(options)
                self.assertTrue(ports)
                for host, port in ports:
                    self.assertIn(port, served)
                    self.assertIn(port, exposed)
                    if not tls:
                        self.assertTrue(is_loopback(host),
                                        f"plaintext port {port} published beyond "
                                        "the host's loopback")

    def test_flag_sources_agree(self):
        if server_flags.server_binary() is None:
            self.skipTest("build/server/tally-server not built: only "
                          "server/flags.cc is read")
        with open(os.path.join(SOURCE_DIR, "server", "flags.cc"),
                  encoding="utf-8") as f:
            flags_cc = f.read()
        with open(os.path.join(SOURCE_DIR, "server", "server.h"),
                  encoding="utf-8") as f:
            from_source = server_flags.from_source(flags_cc, f.read())
        self.assertEqual(from_source.names, self.flags.names)
        self.assertEqual(from_source.valued, self.flags.valued)
        number = lambda v: float(v) if re.fullmatch(r"-?[0-9]+(\.[0-9]*)?", v) else v
        for flag, value in from_source.defaults.items():
            if flag in self.flags.defaults:
                self.assertEqual(number(value), number(self.flags.defaults[flag]), flag)

if __name__ == "__main__":
    unittest.main()
