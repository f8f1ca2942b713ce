"""Artifacts through the Python client: save and export with handles, list,
download (byte-equal to the server's files, checksums verified), resume a
partial download, detect a corrupt local file, delete; ttl_seconds recorded
as the expiry. A tally-server with --checkpoint-root, no authentication."""

import os
import shutil
import tempfile
import unittest

import tally_client
from tally_client import TrainingClient, sample
from tally_client.artifacts import resume_offset
from tally_client.results import ArtifactKind
from tally_testing import TINY_LLAMA, SharedServerTestCase, pb

VOCAB = TINY_LLAMA["vocab_size"]


def read(path):
    with open(path, "rb") as f:
        return f.read()


class ArtifactsTest(SharedServerTestCase):
    TEMP_PREFIX = "tally_artifacts_"

    @classmethod
    def setUpClass(cls):
        cls.root = tempfile.mkdtemp(prefix="tally_artifacts_root_")
        cls.SERVER_ARGS = ("--checkpoint-root", cls.root)
        super().setUpClass()

    @classmethod
    def tearDownClass(cls):
        super().tearDownClass()
        shutil.rmtree(cls.root, ignore_errors=True)

    def trained(self, model_id):
        client = TrainingClient(self.target, model_id)
        self.addCleanup(client.close)
        client.create_model(config=TINY_LLAMA, seed=3)
        tokens = [(5 * t) % VOCAB for t in range(9)]
        client.forward_backward([sample(tokens[:-1], tokens[1:])]).result()
        client.optim_step().result()
        return client

    def test_save_list_download_resume_delete(self):
        client = self.trained("m1")
        saved = client.save("py/s1", ttl_seconds=3600).result()
        self.assertEqual(saved.handle, "tally://py/s1")
        exported = client.export_weights("py/e1").result()
        self.assertEqual(exported.handle, "tally://py/e1")

        listed = {a.handle: a for a in client.list_checkpoints().artifacts}
        self.assertEqual(set(listed), {"tally://py/s1", "tally://py/e1"})
        state = listed["tally://py/s1"]
        self.assertIs(state.kind, ArtifactKind.STATE)
        self.assertEqual((state.model_id, state.step), ("m1", 1))
        self.assertEqual(state.expires_unix_seconds,
                         state.created_unix_seconds + 3600)
        self.assertIs(listed["tally://py/e1"].kind, ArtifactKind.EXPORT)
        self.assertEqual(listed["tally://py/e1"].expires_unix_seconds, 0)

        local = os.path.join(self.temp, "local")
        reports = []
        files = client.download(saved.handle, local,
                                progress=lambda d, t: reports.append((d, t)))
        total = sum(f.size_bytes for f in files)
        self.assertEqual(reports[-1], (total, total))
        server_dir = os.path.join(self.root, "py", "s1")
        for f in files:
            self.assertEqual(read(os.path.join(local, f.path)),
                             read(os.path.join(server_dir, f.path)), f.path)

        # Resumed after a cut in model.safetensors.
        names = [f.path for f in files]
        cut = names.index("model.safetensors")
        before = sum(f.size_bytes for f in files[:cut])
        os.truncate(os.path.join(local, "model.safetensors"),
                    files[cut].size_bytes // 2)
        self.assertEqual(resume_offset(local, files),
                         before + files[cut].size_bytes // 2)
        reports.clear()
        client.download(saved.handle, local,
                        progress=lambda d, t: reports.append((d, t)))
        self.assertEqual(reports[0][0], before + files[cut].size_bytes // 2)
        self.assertEqual(read(os.path.join(local, "model.safetensors")),
                         read(os.path.join(server_dir, "model.safetensors")))

        # A corrupt local file of the right size: DataLossError, then a
        # rerun fetches it anew.
        with open(os.path.join(local, "config.json"), "r+b") as f:
            f.write(b"X")
        with self.assertRaises(tally_client.DataLossError):
            client.download(saved.handle, local, progress=False)
        client.download(saved.handle, local, progress=False)

        # The handle loads, and is deleted.
        self.assertEqual(client.load(saved.handle).result().model.step, 1)
        deleted = client.delete_checkpoint(saved.handle)
        self.assertEqual(deleted.deleted.handle, saved.handle)
        with self.assertRaises(tally_client.NotFoundError):
            client.download(saved.handle, os.path.join(self.temp, "x"),
                            progress=False)
        with self.assertRaises(tally_client.NotFoundError):
            client.delete_checkpoint(saved.handle)
        with self.assertRaises(tally_client.InvalidArgumentError):
            client.delete_checkpoint("tally://../etc")

    def test_artifact_kind_mirrors_the_proto(self):
        self.assertEqual(
            {k.name: k.value for k in ArtifactKind},
            {name[len("ARTIFACT_KIND_"):]: value
             for name, value in pb.ArtifactKind.items()})


if __name__ == "__main__":
    unittest.main()
