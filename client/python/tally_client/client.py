"""TrainingClient: one model on a tally server, from a Python training loop.

Every mutating call gets the next seq_id of the model at the moment it is
made, and returns a concurrent.futures.Future at once, so ForwardBackward
calls can be pipelined. Failures a retry can fix (the reasons QUEUE_FULL,
SHUTTING_DOWN, RANK_FAILED, or UNAVAILABLE / DEADLINE_EXCEEDED without a
reason; see tally_client.errors) are retried with exponential backoff, at
least the server's RetryInfo delay apart, resending the SAME request and
seq_id: the server executes a sequenced request once and answers a repeat with
the cached result, so a retry is never applied twice. A message too large or
a memory limit is never retried.

Window-closing calls (optim_step, abort_window, save, load) are sent once the
calls before them have finished, so that no step can overtake the
ForwardBackward calls of its window even on a server that does not order by
seq_id. A server whose API has ModelInfo.next_seq_id executes each model's
requests in seq_id order, so the next window's calls are sent at once; with an
older server they wait until the window-closing call has finished. If a call
of the window failed for good, its OptimStep is not sent: the window is
aborted instead (under the step's seq_id, so the sequence has no gap) and the
step's future raises WindowAbortedError. A server that answers ABORTED (a
poisoned window) also raises WindowAbortedError: call abort_window() and redo
the window. A window-closing call the server refuses (a bad hyperparameter, a
checkpoint that does not load, a save with a pending window) raises
TallyError and leaves the window as it was: the next calls go on with it. A
call refused before it ran leaves its seq_id unused; the client fills it (a
forward-only call of one token) so that no gap holds back the calls after it.
export_weights and save(allow_pending=True) are sequenced too, so they write
the state of every earlier step, but belong to no window: they neither close
one nor abort one when they fail. So are sample and compute_logprobs (the
server's Sample and ComputeLogprobs), which read the weights of every
earlier step and never a pending window; with sequenced=False they take no
seq_id, for a model another client trains.

    client = TrainingClient("localhost:50051", "demo", token="s3cret")
    calls = [client.forward_backward(batch) for batch in window]
    step = client.optim_step(adam={"learning_rate": 3e-4}, max_grad_norm=1.0)
    print(step.result().grad_norm, sum(c.result().loss_sum for c in calls))

Results are the typed, frozen dataclasses of tally_client.results
(ModelInfo, ForwardBackwardResult, OptimStepResult, ...), with the response
message's field names and the message itself as `.raw`.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import (Any, Callable, Dict, List, Mapping, Optional, Sequence,
                    Tuple, TypeVar, Union)

import grpc

from tally_client._proto.tally.v1 import trainer_pb2 as pb
from tally_client.dtypes import DTypeLike, parse_dtype
from tally_client.errors import (AbortedError, NotFoundError,
                                 PendingWindowError, TallyError,
                                 WindowAbortedError)
from tally_client.artifacts import ProgressLike
from tally_client.results import (AbortResult, ArtifactFile, ArtifactList,
                                  CheckpointDeleted, DeleteResult, ExportResult,
                                  ForwardBackwardResult, LoadResult,
                                  LogprobsResult, LoraConfig, ModelInfo,
                                  OptimStepResult, SamplerInfo,
                                  SamplingResult, SaveResult, ServerInfo,
                                  TypedMessage)
from tally_client.samples import SampleLike, to_samples
from tally_client.sampling import (StopLike, TokensLike, logprobs_request,
                                   sample_request)
from tally_client.server import RetryPolicy, ServerClient, TlsLike

# A future of a call's result.
Future = concurrent.futures.Future

# The API revision with exactly-once sequencing (ordered by seq_id, retries
# answered from a cache) reports where a client resumes.
SERVER_ORDERS_BY_SEQ_ID = "next_seq_id" in pb.ModelInfo.DESCRIPTOR.fields_by_name

# A proto enum type.
E = TypeVar("E")
# A call's result type.
R = TypeVar("R")

_REDUCTIONS: Dict[str, pb.LossReduction] = {
    "token_mean": pb.LOSS_REDUCTION_TOKEN_MEAN,
    "sample_mean": pb.LOSS_REDUCTION_SAMPLE_MEAN,
    "sum": pb.LOSS_REDUCTION_SUM,
}

# forward_backward's per-token objectives by Tinker's names (the proto's
# LossFn has the formulas).
_LOSS_FNS: Dict[str, pb.LossFn] = {
    "cross_entropy": pb.LOSS_FN_CROSS_ENTROPY,
    "importance_sampling": pb.LOSS_FN_IMPORTANCE_SAMPLING,
    "ppo": pb.LOSS_FN_PPO,
    "cispo": pb.LOSS_FN_CISPO,
    "dro": pb.LOSS_FN_DRO,
}

# A LoRA adapter argument: a rank, a dict of LoraConfig fields, a
# pb.LoraConfig or results.LoraConfig (ModelInfo.lora), or None (no adapter).
LoraLike = Union[None, int, Dict[str, Any], pb.LoraConfig, LoraConfig]


class TrainingClient:
    """A model's training calls. Thread-safe; results come as futures."""

    def __init__(self, target: str, model_id: str,
                 token: Optional[str] = None, tls: TlsLike = None, *,
                 timeout: float = 600.0, retry: Optional[RetryPolicy] = None,
                 channel: Optional[grpc.Channel] = None,
                 first_seq_id: Optional[int] = None,
                 pending_window: str = "refuse",
                 server: Optional[ServerClient] = None) -> None:
        """`target`, `token`, `tls`, `timeout`, `retry`, `channel`: the
        connection, as ServerClient's; `server`: use this ServerClient's
        connection instead (the others are then ignored, and close() leaves
        it open; ServerClient.training_client does this).
        `first_seq_id`: the seq_id of the first mutating call (default: the
        model's next_seq_id when the server reports one, else 1).
        `pending_window`: what the first mutating call does when the model
        already has a pending window that this client did not send (calls
        accumulated by another client, or restored by --resume): "refuse"
        raises PendingWindowError (nothing is sent), "abort" discards it
        (AbortAccumulation first), "continue" adds to it."""
        if pending_window not in ("refuse", "abort", "continue"):
            raise ValueError("pending_window must be 'refuse', 'abort' or "
                             f"'continue', not {pending_window!r}")
        self._on_pending_window = pending_window
        self.model_id = model_id
        self._owns_server = server is None
        self.server = server or ServerClient(target, token, tls,
                                             timeout=timeout, retry=retry,
                                             channel=channel)
        self._lock = threading.Lock()
        self._next_seq_id = first_seq_id
        # Set once the first mutating call took its seq_id.
        self._attached = first_seq_id is not None
        # Set when a sequenced call ended ABORTED: the server may or may not
        # have used its seq_id (an OptimStep on a poisoned window did; a
        # request aborted by a gap did not), so the next seq_id comes from
        # the server's next_seq_id.
        self._resync_seq_id = False
        # Futures of the calls made since the last window-closing call.
        self._in_flight: List[Future] = []
        # The last window-closing call, which later calls wait for when the
        # server does not order requests by seq_id.
        self._closing: Optional[Future] = None

    # ---- model management (not sequenced) --------------------------------

    def create_model(self, **fields: Any) -> ModelInfo:
        """CreateModel for this model id; `fields` as in CreateModelRequest
        (config, default_adam and lora may be dicts, or the typed values of
        another model's ModelInfo). Blocks; returns its ModelInfo.

        `lora` makes the model a LoRA adapter over a frozen base (built
        from init_checkpoint, or from config and seed, in dtype) that every
        adapter of the same base shares: a dict of LoraConfig fields, a
        pb.LoraConfig, or an int (the rank, everything else default):

            client.create_model(init_checkpoint="/data/Qwen3-0.6B",
                                lora={"rank": 16, "alpha": 32,
                                      "train_unembed": False})

        ModelInfo.lora echoes the adapter, ModelInfo.base names the shared
        base, trainable_parameters counts the adapter's parameters.

        `dtype` takes the spellings of tally_client.dtypes ("bf16",
        "float32", pb.DTYPE_BFLOAT16, ...); another is a ValueError naming
        them."""
        fields = {name: value.raw if isinstance(value, TypedMessage) else value
                  for name, value in fields.items()}
        if "dtype" in fields:
            fields["dtype"] = parse_dtype(fields["dtype"], "dtype")
        if isinstance(fields.get("config"), dict):
            fields["config"] = pb.ModelConfig(**fields["config"])
        if isinstance(fields.get("default_adam"), dict):
            fields["default_adam"] = pb.AdamParams(**fields["default_adam"])
        if "lora" in fields:
            lora = lora_config(fields.pop("lora"))
            if lora is not None:
                fields["lora"] = lora
        request = pb.CreateModelRequest(model_id=self.model_id, **fields)
        return ModelInfo.from_proto(
            self._call("CreateModel", request, retryable=False).result())

    def server_info(self) -> ServerInfo:
        """GetServerInfo (kept here for older callers: ServerClient has it
        too)."""
        return self.server.server_info()

    def get_model(self) -> ModelInfo:
        """GetModel: this model's ModelInfo."""
        return ModelInfo.from_proto(self._call(
            "GetModel", pb.GetModelRequest(model_id=self.model_id),
            retryable=True).result())

    def delete_model(self) -> DeleteResult:
        """DeleteModel: deletes this model; the result holds the model as
        it was."""
        return DeleteResult.from_proto(self._call(
            "DeleteModel", pb.DeleteModelRequest(model_id=self.model_id),
            retryable=False).result())

    # ---- training (sequenced) --------------------------------------------

    def forward_backward(
            self, samples: Sequence[SampleLike],
            reduction: Union[str, pb.LossReduction] = "token_mean",
            forward_only: bool = False, return_logprobs: bool = False,
            loss_fn: Union[str, pb.LossFn] = "cross_entropy",
            loss_fn_config: Optional[Dict[str, float]] = None
    ) -> Future[ForwardBackwardResult]:
        """Future of a ForwardBackwardResult. `samples`: pb.Sample objects,
        tuples or dicts of samples.sample()'s arguments, with tokens and
        per-token values as lists, numpy arrays or torch tensors.
        `reduction`: "token_mean", "sample_mean", "sum" or a
        pb.LossReduction. `forward_only`: losses (and logprobs) only, nothing
        accumulates. `return_logprobs`: each SampleResult carries its
        per-token logprobs and token_losses. `loss_fn`: "cross_entropy",
        "importance_sampling", "ppo", "cispo", "dro" (Tinker's losses; the
        RL ones read each sample's advantages and sampling_logprobs) or a
        pb.LossFn. `loss_fn_config`: the loss's hyperparameters by name,
        e.g. {"clip_low_threshold": 0.9} for "ppo", {"beta": 0.05} for
        "dro"."""
        request = pb.ForwardBackwardRequest(
            model_id=self.model_id, samples=to_samples(samples),
            reduction=_enum_value(_REDUCTIONS, reduction, "reduction"),
            forward_only=forward_only, return_logprobs=return_logprobs,
            loss_fn=_enum_value(_LOSS_FNS, loss_fn, "loss_fn"),
            loss_fn_config=loss_fn_config or {})
        return self._send_sequenced("ForwardBackward", request,
                                    ForwardBackwardResult.from_proto,
                                    in_window=True)

    def optim_step(self, adam: Optional[Dict[str, Any]] = None,
                   max_grad_norm: Optional[float] = None,
                   **fields: Any) -> Future[OptimStepResult]:
        """Future of an OptimStepResult. `adam`: a dict of AdamParams fields
        (unset ones: the model's defaults); `max_grad_norm` None: the model's
        default, 0: no clipping."""
        request = pb.OptimStepRequest(model_id=self.model_id, **fields)
        if adam:
            request.adam.CopyFrom(pb.AdamParams(**adam))
        if max_grad_norm is not None:
            request.max_grad_norm = max_grad_norm
        return self._close_window("OptimStep", request,
                                  OptimStepResult.from_proto)

    def abort_window(self) -> Future[AbortResult]:
        """Future of an AbortResult: discards the pending window."""
        return self._close_window(
            "AbortAccumulation",
            pb.AbortAccumulationRequest(model_id=self.model_id),
            AbortResult.from_proto)

    def save(self, path: str, allow_pending: bool = False, *,
             ttl_seconds: int = 0) -> Future[SaveResult]:
        """Future of a SaveResult (path: a server-side directory):
        the weights, optimizer state and step. With a pending window the
        server refuses it (FAILED_PRECONDITION; the window stays as it
        was), unless `allow_pending`: then it saves the state every earlier
        optim_step produced, without the window's gradients, and the window
        stays pending for the next optim_step (Tinker's save_state; the
        result's unsaved_* fields count what the checkpoint lacks).
        `path` may be a handle (tally://...) of an earlier save.
        `ttl_seconds` > 0: the server deletes the checkpoint that long after
        the save (it needs --checkpoint-root). The result's `handle` is what
        download(), list_checkpoints() and load() take."""
        request = pb.SaveCheckpointRequest(model_id=self.model_id, path=path,
                                           allow_pending=allow_pending,
                                           ttl_seconds=ttl_seconds)
        if allow_pending:
            return self._send_sequenced("SaveCheckpoint", request,
                                        SaveResult.from_proto,
                                        in_window=False)
        return self._close_window("SaveCheckpoint", request,
                                  SaveResult.from_proto)

    def export_weights(self, path: str, dtype: DTypeLike = None,
                       merge: bool = False, *,
                       ttl_seconds: int = 0) -> Future[ExportResult]:
        """Future of an ExportResult: writes the weights every
        earlier optim_step produced to the server-side directory `path` for
        inference (Tinker's save_weights_for_sampler): a full model as an HF
        model directory; a LoRA model as a PEFT adapter directory
        (adapter_config.json + adapter_model.safetensors, for PEFT or
        vLLM's --lora-modules over the base), or with `merge` as an HF model
        directory of its base with the adapter merged in (W + alpha / rank *
        B A). `merge` on a model without an adapter is INVALID_ARGUMENT.
        `dtype`: a spelling of tally_client.dtypes ("bf16", "float16",
        ...), a pb.DType, or None for the model's. Weights only: it neither
        waits for nor closes the pending window, and its failure does not
        abort the window. `ttl_seconds` and the result's `handle` as
        save()'s."""
        request = pb.ExportWeightsRequest(
            model_id=self.model_id, path=path,
            dtype=parse_dtype(dtype, "dtype"),
            merge=bool(merge), ttl_seconds=ttl_seconds)
        return self._send_sequenced("ExportWeights", request,
                                    ExportResult.from_proto, in_window=False)

    def load(self, path: str, load_optimizer: bool = True
             ) -> Future[LoadResult]:
        """Future of a LoadResult; discards the pending window."""
        return self._close_window(
            "LoadCheckpoint",
            pb.LoadCheckpointRequest(model_id=self.model_id, path=path,
                                     load_optimizer=load_optimizer),
            LoadResult.from_proto)

    # ---- sampling --------------------------------------------------------

    def sample(self, prompts: Sequence[TokensLike], num_samples: int = 1, *,
               max_tokens: int, temperature: Optional[float] = 1.0,
               top_p: Optional[float] = None, top_k: Optional[int] = None,
               stop: StopLike = None, seed: Optional[int] = None,
               include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0,
               sequenced: bool = True,
               sampler: Optional[str] = None) -> Future[SamplingResult]:
        """Future of a SamplingResult: `num_samples` completions of each of
        `prompts` (lists of token ids, numpy arrays or torch tensors), from
        the weights after the model's last optim_step (a pending window is
        neither seen nor changed). `max_tokens` >= 1 per completion;
        `temperature` 0: greedy; `top_p` in (0, 1], `top_k` >= 1 or -1
        (None: off); `stop`: None for the model's EOS ids
        (ModelInfo.eos_token_ids), else stop token ids and token-id
        sequences (tally_client.sampling; [] : only max_tokens); `seed`
        None: the server picks one (SamplingResult.seed). Each sequence's
        logprobs are of the raw logits, before temperature, top-k and top-p.
        `include_prompt_logprobs` / `topk_prompt_logprobs` k > 0 add each
        prompt's logprobs / its k most probable tokens per position.

        `sequenced` (default): the call takes the next seq_id, so it sees
        every optim_step made before it on this client, and it belongs to
        no window (like export_weights). False: seq_id 0, for a model that
        another client trains (a seq_id of this client would break that
        client's sequence): it samples the weights of the last step the
        server finished.

        `sampler`: the name of a snapshot save_weights_for_sampler made, to
        sample its frozen weights instead (SamplingResult.step is its
        step)."""
        request = sample_request(
            self.model_id, prompts, num_samples=num_samples,
            max_tokens=max_tokens, temperature=temperature, top_p=top_p,
            top_k=top_k, stop=stop, seed=seed,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs, sampler=sampler)
        return self._send_read("Sample", request, SamplingResult.from_proto,
                               sequenced)

    def compute_logprobs(self, prompts: Sequence[TokensLike], topk: int = 0,
                         *, sequenced: bool = True,
                         sampler: Optional[str] = None
                         ) -> Future[LogprobsResult]:
        """Future of a LogprobsResult: each prompt's log p(prompt[i + 1] |
        prompt[0..i]) (one fewer than its tokens), and with `topk` > 0 the
        k most probable tokens at each of those positions, from the same
        weights as sample(). `sequenced` and `sampler` as sample's."""
        return self._send_read(
            "ComputeLogprobs",
            logprobs_request(self.model_id, prompts, topk, sampler),
            LogprobsResult.from_proto, sequenced)

    # ---- artifacts --------------------------------------------------------

    def list_checkpoints(self) -> ArtifactList:
        """This model's checkpoints and exports (ServerClient's
        list_checkpoints for its id)."""
        return self.server.list_checkpoints(self.model_id)

    def delete_checkpoint(self, handle: str) -> CheckpointDeleted:
        """Deletes the checkpoint or export `handle` (a SaveResult's or
        ExportResult's .handle)."""
        return self.server.delete_checkpoint(handle)

    def download(self, handle: str, local_dir: str,
                 progress: ProgressLike = True) -> List[ArtifactFile]:
        """Downloads `handle` into `local_dir`, resuming and verifying
        checksums (ServerClient.download)."""
        return self.server.download(handle, local_dir, progress)

    # ---- sampler snapshots ------------------------------------------------

    def save_weights_for_sampler(self, name: str) -> Future[SamplerInfo]:
        """Future of a SamplerInfo: freezes the weights every earlier
        optim_step produced as the sampler snapshot `name` (unique per
        model: AlreadyExistsError on a repeat), which sample(sampler=name)
        and compute_logprobs(sampler=name) read whatever later steps do. A
        LoRA model's copies its adapter alone. It holds server memory
        (ResourceExhaustedError when it does not fit) until delete_sampler
        or delete_model. Sequenced like export_weights, outside any
        window: a retry is answered from the server's cache."""
        request = pb.SaveWeightsForSamplerRequest(model_id=self.model_id,
                                                  name=name)
        return self._send_sequenced("SaveWeightsForSampler", request,
                                    SamplerInfo.from_proto, in_window=False)

    def list_samplers(self) -> List[SamplerInfo]:
        """ListSamplers: this model's sampler snapshots, by name."""
        response = self._call(
            "ListSamplers", pb.ListSamplersRequest(model_id=self.model_id),
            retryable=True).result()
        return [SamplerInfo.from_proto(info) for info in response.samplers]

    def delete_sampler(self, name: str) -> SamplerInfo:
        """DeleteSampler: deletes the snapshot `name`, freeing its memory;
        NotFoundError naming it when absent."""
        return SamplerInfo.from_proto(self._call(
            "DeleteSampler",
            pb.DeleteSamplerRequest(model_id=self.model_id, name=name),
            retryable=False).result())

    def pending_window(self) -> Tuple[int, int, int]:
        """(calls, tokens, samples) accumulated on the server for this
        model and not yet stepped, whoever sent them."""
        info = self.get_model()
        return (info.accumulated_calls, info.accumulated_tokens,
                info.accumulated_samples)

    def close(self) -> None:
        """Closes the connection, unless it is a ServerClient passed in."""
        if self._owns_server:
            self.server.close()

    def __enter__(self) -> "TrainingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------

    def _take_seq_id(self) -> int:
        """The next seq_id; the caller holds self._lock."""
        if self._resync_seq_id:
            self._resync_seq_id = False
            self._next_seq_id = None
        if self._next_seq_id is None:
            attaching = not self._attached
            self._next_seq_id = self._server_next_seq_id(attaching)
        self._attached = True
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        return seq_id

    def _server_next_seq_id(self, attaching: bool) -> int:
        """The server's next_seq_id; when `attaching` (this client's first
        mutating call), first settles a pending window it did not send."""
        try:
            info = self._call("GetModel",
                              pb.GetModelRequest(model_id=self.model_id),
                              retryable=True).result()
        except TallyError as error:
            if isinstance(error, NotFoundError):
                return 1
            raise
        # Servers without exactly-once sequencing do not report it.
        next_seq_id = max(1, getattr(info, "next_seq_id", 0))
        if not attaching or info.accumulated_calls == 0:
            return next_seq_id
        if self._on_pending_window == "refuse":
            raise PendingWindowError(
                "attach", grpc.StatusCode.FAILED_PRECONDITION,
                f"model '{self.model_id}' has a pending window this client "
                f"did not send ({info.accumulated_calls} calls, "
                f"{info.accumulated_tokens} tokens): pass "
                f"pending_window='abort' to discard it or 'continue' to add "
                f"to it")
        if self._on_pending_window == "abort":
            self._call("AbortAccumulation", pb.AbortAccumulationRequest(
                model_id=self.model_id, seq_id=next_seq_id),
                retryable=True).result()
            return next_seq_id + 1
        return next_seq_id

    def _send_sequenced(self, method: str, request: Any,
                        convert: Callable[[Any], R],
                        in_window: bool) -> Future[R]:
        """Future of `convert` of `method(request)`'s response, under the
        next seq_id, sent at once
        (on a server that does not order by seq_id: once the last
        window-closing call has finished). `in_window`: the call belongs
        to the pending window, so the window-closing call waits for it and
        an OptimStep after its failure aborts the window instead."""
        result: Future[R] = Future()
        with self._lock:
            request.seq_id = self._take_seq_id()
            closing = self._closing
            if in_window:
                self._in_flight.append(result)

        def send() -> None:
            _chain(self._call_sequenced(method, request), result, convert)

        _when_all_done([] if closing is None else [closing], send)
        return result

    def _send_read(self, method: str, request: Any,
                   convert: Callable[[Any], R], sequenced: bool) -> Future[R]:
        """Future of `convert` of read-only `method(request)`: under the
        next seq_id outside any window when `sequenced`, else unsequenced
        (seq_id 0, sent at once, retried like any read)."""
        if sequenced:
            return self._send_sequenced(method, request, convert,
                                        in_window=False)
        result: Future[R] = Future()
        _chain(self._call(method, request, retryable=True), result, convert)
        return result

    def _close_window(self, method: str, request: Any,
                      convert: Callable[[Any], R]) -> Future[R]:
        """Sends `request` once every call in flight has finished; the
        future's result is `convert` of the response. An
        OptimStep after a call that failed for good aborts the window instead,
        under the step's seq_id (the sequence must stay gap-free). The next
        window waits for this call too, but only counts it as a failed call
        of its own when the window it leaves behind cannot be stepped (see
        _left_behind): a refused closing call (a bad hyperparameter, a
        checkpoint path that does not load, a save with a pending window)
        leaves the window as it was, and the client goes on with it."""
        result: Future[R] = Future()
        # Done when this call is; failed only if the window it leaves behind
        # must be aborted before the next OptimStep.
        left: Future = Future()
        with self._lock:
            request.seq_id = self._take_seq_id()
            earlier, self._in_flight = self._in_flight, [left]
            if not SERVER_ORDERS_BY_SEQ_ID:
                self._closing = result

        def send() -> None:
            failed = [error for error in (f.exception() for f in earlier)
                      if error is not None]
            if failed and method == "OptimStep":
                self._abort_instead(request, failed[0], result, left)
                return
            sent = self._call_sequenced(method, request)
            _chain(sent, result, convert)
            sent.add_done_callback(
                lambda f: _left_behind(f, failed[0] if failed else None, left))

        _when_all_done(earlier, send)
        return result

    def _abort_instead(self, step: pb.OptimStepRequest, cause: BaseException,
                       result: Future[Any], left: Future) -> None:
        """Aborts the window under OptimStep `step`'s seq_id; `result` (the
        step's future) raises WindowAbortedError naming `cause`, the failed
        call of the window. `left` fails only if the abort did too (the
        window is still there, failed call and all)."""
        abort = pb.AbortAccumulationRequest(model_id=self.model_id,
                                            seq_id=step.seq_id)
        aborted = self._call_sequenced("AbortAccumulation", abort)

        def done(f: Future) -> None:
            if f.exception() is not None:
                left.set_exception(f.exception())
                result.set_exception(f.exception())
                return
            left.set_result(None)
            result.set_exception(WindowAbortedError(
                "OptimStep", grpc.StatusCode.ABORTED,
                f"not sent: an earlier call failed ({cause}); the window was "
                f"aborted"))

        aborted.add_done_callback(done)

    def _call_sequenced(self, method: str, request: Any) -> Future:
        """Future of sequenced `method(request)`, retried like _call. A call
        that fails for good without using its seq_id on the server (refused
        by the server's request validation, its retries spent before it
        ran) would leave a gap that holds back every later call until the
        server's gap timeout poisons the window; so before the failure is
        reported, the seq_id is filled (_fill_unused_seq_id). ABORTED needs
        no filling: the client takes its next seq_id from the server."""
        result: Future = Future()

        def done(call: Future) -> None:
            error = call.exception()
            if error is None:
                result.set_result(call.result())
            elif isinstance(error, AbortedError):
                result.set_exception(error)
            else:
                self._fill_unused_seq_id(request.seq_id).add_done_callback(
                    lambda _: result.set_exception(error))

        self._call(method, request, retryable=True).add_done_callback(done)
        return result

    def _fill_unused_seq_id(self, seq_id: int) -> Future:
        """Future done once `seq_id` is used on the server. If the model's
        next_seq_id is not past it, nothing ran under it (only this client
        sends it): a forward-only ForwardBackward of one token, which changes
        neither the weights nor the window, takes its place. A GetModel or
        filler that fails leaves the gap to the server's timeout."""
        filled: Future = Future()
        info = self._call("GetModel",
                          pb.GetModelRequest(model_id=self.model_id),
                          retryable=True)

        def check(f: Future) -> None:
            if f.exception() is not None or not (
                    0 < getattr(f.result(), "next_seq_id", 0) <= seq_id):
                filled.set_result(None)
                return
            filler = pb.ForwardBackwardRequest(
                model_id=self.model_id, seq_id=seq_id, forward_only=True,
                samples=[pb.Sample(input_tokens=[0], target_tokens=[0])])
            self._call("ForwardBackward", filler,
                       retryable=True).add_done_callback(
                           lambda _: filled.set_result(None))

        info.add_done_callback(check)
        return filled

    def _call(self, method: str, request: Any, retryable: bool) -> Future:
        """Future of `method(request)` (ServerClient.call). A sequenced call
        that ends ABORTED makes the next seq_id come from the server."""
        result: Future = Future()

        def done(call: Future) -> None:
            sequenced = getattr(request, "seq_id", 0) != 0
            if sequenced and isinstance(call.exception(), AbortedError):
                self._resync_seq_id = True
            _copy_outcome(call, result)

        self.server.call(method, request, retryable).add_done_callback(done)
        return result


