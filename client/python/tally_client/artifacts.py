"""The local side of DownloadArtifact: where a download into a directory
resumes, writing each chunk at its place, and the SHA-256 check of every
file at the end (client/artifact_files.h is the C++ twin).

    manifest = [ArtifactFile, ...]          # the stream's first message
    offset = resume_offset(local_dir, manifest)
    for chunk in stream_from(offset):
        write_chunk(local_dir, chunk)
    verify_files(local_dir, manifest)       # DataLossError on a mismatch
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Callable, Optional, Sequence, Union

import grpc

from tally_client.errors import DataLossError

# A progress report: (bytes held, total bytes).
Progress = Callable[[int, int], None]
ProgressLike = Union[bool, Progress, None]


def _path(local_dir: str, name: str) -> str:
    """`local_dir`/`name` for a plain file name from the server's manifest;
    DataLossError for anything else (a path that could leave the
    directory)."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise DataLossError("DownloadArtifact", grpc.StatusCode.DATA_LOSS,
                            f"the server's manifest names {name[:64]!r}, not "
                            f"a file name", None)
    return os.path.join(local_dir, name)


def resume_offset(local_dir: str, manifest: Sequence[Any]) -> int:
    """The bytes of the artifact `local_dir` (created) already holds, in
    manifest order: the whole files, then the first short one's bytes. A
    file longer than its manifest size is emptied, and the files after the
    resume point are removed (fetched anew)."""
    os.makedirs(local_dir, exist_ok=True)
    offset = 0
    resumed = False
    for file in manifest:
        path = _path(local_dir, file.path)
        if resumed:
            if os.path.exists(path):
                os.remove(path)
            continue
        have = os.path.getsize(path) if os.path.isfile(path) else 0
        if have > file.size_bytes:
            os.truncate(path, 0)
            have = 0
        offset += have
        resumed = have < file.size_bytes
    return offset


def write_chunk(local_dir: str, chunk: Any) -> None:
    """Writes a DownloadArtifactChunk's data at its file_offset."""
    path = _path(local_dir, chunk.path)
    with open(path, "ab"):  # created if missing, never truncated
        pass
    with open(path, "r+b") as out:
        out.seek(chunk.file_offset)
        out.write(chunk.data)


def verify_files(local_dir: str, manifest: Sequence[Any]) -> None:
    """Every manifest file has its size and SHA-256; DataLossError naming
    the first that does not (deleted, so that a rerun fetches it again)."""
    for file in manifest:
        path = _path(local_dir, file.path)
        if not os.path.exists(path) and file.size_bytes == 0:
            open(path, "wb").close()  # an empty file gets no chunk
        digest = hashlib.sha256()
        try:
            with open(path, "rb") as data:
                while True:
                    block = data.read(1 << 20)
                    if not block:
                        break
                    digest.update(block)
        except FileNotFoundError:
            pass
        if digest.hexdigest() != file.sha256:
            if os.path.exists(path):
                os.remove(path)
            raise DataLossError(
                "DownloadArtifact", grpc.StatusCode.DATA_LOSS,
                f"{file.path} does not match the server's SHA-256 "
                f"{file.sha256} (deleted; download again to fetch it anew)",
                None)


def progress_reporter(progress: ProgressLike) -> Optional[Progress]:
    """The callable of download(progress=...): True draws a bar (tqdm's when
    it is installed, else one line on stderr), a callable is called with
    (bytes held, total), False or None reports nothing."""
    if callable(progress):
        return progress
    if not progress:
        return None
    try:
        # pylint: disable-next=import-outside-toplevel
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    bar: Any = None

    def report(done: int, total: int) -> None:
        nonlocal bar
        if tqdm is not None:
            if bar is None:
                bar = tqdm(total=total, initial=done, unit="B",
                           unit_scale=True)
            bar.update(done - bar.n)
            if done >= total:
                bar.close()
            return
        percent = 100.0 * done / total if total else 100.0
        sys.stderr.write(f"\r{done} / {total} bytes ({percent:.0f}%)")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return report
