"""ServerClient: a connection to a tally server, for the calls that belong
to no model (server_info, list_models) and for the per-model
TrainingClients that share it.

It holds the gRPC channel, the bearer token, the per-attempt timeout and
the RetryPolicy; call() sends one RPC and retries it, with exponential
backoff at least the server's RetryInfo delay apart, while the failure is
one a retry can fix (tally_client.errors.is_retryable). A failure for good
raises the TallyError subclass of its status code. Results are the typed
dataclasses of tally_client.results.

    with ServerClient("localhost:50051", token="s3cret") as server:
        print(server.server_info().version)
        for model in server.list_models().models:
            print(model.model_id, model.step)
        client = server.training_client("demo")  # shares the channel
"""

from __future__ import annotations

import concurrent.futures
import random
import threading
import time
from typing import TYPE_CHECKING, Any, List, Optional, Tuple, Union

import grpc

from tally_client._proto.tally.v1 import trainer_pb2 as pb
from tally_client._proto.tally.v1 import trainer_pb2_grpc as pb_grpc
from tally_client.errors import (TallyError, error_class, error_details,
                                 is_retryable)
from tally_client.artifacts import (ProgressLike, progress_reporter,
                                    resume_offset, verify_files, write_chunk)
from tally_client.errors import AbortedError
from tally_client.results import (ArtifactFile, ArtifactList,
                                  CheckpointDeleted, ModelList, ServerInfo)

if TYPE_CHECKING:
    from tally_client.client import TrainingClient


class RetryPolicy:
    """Attempts per call (the first included) and the exponential backoff
    between them, with up to 10% jitter."""

    def __init__(self, max_attempts: int = 8, initial_backoff: float = 0.1,
                 max_backoff: float = 5.0) -> None:
        if max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        self.max_attempts = max_attempts
        self.initial_backoff = initial_backoff
        self.max_backoff = max_backoff

    def backoff(self, attempt: int) -> float:
        """Seconds to wait after failed attempt number `attempt` (1-based)."""
        base = min(self.max_backoff, self.initial_backoff * 2 ** (attempt - 1))
        return base * (1 + 0.1 * random.random())


# PEM bytes, or the path of a PEM file.
Pem = Union[bytes, str]