def lora_config(lora: LoraLike) -> Optional[pb.LoraConfig]:
    """The pb.LoraConfig of `lora`: a pb.LoraConfig, a results.LoraConfig
    (a ModelInfo's lora), a dict of its fields (rank, alpha, train_attn,
    train_mlp, train_unembed, seed, init_adapter; unset train_* are true,
    alpha 0 is 32), or an int rank. None: None (no adapter, a full model).
    Unknown keys are a ValueError."""
    if lora is None:
        return None
    if isinstance(lora, pb.LoraConfig):
        return lora
    if isinstance(lora, LoraConfig):
        return lora.raw
    if isinstance(lora, bool):
        raise ValueError("lora must be a rank, a dict of LoraConfig fields or "
                         "a pb.LoraConfig, not a bool")
    if isinstance(lora, int):
        return pb.LoraConfig(rank=lora)
    if isinstance(lora, dict):
        known = pb.LoraConfig.DESCRIPTOR.fields_by_name
        unknown = sorted(set(lora) - set(known))
        if unknown:
            raise ValueError(f"unknown lora field(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(known))}")
        # None leaves a field unset (train_*: true, seed: the model's).
        return pb.LoraConfig(**{k: v for k, v in lora.items() if v is not None})
    raise ValueError(f"lora must be a rank, a dict of LoraConfig fields or a "
                     f"LoraConfig, not {type(lora).__name__}")


