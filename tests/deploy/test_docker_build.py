"""deploy/docker cannot rot unnoticed, although no Docker engine runs here.

Every path the Dockerfiles COPY from the build context exists; every script
they RUN exists and passes `bash -n`; the runtime stage is non-root, has no
HEALTHCHECK and enters tally-server; the base images are build arguments (to
pin by digest); what the comments say of probes is what deploy/k8s does.
deploy/docker/install-runtime.sh, which the build stage runs, is run for real
on this build tree into a temporary prefix: the binaries it installs start,
every shared library they load maps to an installed Debian package (the list
the runtime stage apt-installs), the Python client imports from the prefix,
and every path the runtime stage copies out of the build stage exists in that
prefix.
"""

import os
import re
import shlex
import subprocess
import sys
import tempfile
import unittest

import kustomize_lite
from server_flags import SOURCE_DIR
DOCKER_DIR = os.path.join(SOURCE_DIR, "deploy", "docker")
DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]
# Where the build stage runs install-runtime.sh (its PREFIX argument).
BUILD_STAGE_PREFIX = "/runtime"


def instructions(path):
    """[(INSTRUCTION, argument text)] with line continuations joined."""
    with open(path, encoding="utf-8") as f:
        text = re.sub(r"\\\n", " ", f.read())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def stages(path):
    """The instructions of each stage, by stage name."""
    named = {}
    current = None
    for keyword, rest in instructions(path):
        if keyword == "FROM":
            parts = rest.split()
            current = parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else parts[0]
            named[current] = []
        elif current is not None:
            named[current].append((keyword, rest))
    return named


def build_dir():
    return os.path.dirname(os.path.dirname(os.environ["TALLY_SERVER"]))


