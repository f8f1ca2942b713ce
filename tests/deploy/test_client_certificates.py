"""docs/deploy.md's certificate steps give what lws-production needs.

lws-production runs tally-server with --tls-client-ca (mutual TLS). The
```sh block of the "Certificates" section runs in a temporary directory:
the server's and the client's certificates verify against the CA, the
server's names the `tally-api` Service and localhost, and tally-server
started with the server's certificate and the CA as --tls-client-ca serves
a client that presents alice.crt and refuses one that does not. Skipped
without openssl; the server half is skipped without a built tally-server.
"""

import os
import re
import shutil
import subprocess
import tempfile
import unittest

import grpc

import kustomize_lite
from server_flags import SOURCE_DIR

DEPLOY_DOC = os.path.join(SOURCE_DIR, "docs", "deploy.md")


def certificate_steps(markdown):
    """The ```sh block of the section titled "Certificates"."""
    section = re.search(r"^### Certificates\n(.*?)^##", markdown, re.S | re.M)
    if section is None:
        raise AssertionError("docs/deploy.md has no Certificates section")
    blocks = re.findall(r"```sh\n(.*?)```", section.group(1), re.S)
    if len(blocks) != 1:
        raise AssertionError(f"{len(blocks)} sh blocks under Certificates")
    return blocks[0]


def openssl(*args, cwd):
    return subprocess.run(["openssl", *args], cwd=cwd, capture_output=True,
                          text=True, check=False)


class CertificateStepsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        if shutil.which("openssl") is None:
            raise unittest.SkipTest("openssl is not installed")
        with open(DEPLOY_DOC, encoding="utf-8") as f:
            steps = certificate_steps(f.read())
        cls.temp = tempfile.TemporaryDirectory(prefix="tally_certs_")
        cls.dir = cls.temp.name
        cls.result = subprocess.run(["bash", "-euo", "pipefail", "-c", steps],
                                    cwd=cls.dir, capture_output=True, text=True,
                                    check=False)

    @classmethod
    def tearDownClass(cls):
        cls.temp.cleanup()

    def setUp(self):
        self.assertEqual(self.result.returncode, 0, self.result.stderr)

    def path(self, name):
        return os.path.join(self.dir, name)

    def test_certificates_verify_against_the_ca(self):
        result = openssl("verify", "-CAfile", "ca.crt", "server.crt", "alice.crt",
                         cwd=self.dir)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)

    def test_server_certificate_names_the_service_and_localhost(self):
        result = openssl("x509", "-in", "server.crt", "-noout", "-ext",
                         "subjectAltName", cwd=self.dir)
        self.assertEqual(result.returncode, 0, result.stderr)
        names = set(re.findall(r"DNS:([\w.-]+)", result.stdout))
        objects = kustomize_lite.render(os.path.join(
            SOURCE_DIR, "deploy", "k8s", "overlays", "lws-production"))
        grpc_services = {
            o["metadata"]["name"] for o in objects
            if o["kind"] == "Service" and o["spec"].get("clusterIP") != "None"
            and any(p["targetPort"] == "grpc" for p in o["spec"]["ports"])}
        self.assertTrue(grpc_services)
        self.assertLessEqual(grpc_services | {"localhost"}, names)

    def test_server_serves_the_client_with_a_certificate_only(self):
        if not os.access(os.environ.get("TALLY_SERVER", ""), os.X_OK):
            self.skipTest("TALLY_SERVER names no tally-server (ctest sets it)")
        # Imported here: they need the generated stubs, which ctest provides.
        from tally_client import Tls
        from tally_client.server import make_channel, wait_for_serving
        from tally_testing import TallyServer
        server = TallyServer(os.path.join(self.dir, "server"), extra_args=[
            "--tls-cert", self.path("server.crt"), "--tls-key",
            self.path("server.key"), "--tls-client-ca", self.path("ca.crt")])
        try:
            target = f"localhost:{server.grpc_port}"
            wait_for_serving(target, timeout=60, tls=Tls(
                ca_cert=self.path("ca.crt"), client_cert=self.path("alice.crt"),
                client_key=self.path("alice.key")))
            channel = make_channel(target, Tls(ca_cert=self.path("ca.crt")))
            check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                        request_serializer=lambda _: b"",
                                        response_deserializer=lambda b: b)
            with self.assertRaises(grpc.RpcError) as refused:
                check(None, timeout=10)
            channel.close()
            self.assertEqual(refused.exception.code(), grpc.StatusCode.UNAVAILABLE)
        finally:
            self.assertEqual(server.terminate(), 0, server.log_tail())


if __name__ == "__main__":
    unittest.main()