class Tls:
    """TLS settings: root CA (None: the system's), and for mutual TLS a client
    certificate and key. Each is PEM bytes or a path."""

    def __init__(self, ca_cert: Optional[Pem] = None,
                 client_cert: Optional[Pem] = None,
                 client_key: Optional[Pem] = None,
                 server_name: Optional[str] = None) -> None:
        self.ca_cert = ca_cert
        self.client_cert = client_cert
        self.client_key = client_key
        self.server_name = server_name

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel credentials of these settings."""
        def read(value: Optional[Pem]) -> Optional[bytes]:
            if value is None or isinstance(value, bytes):
                return value
            with open(value, "rb") as f:
                return f.read()
        return grpc.ssl_channel_credentials(
            root_certificates=read(self.ca_cert),
            private_key=read(self.client_key),
            certificate_chain=read(self.client_cert))


# What a `tls` argument takes: None/False (insecure), True (TLS with the
# system's roots), a Tls, or grpc.ChannelCredentials.
TlsLike = Union[None, bool, Tls, grpc.ChannelCredentials]


def make_channel(target: str, tls: TlsLike = None,
                 max_message_bytes: int = 256 << 20) -> grpc.Channel:
    """An insecure channel for tls None/False; TLS for True (system roots), a
    Tls, or grpc.ChannelCredentials."""
    options: List[Tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes)]
    if not tls:
        return grpc.insecure_channel(target, options=options)
    if tls is True:
        tls = Tls()
    if isinstance(tls, Tls):
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        tls = tls.credentials()
    return grpc.secure_channel(target, tls, options=options)


class ServerClient:
    """A tally server's connection and its model-less calls. Thread-safe."""

    def __init__(self, target: str, token: Optional[str] = None,
                 tls: TlsLike = None, *, timeout: float = 600.0,
                 retry: Optional[RetryPolicy] = None,
                 channel: Optional[grpc.Channel] = None) -> None:
        """`target`: "host:port". `token`: sent as "authorization: Bearer
        <token>". `tls`: see make_channel. `timeout`: seconds per attempt.
        `retry`: the RetryPolicy of every call (default RetryPolicy()).
        `channel`: use this channel instead of opening one (close() then
        leaves it open)."""
        self.target = target
        self._channel = channel or make_channel(target, tls)
        self._owns_channel = channel is None
        self._stub = pb_grpc.TrainerStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._timeout = timeout
        self._retry = retry or RetryPolicy()

    def server_info(self) -> ServerInfo:
        """GetServerInfo: the server's version, compute backend, mesh,
        model families, dtypes, losses, features and limits."""
        return ServerInfo.from_proto(self.call(
            "GetServerInfo", pb.GetServerInfoRequest(),
            retryable=True).result())

    def list_models(self, page_size: int = 0) -> ModelList:
        """ListModels, every page: `models` holds every model of the server
        (ModelInfo), `unresumed` the models --resume could not restore.
        `page_size`: the models per call (0: the server's default)."""
        result = pb.ListModelsResponse()
        token = ""
        while True:
            page = self.call("ListModels", pb.ListModelsRequest(
                page_size=page_size, page_token=token), retryable=True).result()
            result.models.extend(page.models)
            result.unresumed.extend(page.unresumed)
            token = page.next_page_token
            if not token:
                return ModelList.from_proto(result)

    def training_client(self, model_id: str,
                        **options: Any) -> "TrainingClient":
        """A TrainingClient of model `model_id` over this connection;
        `options`: TrainingClient's keyword-only arguments (first_seq_id,
        pending_window)."""
        # pylint: disable-next=import-outside-toplevel
        from tally_client.client import TrainingClient
        return TrainingClient(self.target, model_id, server=self, **options)

    def call(self, method: str, request: Any,
             retryable: bool) -> "concurrent.futures.Future[Any]":
        """Future of Trainer `method`(`request`), retried on failures a
        retry can fix when `retryable` (sequenced or read-only calls); a
        failure for good is the TallyError subclass of its code."""
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        rpc = getattr(self._stub, method)

        def attempt(number: int) -> None:
            call = rpc.future(request, timeout=self._timeout,
                              metadata=self._metadata)

            def done(call: grpc.Future) -> None:
                try:
                    result.set_result(call.result())
                    return
                except grpc.RpcError as error:
                    code, details = error.code(), error.details()
                    reason, delay = error_details(error)
                if (retryable and is_retryable(code, reason, delay)
                        and number < self._retry.max_attempts):
                    timer = threading.Timer(
                        max(self._retry.backoff(number), delay or 0.0),
                        attempt, args=(number + 1,))
                    timer.daemon = True
                    timer.start()
                    return
                result.set_exception(
                    error_class(code)(method, code, details, reason))

            call.add_done_callback(done)

        attempt(1)
        return result

    # ---- artifacts (tally:// handles; the server's --checkpoint-root) ----

    def list_checkpoints(self, model_id: str = "") -> ArtifactList:
        """ListCheckpoints: this tenant's checkpoints and exports (of
        `model_id` only, unless empty), each with its handle, kind, step,
        size, creation and expiry."""
        return ArtifactList.from_proto(self.call(
            "ListCheckpoints", pb.ListCheckpointsRequest(model_id=model_id),
            retryable=True).result())

    def delete_checkpoint(self, handle: str) -> CheckpointDeleted:
        """DeleteCheckpoint: removes the checkpoint or export `handle`
        (NotFoundError when it names nothing of this tenant's)."""
        return CheckpointDeleted.from_proto(self.call(
            "DeleteCheckpoint", pb.DeleteCheckpointRequest(handle=handle),
            retryable=False).result())

    def download(self, handle: str, local_dir: str,
                 progress: ProgressLike = True) -> List[ArtifactFile]:
        """Downloads the files of the checkpoint or export `handle` into
        `local_dir` (created), resuming after the bytes a partial download
        left there, and verifies every file's SHA-256 (DataLossError naming a
        mismatch; the file is deleted, so a rerun fetches it). A broken
        stream is resumed up to the retry policy's attempts. `progress`:
        True draws a progress bar (tqdm's when installed), a callable gets
        (bytes held, total), False nothing. Returns the manifest."""
        report = progress_reporter(progress)
        head = self._stream_artifact(handle, 0, True, local_dir, None)
        for attempt in range(1, self._retry.max_attempts + 1):
            offset = resume_offset(local_dir, head.manifest)
            if offset == head.total_bytes:
                if report:
                    report(offset, offset)
                break
            try:
                streamed = self._stream_artifact(handle, offset, False,
                                                 local_dir, report)
            except TallyError as error:
                if (attempt < self._retry.max_attempts and is_retryable(
                        error.code, error.reason, None)):
                    time.sleep(self._retry.backoff(attempt))
                    continue
                raise
            if list(streamed.manifest) != list(head.manifest):
                raise AbortedError(
                    "DownloadArtifact", grpc.StatusCode.ABORTED,
                    f"{handle} was replaced during the download; download it "
                    f"again into an empty directory")
            break
        verify_files(local_dir, head.manifest)
        return [ArtifactFile.from_proto(f) for f in head.manifest]

    def _stream_artifact(self, handle: str, offset: int, manifest_only: bool,
                         local_dir: str, report: Any) -> Any:
        """One DownloadArtifact stream from `offset`: its first message;
        the data chunks written into `local_dir`."""
        request = pb.DownloadArtifactRequest(
            handle=handle, offset=offset, manifest_only=manifest_only)
        first = None
        try:
            for chunk in self._stub.DownloadArtifact(
                    request, timeout=self._timeout, metadata=self._metadata):
                if first is None:
                    first = chunk
                    if report:
                        report(offset, first.total_bytes)
                    continue
                write_chunk(local_dir, chunk)
                if report:
                    report(chunk.offset + len(chunk.data), first.total_bytes)
        except grpc.RpcError as error:
            code, details = error.code(), error.details()
            reason, _ = error_details(error)
            raise error_class(code)("DownloadArtifact", code, details,
                                    reason) from None
        if first is None:
            raise TallyError("DownloadArtifact", grpc.StatusCode.INTERNAL,
                             "the server sent no manifest")
        return first

    def close(self) -> None:
        """Closes the channel, unless it was passed in."""
        if self._owns_channel:
            self._channel.close()

    def __enter__(self) -> "ServerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def wait_for_serving(target: str, timeout: float = 60.0,
                     tls: TlsLike = None) -> None:
    """Polls grpc.health.v1 until the server at `target` is SERVING; raises
    TimeoutError after `timeout` seconds."""
    # grpc_health is not a Debian package: the health service is called by
    # its method path, with the request and response parsed by hand (an
    # empty request; the response's field 1 is the status enum).
    channel = make_channel(target, tls)
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
                                request_serializer=lambda _: b"",
                                response_deserializer=lambda b: b)
    deadline = time.monotonic() + timeout
    last = None
    try:
        while time.monotonic() < deadline:
            try:
                answer = check(None, timeout=2)
                if answer == b"\x08\x01":  # status: SERVING
                    return
                last = f"health answer {answer!r}"
            except grpc.RpcError as error:
                last = f"{error.code().name}: {error.details()}"
            time.sleep(0.1)
    finally:
        channel.close()
    raise TimeoutError(f"{target} not SERVING after {timeout}s; last: {last}")
