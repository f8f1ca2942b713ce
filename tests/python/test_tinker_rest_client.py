"""tally_client.tinker's RestClient over a stand-in for the artifact calls
of ServerClient: Tinker's checkpoint records made from tally's artifacts
(checkpoint_id under the model, "training" for a state, "sampler" for an
export, times in UTC), the handles the deleting and downloading calls send,
and the archive of the downloaded files. The calls against a real server
are test_tinker_program.py's."""

import datetime
import io
import os
import tarfile
import unittest

from tally_client import pb
from tally_client.results import Artifact, ArtifactList, CheckpointDeleted
from tally_client.tinker import RestClient, types

STATE = pb.Artifact(handle="tally://model-2/weights/final",
                    kind=pb.ARTIFACT_KIND_STATE, model_id="model-2", step=6,
                    size_bytes=1234, created_unix_seconds=1700000000,
                    expires_unix_seconds=1700003600)
EXPORT = pb.Artifact(handle="tally://model-2/sampler_weights/s1",
                     kind=pb.ARTIFACT_KIND_EXPORT, model_id="model-2",
                     step=3, size_bytes=99, created_unix_seconds=1600000000)
FILES = {"config.json": b"{}", "tally.json": b"{\"step\": 6}"}


class FakeServer:
    """The artifact calls of a ServerClient, recording what they got."""

    def __init__(self):
        self.listed = []
        self.deleted = []

    def list_checkpoints(self, model_id=""):
        self.listed.append(model_id)
        return ArtifactList.from_proto(
            pb.ListCheckpointsResponse(artifacts=[EXPORT, STATE]))

    def delete_checkpoint(self, handle):
        self.deleted.append(handle)
        return CheckpointDeleted.from_proto(
            pb.DeleteCheckpointResponse(deleted=STATE))

    def download(self, handle, local_dir, progress=True):
        del progress
        assert handle == STATE.handle, handle
        manifest = []
        for name, data in FILES.items():
            with open(os.path.join(local_dir, name), "wb") as f:
                f.write(data)
            manifest.append(pb.ArtifactFile(path=name, size_bytes=len(data)))
        return manifest


class RestClientTest(unittest.TestCase):

    def setUp(self):
        self.server = FakeServer()
        self.rest = RestClient(self.server)

    def test_artifacts_become_tinkers_checkpoints(self):
        listed = self.rest.list_checkpoints("model-2").result()
        self.assertEqual(self.server.listed, ["model-2"])
        export, state = listed.checkpoints
        self.assertEqual(state, types.Checkpoint(
            checkpoint_id="weights/final", checkpoint_type="training",
            time=datetime.datetime(2023, 11, 14, 22, 13, 20,
                                   tzinfo=datetime.timezone.utc),
            tinker_path="tally://model-2/weights/final", size_bytes=1234,
            expires_at=datetime.datetime(2023, 11, 14, 23, 13, 20,
                                         tzinfo=datetime.timezone.utc)))
        self.assertEqual((export.checkpoint_id, export.checkpoint_type,
                          export.expires_at),
                         ("sampler_weights/s1", "sampler", None))

    def test_user_checkpoints_come_newest_first_by_page(self):
        every = self.rest.list_user_checkpoints().result().checkpoints
        self.assertEqual([c.tinker_path for c in every],
                         [STATE.handle, EXPORT.handle])
        page = self.rest.list_user_checkpoints(limit=1, offset=1).result()
        self.assertEqual([c.tinker_path for c in page.checkpoints],
                         [EXPORT.handle])
        self.assertEqual(self.server.listed, ["", ""])

    def test_deletes_send_the_handle(self):
        self.assertIsNone(
            self.rest.delete_checkpoint("model-2", "weights/final").result())
        self.rest.delete_checkpoint_from_tinker_path(STATE.handle).result()
        self.assertEqual(self.server.deleted, [STATE.handle] * 2)

    def test_a_path_that_is_no_handle_is_refused(self):
        with self.assertRaises(ValueError):
            self.rest.delete_checkpoint_from_tinker_path("/srv/ckpt/s1")
        self.assertEqual(self.server.deleted, [])

    def test_the_archive_holds_the_downloaded_files(self):
        archive = self.rest.download_checkpoint_archive(
            "model-2", "weights/final").result()
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            got = {m.name: tar.extractfile(m).read() for m in tar.getmembers()}
        self.assertEqual(got, FILES)


if __name__ == "__main__":
    unittest.main()
