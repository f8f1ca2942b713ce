"""The Docker build context is the source tree, without a checkout's build
outputs (.dockerignore).

A temporary checkout holds every file git tracks plus what `make`, `make
test`, an IDE, pip, scripts/gpu-kit.sh and git leave beside them (build/
with its CMakeCache.txt, other build directories, in-source CMake files,
.gpu-kit/, .git/, __pycache__/, egg-info, pip's build and dist
directories). The context its .dockerignore lets through, computed by
dockerignore.py with Docker's matching rules, is exactly the tracked files:
nothing below build/ and no CMakeCache.txt, which CMake would refuse in the
image's build stage. Where a docker CLI is installed, the context it really
sends (to a stand-in daemon on a Unix socket: no engine needed) is the same.
"""

import http.server
import io
import json
import os
import shutil
import socketserver
import subprocess
import tarfile
import tempfile
import threading
import unittest

import dockerignore
from server_flags import SOURCE_DIR

# What a developer's checkout holds beside the tracked files.
BUILD_OUTPUTS = [
    "build/CMakeCache.txt",
    "build/server/tally-server",
    "build/dist/tally_client-0.1.0-py3-none-any.whl",
    "build-asan/CMakeCache.txt",
    "cmake-build-debug/CMakeCache.txt",
    "CMakeCache.txt",
    "server/CMakeFiles/tally-server.dir/main.cc.o",
    ".gpu-kit/MANIFEST",
    ".git/HEAD",
    "tests/deploy/__pycache__/kustomize_lite.cpython-311.pyc",
    "client/python/build/lib/tally_client/client.py",
    "client/python/dist/tally_client-0.1.0.tar.gz",
    "client/python/tally_client.egg-info/PKG-INFO",
    "deploy/k8s/overlays/lws/kustomization.yaml.tmp",
]


