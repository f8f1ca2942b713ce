"""RestClient: Tinker's checkpoint calls (ServiceClient.create_rest_client)
over tally's artifact RPCs (ListCheckpoints, DeleteCheckpoint,
DownloadArtifact; the server needs --checkpoint-root). Tinker's training run
is a tally model (training_run_id: its model_id) and a tinker path a
tally:// handle, which save_state and save_weights_for_sampler return.

    rest = service.create_rest_client()
    listed = rest.list_checkpoints(training.model_id).result()
    rest.download(listed.checkpoints[0].tinker_path, "ckpt")  # tally's
    rest.delete_checkpoint_from_tinker_path(listed.checkpoints[0].tinker_path)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import io
import os
import tarfile
import tempfile
from typing import Any, Callable, List, Optional, TypeVar

from tally_client.results import Artifact, ArtifactFile, ArtifactKind
from tally_client.server import ServerClient
from tally_client.tinker.types.checkpoint import (Checkpoint,
                                                  CheckpointsListResponse)

T = TypeVar("T")
HANDLE_SCHEME = "tally://"


def _now(call: Callable[[], T]) -> "concurrent.futures.Future[T]":
    """A finished future of `call`'s result (or its exception): the artifact
    calls are blocking unary calls."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    try:
        future.set_result(call())
    except Exception as error:  # pylint: disable=broad-except
        future.set_exception(error)
    return future


def _time(unix_seconds: int) -> datetime.datetime:
    return datetime.datetime.fromtimestamp(unix_seconds,
                                           tz=datetime.timezone.utc)


def _expiry(unix_seconds: int) -> Optional[datetime.datetime]:
    """None for 0 (the artifact never expires)."""
    return _time(unix_seconds) if unix_seconds != 0 else None


def to_checkpoint(artifact: Artifact) -> Checkpoint:
    """A tally Artifact as Tinker's Checkpoint."""
    prefix = f"{HANDLE_SCHEME}{artifact.model_id}/"
    handle = artifact.handle
    return Checkpoint(
        checkpoint_id=handle[len(prefix):] if handle.startswith(prefix)
        else handle[len(HANDLE_SCHEME):],
        checkpoint_type="training" if artifact.kind == ArtifactKind.STATE
        else "sampler",
        time=_time(artifact.created_unix_seconds),
        tinker_path=handle, size_bytes=artifact.size_bytes,
        expires_at=_expiry(artifact.expires_unix_seconds))


def _handle(training_run_id: str, checkpoint_id: str) -> str:
    return f"{HANDLE_SCHEME}{training_run_id}/{checkpoint_id}"


def _tinker_path(tinker_path: str) -> str:
    if not tinker_path.startswith(HANDLE_SCHEME):
        raise ValueError(f"tinker_path {tinker_path!r}: a tally:// handle "
                         f"(save_state's path) was expected")
    return tinker_path


class RestClient:
    """Tinker's RestClient checkpoint calls on a tally server."""

    def __init__(self, server: ServerClient) -> None:
        self._server = server

    def list_checkpoints(self, training_run_id: str
                         ) -> "concurrent.futures.Future[CheckpointsListResponse]":
        """Future of the checkpoints of model `training_run_id`: states
        ("training") and exports ("sampler"), each with its tally://
        handle as tinker_path."""
        return _now(lambda: CheckpointsListResponse(checkpoints=[
            to_checkpoint(a) for a in
            self._server.list_checkpoints(training_run_id).artifacts]))

    def list_user_checkpoints(
            self, limit: int = 100, offset: int = 0
    ) -> "concurrent.futures.Future[CheckpointsListResponse]":
        """Future of every checkpoint of this tenant, newest first,
        `limit` of them after `offset`."""
        def listed() -> CheckpointsListResponse:
            every = [to_checkpoint(a) for a in
                     self._server.list_checkpoints().artifacts]
            every.sort(key=lambda c: c.time or datetime.datetime.min,
                       reverse=True)
            return CheckpointsListResponse(
                checkpoints=every[offset:offset + limit])
        return _now(listed)

    def delete_checkpoint(self, training_run_id: str,
                          checkpoint_id: str) -> "concurrent.futures.Future[None]":
        """Future of the deletion of checkpoint `checkpoint_id` of model
        `training_run_id` (NotFoundError when there is none)."""
        return self.delete_checkpoint_from_tinker_path(
            _handle(training_run_id, checkpoint_id))

    def delete_checkpoint_from_tinker_path(
            self, tinker_path: str) -> "concurrent.futures.Future[None]":
        """Future of the deletion of the checkpoint of handle
        `tinker_path`."""
        handle = _tinker_path(tinker_path)

        def delete() -> None:
            self._server.delete_checkpoint(handle)
        return _now(delete)

    def download_checkpoint_archive(
            self, training_run_id: str,
            checkpoint_id: str) -> "concurrent.futures.Future[bytes]":
        """Future of the checkpoint's files as a tar.gz archive's bytes."""
        return self.download_checkpoint_archive_from_tinker_path(
            _handle(training_run_id, checkpoint_id))

    def download_checkpoint_archive_from_tinker_path(
            self, tinker_path: str) -> "concurrent.futures.Future[bytes]":
        """download_checkpoint_archive of the checkpoint of handle
        `tinker_path`."""
        handle = _tinker_path(tinker_path)

        def archive() -> bytes:
            with tempfile.TemporaryDirectory() as local_dir:
                files = self.download(handle, local_dir, progress=False)
                out = io.BytesIO()
                with tarfile.open(fileobj=out, mode="w:gz") as tar:
                    for f in files:
                        tar.add(os.path.join(local_dir, f.path), f.path)
                return out.getvalue()
        return _now(archive)

    def download(self, tinker_path: str, local_dir: str,
                 progress: Any = True) -> List[ArtifactFile]:
        """tally's extra (blocks): the files of the checkpoint of handle
        `tinker_path` into `local_dir`, resumable and checked
        (tally_client's ServerClient.download)."""
        return self._server.download(_tinker_path(tinker_path), local_dir,
                                     progress)

    async def list_checkpoints_async(
            self, training_run_id: str) -> CheckpointsListResponse:
        """list_checkpoints for asyncio."""
        return await asyncio.to_thread(
            lambda: self.list_checkpoints(training_run_id).result())

    async def delete_checkpoint_async(self, training_run_id: str,
                                      checkpoint_id: str) -> None:
        """delete_checkpoint for asyncio."""
        await asyncio.to_thread(lambda: self.delete_checkpoint(
            training_run_id, checkpoint_id).result())

    async def delete_checkpoint_from_tinker_path_async(
            self, tinker_path: str) -> None:
        """delete_checkpoint_from_tinker_path for asyncio."""
        await asyncio.to_thread(lambda: self.delete_checkpoint_from_tinker_path(
            tinker_path).result())