def _enum_value(values: Mapping[str, E], name: Union[str, E], what: str) -> E:
    """The proto enum value `values[name]` for a str `name`; any other
    `name` is taken to be the enum value itself."""
    if not isinstance(name, str):
        return name
    if name not in values:
        raise ValueError(f"unknown {what} {name!r}; valid: "
                         f"{', '.join(sorted(values))}")
    return values[name]


def _left_behind(closing: Future, earlier_failure: Optional[BaseException],
                 left: Future) -> None:
    """Completes `left` when window-closing call `closing` is done: failed,
    so that the next OptimStep aborts the window instead of stepping, if the
    server answered ABORTED (a poisoned window) or INTERNAL (the server
    poisons the window before it answers), or if `closing` failed otherwise
    and left a window behind that misses the call that failed with
    `earlier_failure`; succeeded otherwise (the window closed, or left as it
    was)."""
    error = closing.exception()
    if getattr(error, "code", None) in (grpc.StatusCode.ABORTED,
                                        grpc.StatusCode.INTERNAL):
        left.set_exception(error)
    elif error is not None and earlier_failure is not None:
        left.set_exception(earlier_failure)
    else:
        left.set_result(None)


def _copy_outcome(done: Future, target: Future,
                  convert: Callable[[Any], Any] = lambda value: value) -> None:
    """Completes `target` like the finished future `done`, its result
    passed through `convert` (whose error fails `target`)."""
    error = done.exception()
    if error is not None:
        target.set_exception(error)
        return
    try:
        value = convert(done.result())
    # Converting's error completes the future too.
    except Exception as convert_error:  # pylint: disable=broad-except
        target.set_exception(convert_error)
        return
    target.set_result(value)


def _chain(source: Future, target: Future,
           convert: Callable[[Any], Any]) -> None:
    """Completes concurrent.futures.Future `target` like `source`, its
    result passed through `convert`."""
    source.add_done_callback(lambda f: _copy_outcome(f, target, convert))


def _when_all_done(futures: Sequence[Future],
                   callback: Callable[[], None]) -> None:
    """Runs `callback()` once every future in `futures` is done (at once if
    none), on the thread that completes the last one."""
    remaining = [len(futures) + 1]
    lock = threading.Lock()

    def one_done(_: Optional[Future]) -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            callback()

    for future in futures:
        future.add_done_callback(one_done)
    one_done(None)