def tracked_files():
    """The files git tracks in the source tree that exist on disk, or None
    outside a git checkout."""
    try:
        result = subprocess.run(["git", "-C", SOURCE_DIR, "ls-files", "-z"],
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    # .dockerignore itself belongs to the source even before it is added.
    return {p for p in result.stdout.split("\0") + [".dockerignore"] if p
            and os.path.lexists(os.path.join(SOURCE_DIR, p))}


def make_checkout(root, tracked):
    """Copies `tracked` from the source tree into `root` and adds
    BUILD_OUTPUTS."""
    for path in tracked:
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copy2(os.path.join(SOURCE_DIR, path), target,
                     follow_symlinks=False)
    for path in BUILD_OUTPUTS:
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write("build output\n")


class _StandInDaemon(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """Answers the docker CLI's version ping and keeps the body of each
    POST /build (the context tar); no image is built."""
    daemon_threads = True

    def __init__(self, path):
        super().__init__(path, _DaemonHandler)
        self.contexts = []


class _DaemonHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass  # a Unix socket has no client address to log

    def reply(self, status, body, content_type="application/json"):
        data = body.encode()
        self.send_response(status)
        self.send_header("Api-Version", "1.45")
        self.send_header("Ostype", "linux")
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def do_HEAD(self):
        self.reply(200, "OK", "text/plain")

    def do_GET(self):
        if self.path.endswith("/_ping"):
            self.reply(200, "OK", "text/plain")
        else:
            self.reply(404, json.dumps({"message": "stand-in daemon"}))

    def do_POST(self):
        if self.path.split("?")[0].endswith("/build"):
            self.server.contexts.append(self.read_body())
            self.reply(200, json.dumps({"stream": "context received\n"}) + "\n")
        else:
            self.reply(404, json.dumps({"message": "stand-in daemon"}))

    def read_body(self):
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("Content-Length", 0)))
        body = io.BytesIO()
        while True:
            size = int(self.rfile.readline().split(b";")[0], 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return body.getvalue()
            body.write(self.rfile.read(size))
            self.rfile.readline()


def docker_cli():
    """Whether `docker` is Docker's CLI (not, say, podman's stand-in)."""
    if shutil.which("docker") is None:
        return False
    result = subprocess.run(["docker", "--version"], capture_output=True,
                            text=True, check=False)
    return result.stdout.startswith("Docker version")


def docker_cli_context(root, home):
    """The files the docker CLI's classic builder sends as the context of
    `root`, captured by a stand-in daemon; None, with the CLI's output, when
    it sent none (a CLI without the classic builder)."""
    socket_path = os.path.join(home, "docker.sock")
    daemon = _StandInDaemon(socket_path)
    thread = threading.Thread(target=daemon.serve_forever, daemon=True)
    thread.start()
    try:
        env = dict(os.environ, DOCKER_HOST=f"unix://{socket_path}",
                   DOCKER_CONFIG=os.path.join(home, "config"),
                   DOCKER_BUILDKIT="0")
        result = subprocess.run(
            ["docker", "build", "-f", "deploy/docker/Dockerfile", "."],
            cwd=root, env=env, capture_output=True, text=True, timeout=120,
            check=False)
    finally:
        daemon.shutdown()
        daemon.server_close()
    if len(daemon.contexts) != 1:
        return None, result.stdout + result.stderr
    with tarfile.open(fileobj=io.BytesIO(daemon.contexts[0])) as tar:
        return {m.name for m in tar.getmembers() if not m.isdir()}, ""


class DockerContextTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.tracked = tracked_files()
        if cls.tracked is None:
            raise unittest.SkipTest("not a git checkout: no list of tracked files")
        cls.temp = tempfile.TemporaryDirectory(prefix="tally_context_")
        cls.root = os.path.join(cls.temp.name, "src")
        make_checkout(cls.root, cls.tracked)
        cls.patterns = dockerignore.read_patterns(
            os.path.join(cls.root, ".dockerignore"))
        cls.context = dockerignore.context_files(cls.root, cls.patterns)

    @classmethod
    def tearDownClass(cls):
        cls.temp.cleanup()

    def test_context_is_the_tracked_files(self):
        self.assertEqual(sorted(self.tracked - self.context), [],
                         "tracked files left out of the context")
        self.assertEqual(sorted(self.context - self.tracked), [],
                         "untracked files in the context")

    def test_build_directory_stays_out(self):
        self.assertIn("CMakeLists.txt", self.context)
        self.assertIn("deploy/docker/Dockerfile", self.context)
        for path in self.context:
            self.assertFalse(path.startswith("build/"), path)
            self.assertNotEqual(os.path.basename(path), "CMakeCache.txt", path)

    def test_the_matcher_follows_dockers_rules(self):
        """Cases of Docker's documented .dockerignore semantics, on patterns
        of their own."""
        with tempfile.NamedTemporaryFile("w", suffix=".dockerignore",
                                         delete=False) as f:
            f.write("# comment\n\n  /top  \n*/temp*\n**/*.o\n!keep/*.o\n"
                    "docs/*.md\n!docs/README.md\nbuild?\n")
        try:
            patterns = dockerignore.read_patterns(f.name)
        finally:
            os.unlink(f.name)
        cases = {
            "top": True, "top/file": True, "a/top": False,  # root-relative
            "a/temporary.txt": True, "a/b/temporary.txt": False,  # one level
            "x.o": True, "a/b/x.o": True, "keep/x.o": False,  # ** and !
            "docs/guide.md": True, "docs/README.md": False,  # last match wins
            "docs/sub/guide.md": False, "build1/x": True, "build12": False,
        }
        for path, expected in cases.items():
            with self.subTest(path=path):
                self.assertEqual(dockerignore.excluded(path, patterns), expected)

    def test_docker_cli_sends_the_same_context(self):
        if not docker_cli():
            self.skipTest("no docker CLI: dockerignore.py alone computes the context")
        with tempfile.TemporaryDirectory(prefix="tally_docker_") as home:
            sent, output = docker_cli_context(self.root, home)
        if sent is None:
            self.skipTest(f"this docker CLI sent no classic-builder context: {output}")
        self.assertEqual(sorted(sent ^ self.context), [])


if __name__ == "__main__":
    unittest.main()