class DockerfileTest(unittest.TestCase):

    def test_context_paths_exist_and_scripts_parse(self):
        for name in DOCKERFILES:
            for keyword, rest in instructions(os.path.join(DOCKER_DIR, name)):
                with self.subTest(dockerfile=name, line=f"{keyword} {rest}"):
                    if keyword == "COPY" and "--from=" not in rest:
                        sources = shlex.split(rest)[:-1]
                        for source in sources:
                            self.assertTrue(
                                os.path.exists(os.path.join(SOURCE_DIR, source)),
                                source)
                    if keyword == "RUN":
                        for script in re.findall(r"bash (\S+\.sh)", rest):
                            path = os.path.join(SOURCE_DIR, script)
                            self.assertTrue(os.path.isfile(path), script)
                            subprocess.run(["bash", "-n", path], check=True)

    def test_runtime_stage(self):
        for name in DOCKERFILES:
            with self.subTest(dockerfile=name):
                runtime = stages(os.path.join(DOCKER_DIR, name))["runtime"]
                keywords = [k for k, _ in runtime]
                self.assertNotIn("HEALTHCHECK", keywords)
                user = [rest for k, rest in runtime if k == "USER"]
                self.assertEqual(len(user), 1)
                self.assertNotIn(user[0].split(":")[0], ("0", "root"))
                entrypoint = [rest for k, rest in runtime if k == "ENTRYPOINT"]
                self.assertEqual(entrypoint, ['["/usr/local/bin/tally-server"]'])

    def test_base_images_are_build_arguments(self):
        """Every FROM names an earlier stage or a build argument declared
        before the first FROM with a default, so a digest can pin it; a
        default that pins one is a well-formed sha256 digest."""
        for name in DOCKERFILES:
            path = os.path.join(DOCKER_DIR, name)
            arguments, stage_names = {}, set()
            for keyword, rest in instructions(path):
                if keyword == "ARG" and not stage_names:
                    argument, _, default = rest.partition("=")
                    arguments[argument] = default
                if keyword != "FROM":
                    continue
                image, *alias = rest.split()
                with self.subTest(dockerfile=name, image=image):
                    if image not in stage_names:
                        match = re.fullmatch(r"\$\{(\w+)\}", image)
                        self.assertIsNotNone(match, f"FROM {image}: not an ARG")
                        default = arguments.get(match.group(1))
                        self.assertTrue(default, f"{image}: no default")
                        if "@" in default:
                            self.assertRegex(default, r"@sha256:[0-9a-f]{64}$")
                if len(alias) == 2:
                    stage_names.add(alias[1])
            self.assertEqual(stage_names, {"build", "runtime"})

    def test_probe_comment_matches_the_manifests(self):
        """What a Dockerfile says about probes is what deploy/k8s does: HTTP
        GETs of the paths the rendered workload probes."""
        objects = kustomize_lite.render(os.path.join(SOURCE_DIR, "deploy", "k8s",
                                                     "overlays", "lws"))
        container = kustomize_lite.find(objects, "LeaderWorkerSet", "tally")[
            "spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]
        paths = {container[probe]["httpGet"]["path"] for probe in
                 ("startupProbe", "readinessProbe", "livenessProbe")}
        checked = 0
        for name in DOCKERFILES:
            with open(os.path.join(DOCKER_DIR, name), encoding="utf-8") as f:
                comments = " ".join(line.lstrip("# ").rstrip() for line in f
                                    if line.startswith("#"))
            for sentence in re.split(r"(?<=\.) ", comments):
                if "probe" not in sentence.lower():
                    continue
                with self.subTest(dockerfile=name, sentence=sentence):
                    self.assertIn("HTTP", sentence)
                    self.assertNotIn("grpc.health", sentence)
                    for path in paths:
                        self.assertIn(path, sentence)
                    checked += 1
        self.assertGreater(checked, 0, "no Dockerfile comment on the probes")

    def test_both_images_build_with_the_ci_scripts(self):
        for name in DOCKERFILES:
            with self.subTest(dockerfile=name):
                build = " ".join(rest for k, rest in
                                 stages(os.path.join(DOCKER_DIR, name))["build"]
                                 if k == "RUN")
                self.assertIn("bash scripts/install-deps.sh", build)
                self.assertIn("bash deploy/docker/build.sh /src /src/build", build)
                self.assertIn(f"deploy/docker/install-runtime.sh /src /src/build "
                              f"{BUILD_STAGE_PREFIX}", build)


class InstallRuntimeTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.temp = tempfile.TemporaryDirectory(prefix="tally_image_")
        cls.prefix = os.path.join(cls.temp.name, "runtime")
        cls.result = subprocess.run(
            ["bash", os.path.join(DOCKER_DIR, "install-runtime.sh"), SOURCE_DIR,
             build_dir(), cls.prefix], capture_output=True, text=True, check=False)

    @classmethod
    def tearDownClass(cls):
        cls.temp.cleanup()

    def setUp(self):
        self.assertEqual(self.result.returncode, 0,
                         self.result.stdout + self.result.stderr)

    def test_binaries_run_from_the_prefix(self):
        bin_dir = os.path.join(self.prefix, "usr", "local", "bin")
        help_text = subprocess.run([os.path.join(bin_dir, "tally-server"), "--help"],
                                   capture_output=True, text=True, check=True).stdout
        self.assertIn("--metrics-port", help_text)
        ctl = subprocess.run([os.path.join(bin_dir, "tallyctl"), "--help"],
                             capture_output=True, text=True, check=False)
        self.assertEqual(ctl.returncode, 0, ctl.stderr)

    def test_runtime_packages_cover_every_library(self):
        path = os.path.join(self.prefix, "usr", "local", "share", "tally",
                            "runtime-packages.txt")
        with open(path, encoding="utf-8") as f:
            packages = f.read().split()
        self.assertTrue(any(p.startswith("libtorch") for p in packages), packages)
        self.assertTrue(any(p.startswith("libgrpc++") for p in packages), packages)
        status = subprocess.run(["dpkg-query", "-W", "-f=${Package} ${Status}\n"]
                                + packages, capture_output=True, text=True,
                                check=False).stdout.splitlines()
        self.assertEqual(sorted(status),
                         sorted(f"{p} install ok installed" for p in packages))
        # Independently: ldd of the installed binary only names libraries
        # that one of these packages ships, or the CUDA toolkit's (a build
        # with the CUDA pieces), which a CUDA image installs from NVIDIA.
        listing = subprocess.run(["dpkg-query", "-L"] + packages,
                                 capture_output=True, text=True, check=True)
        shipped = {os.path.basename(p) for p in listing.stdout.split()}
        ldd = subprocess.run(["ldd", os.path.join(self.prefix, "usr", "local", "bin",
                                                  "tally-server")],
                             capture_output=True, text=True, check=True).stdout
        for library, path in re.findall(r"(\S+\.so[.\d]*) => (/\S+)", ldd):
            if os.path.realpath(path).startswith("/usr/local/cuda"):
                continue
            self.assertIn(library, shipped)

    def test_python_client_imports_from_the_prefix(self):
        python_dir = os.path.join(self.prefix, "usr", "local", "share", "tally", "python")
        result = subprocess.run(
            [sys.executable, "-c",
             "import tally_client; from tally_client import pb; "
             "print(tally_client.sample([1], [2]).target_tokens[0], "
             "pb.OptimStepRequest.DESCRIPTOR.name)"],
            env={"PYTHONPATH": python_dir, "PATH": os.environ["PATH"]},
            capture_output=True, text=True, check=False)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertEqual(result.stdout.split(), ["2", "OptimStepRequest"])

    def test_default_text_exists_in_the_prefix(self):
        tallyctl = os.path.join(self.prefix, "usr", "local", "bin", "tallyctl")
        help_text = subprocess.run([tallyctl, "train", "--help"], capture_output=True,
                                   text=True, check=True).stdout
        default = re.search(r"--text STR .*\(default: (\S+)\)$", help_text, re.M)
        self.assertIsNotNone(default, help_text)
        # The image holds PREFIX at /, so the compiled-in path is PREFIX/path.
        with open(self.prefix + default.group(1), encoding="utf-8") as f:
            self.assertIn("PRIDE AND PREJUDICE", f.read(4096).upper())

    def test_runtime_stage_copies_paths_the_prefix_has(self):
        for name in DOCKERFILES:
            runtime = stages(os.path.join(DOCKER_DIR, name))["runtime"]
            for keyword, rest in runtime:
                if keyword != "COPY" or "--from=build" not in rest:
                    continue
                source = shlex.split(rest)[1]
                if not source.startswith(BUILD_STAGE_PREFIX):
                    continue  # build-stage system files (CUDA keyring, LibTorch)
                with self.subTest(dockerfile=name, source=source):
                    relative = os.path.relpath(source, BUILD_STAGE_PREFIX)
                    self.assertTrue(os.path.exists(os.path.join(self.prefix, relative)))


if __name__ == "__main__":
    unittest.main()
