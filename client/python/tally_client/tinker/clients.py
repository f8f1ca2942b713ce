"""Tinker's ServiceClient, TrainingClient and APIFuture on a tally server.

The calls, arguments and results of Tinker's Python SDK, each mapped to the
tally RPC that does the same work, through tally_client.TrainingClient: every
request takes the model's next seq_id when it is made and is sent at once,
so calls are pipelined, execute in call order, and are retried without
being applied twice.

| Tinker                                   | tally                            |
|------------------------------------------|----------------------------------|
| create_lora_training_client(base_model)  | CreateModel with lora (a LoRA    |
|                                          | adapter over the frozen base)    |
| forward_backward(data, loss_fn, config)  | ForwardBackward, return_logprobs |
| forward(data, loss_fn, config)           | ForwardBackward, forward_only    |
| forward_backward_custom(data, fn)        | forward, then cross_entropy with |
|                                          | weights -dfn/dlogprobs           |
| optim_step(AdamParams)                   | OptimStep                        |
| save_state / load_state[_with_optimizer] | SaveCheckpoint / LoadCheckpoint  |
| save_weights_for_sampler(name)           | SaveWeightsForSampler: a frozen  |
|                                          | snapshot, tally://<model>/       |
|                                          | samplers/<name>; export=True:    |
|                                          | ExportWeights (a LoRA model: a   |
|                                          | PEFT adapter directory; merge:   |
|                                          | the merged HF directory)         |
| get_info(), get_tokenizer()              | GetModel (the tokenizer: files   |
|                                          | of the base's directory)         |
| save_weights_and_get_sampling_client()   | a SamplingClient (Sample,        |
|                                          | ComputeLogprobs) of the weights  |
|                                          | being trained, in call order;    |
|                                          | with a name, of that snapshot    |

Datums become tally Samples, and results Tinker's types, in
tally_client.tinker.conversions. Losses sum over tokens as Tinker's do
(reduction "sum"); a TrainingClient
made with reduction="token_mean" or "sample_mean" has tally normalize the
gradients of a whole accumulation window at optim_step instead.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import os
import threading
import warnings
from typing import (Any, Awaitable, Callable, Dict, Iterable, List, Mapping,
                    Optional, Tuple, TypeVar)

from tally_client import client as tally
from tally_client.dtypes import DTypeLike
from tally_client.results import SaveResult
from tally_client.server import RetryPolicy, ServerClient, TlsLike
from tally_client.tinker import conversions
from tally_client.tinker.api_future import APIFuture
from tally_client.tinker.rest_client import RestClient
from tally_client.tinker.sampling_client import DEMO_MODEL, SamplingClient
from tally_client.tinker.tokenizer import load_tokenizer
from tally_client.tinker.types import (AdamParams, Datum,
                                       ForwardBackwardOutput, GetInfoResponse,
                                       GetServerCapabilitiesResponse,
                                       LoadWeightsResponse, ModelData,
                                       OptimStepResponse,
                                       SaveWeightsForSamplerResponse,
                                       SaveWeightsResponse, SupportedModel)

REDUCTIONS = ("sum", "token_mean", "sample_mean")

T = TypeVar("T")

# Where ServiceClient connects without a base_url (after $TINKER_BASE_URL).
DEFAULT_BASE_URL = "localhost:50051"

# create_lora_training_client's arguments that are LoraConfig fields.
_LORA_ARGUMENTS = ("rank", "seed", "train_attn", "train_mlp", "train_unembed")

# A custom loss: (data, logprobs per datum) -> (loss tensor, metrics).
CustomLossFn = Callable[[List[Datum], List[Any]], Tuple[Any, Dict[str, float]]]


def _in_thread(method: Callable[..., T]) -> Callable[..., Awaitable[T]]:
    """The asyncio variant of a blocking ServiceClient method: runs it in a
    thread; same parameters (inspect.signature follows __wrapped__)."""
    @functools.wraps(method)
    async def variant(self: Any, *args: Any, **kwargs: Any) -> T:
        return await asyncio.to_thread(method, self, *args, **kwargs)
    variant.__name__ = f"{method.__name__}_async"
    variant.__qualname__ = f"{method.__qualname__}_async"
    variant.__doc__ = f"{method.__name__} for asyncio."
    return variant


# How save_weights_for_sampler's handles begin.
SAMPLER_PATH_PREFIX = "tally://"


class TrainingClient:
    """One model on a tally server, driven with Tinker's TrainingClient
    calls. Made by ServiceClient; thread-safe."""

    def __init__(self, client: tally.TrainingClient, model_name: str,
                 reduction: str = "sum", *,
                 create_fields: Optional[Dict[str, Any]] = None,
                 saved_states: Optional[_SavedStates] = None,
                 tokenizer_id: Optional[str] = None) -> None:
        """`client`: the tally_client.TrainingClient of the model.
        `model_name`: the base_model it was created from. `reduction`: how
        forward_backward's losses reduce (see REDUCTIONS).
        `create_fields`: the CreateModel fields the model was made with;
        `saved_states`: the ServiceClient's record of the LoRA states saved
        (what create_training_client_from_state needs to rebuild one).
        `tokenizer_id`: the directory of the base's tokenizer files (None:
        unknown, or a base without one)."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"unknown reduction {reduction!r}; valid: "
                             f"{', '.join(REDUCTIONS)}")
        self._client = client
        self._model_name = model_name
        self._reduction = reduction
        self._create_fields = create_fields
        self._saved_states = saved_states
        self._tokenizer_id = tokenizer_id
        self.model_id = client.model_id

    # ---- forward and backward -------------------------------------------

    def forward_backward(
            self, data: Iterable[Datum], loss_fn: str,
            loss_fn_config: Optional[Dict[str, float]] = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Future of a ForwardBackwardOutput: accumulates the gradient of
        `loss_fn` ("cross_entropy", "importance_sampling", "ppo", "cispo",
        "dro") over the Datums `data` until the next optim_step.
        `loss_fn_config`: e.g. {"clip_low_threshold": 0.9,
        "clip_high_threshold": 1.1} for ppo and cispo, {"beta": 0.05} for
        dro."""
        return self._forward_backward(data, loss_fn, loss_fn_config,
                                      forward_only=False)

    def forward(
            self, data: Iterable[Datum], loss_fn: str,
            loss_fn_config: Optional[Dict[str, float]] = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Future of a ForwardBackwardOutput without gradients: the logprobs
        and losses only."""
        return self._forward_backward(data, loss_fn, loss_fn_config,
                                      forward_only=True)

    def forward_backward_custom(
            self, data: Iterable[Datum], loss_fn: CustomLossFn, *,
            loss_type_input: str = "logprobs"
    ) -> APIFuture[ForwardBackwardOutput]:
        """Future of the ForwardBackwardOutput of an arbitrary loss of the
        logprobs: `loss_fn(data, logprobs)` (one torch tensor per datum)
        returns (loss tensor, metrics). Runs forward() and waits for it,
        differentiates `loss_fn` locally, then sends cross_entropy with
        weights -d(loss)/d(logprobs), which has the same gradient. Needs
        torch. A loss that leaves a datum's logprobs without a gradient is
        a ValueError, as Tinker's. `loss_type_input`: "logprobs", the only
        input space (Tinker's too). With reduction "token_mean" or
        "sample_mean" the surrogate is normalized like any other call of the
        window."""
        data = _custom_data(data, loss_type_input)
        return self._custom_backward(
            data, loss_fn, self.forward(conversions.targets_only(data),
                                        "cross_entropy").result())

    async def forward_backward_custom_async(
            self, data: Iterable[Datum], loss_fn: CustomLossFn, *,
            loss_type_input: str = "logprobs"
    ) -> APIFuture[ForwardBackwardOutput]:
        """forward_backward_custom for asyncio."""
        data = _custom_data(data, loss_type_input)
        forward = await self.forward(conversions.targets_only(data),
                                     "cross_entropy")
        return self._custom_backward(data, loss_fn, forward)

    def _forward_backward(
            self, data: Iterable[Datum], loss_fn: str,
            loss_fn_config: Optional[Dict[str, float]],
            forward_only: bool) -> APIFuture[ForwardBackwardOutput]:
        data = list(data)
        samples = [conversions.to_sample(datum, loss_fn) for datum in data]
        call = self._client.forward_backward(
            samples, reduction=self._reduction, forward_only=forward_only,
            return_logprobs=True, loss_fn=loss_fn,
            loss_fn_config=conversions.loss_fn_config_of(data, samples,
                                                         loss_fn_config))
        return APIFuture(call, conversions.forward_backward_output)

    def _custom_backward(
            self, data: List[Datum], loss_fn: CustomLossFn,
            forward: ForwardBackwardOutput) -> APIFuture[ForwardBackwardOutput]:
        """Sends the linear surrogate of `loss_fn` at the logprobs of
        `forward`."""
        logprobs = [output["logprobs"].to_torch().requires_grad_()
                    for output in forward.loss_fn_outputs]
        loss, metrics = loss_fn(data, logprobs)
        loss.backward()
        if any(logprob.grad is None for logprob in logprobs):
            raise ValueError("forward_backward_custom: the loss computed no "
                             "gradient for some datum's logprobs (every "
                             "datum's must take part in the loss)")
        surrogate = [
            Datum(model_input=datum.model_input, loss_fn_inputs={
                "target_tokens": datum.loss_fn_inputs["target_tokens"],
                "weights": -logprob.grad})
            for datum, logprob in zip(data, logprobs)]
        call = self.forward_backward(surrogate, "cross_entropy")
        return APIFuture(call.future(), lambda output: dataclasses.replace(
            output, metrics={**output.metrics, **metrics}))

    # ---- optimizer --------------------------------------------------------

    def optim_step(self, adam_params: AdamParams
                   ) -> APIFuture[OptimStepResponse]:
        """Future of an OptimStepResponse: one AdamW step on the gradients
        accumulated since the last one, with AdamParams `adam_params` (every
        field sent, Tinker's defaults included; grad_clip_norm 0: no
        clipping). Its metrics are tally's, under "tally/" (so that they
        overwrite none of a loop's own): tally/grad_norm (before clipping),
        tally/clip_coef, tally/learning_rate, tally/step, tally/normalizer,
        tally/skipped (1 when a non-finite gradient skipped the step)."""
        call = self._client.optim_step(
            adam={"learning_rate": adam_params.learning_rate,
                  "beta1": adam_params.beta1, "beta2": adam_params.beta2,
                  "eps": adam_params.eps,
                  "weight_decay": adam_params.weight_decay},
            max_grad_norm=adam_params.grad_clip_norm)
        return APIFuture(call, conversions.optim_step_response)

    # ---- checkpoints ------------------------------------------------------

    def save_state(self, name: str, ttl_seconds: Optional[int] = None,
                   overwrite: bool = False) -> APIFuture[SaveWeightsResponse]:
        """Future of a SaveWeightsResponse: weights, optimizer state and step
        as a checkpoint at `name` (absolute, or relative: under
        <model_id>/weights/ of the server's --checkpoint-root); a LoRA
        model's holds its adapter only (the base is shared and frozen; the
        checkpoint names it, so create_training_client_from_state(path)
        rebuilds the adapter over it in any process). The response's path
        is the checkpoint's tally:// handle when the server has a
        --checkpoint-root (else its server path): load_state,
        create_training_client_from_state and the RestClient take it.
        `ttl_seconds`: the server deletes the checkpoint that long after the
        save (None: kept). `overwrite`: accepted; tally replaces a
        checkpoint of the same name whatever its value.
        As Tinker's, it saves the state at this point of the call sequence:
        forward_backward calls made before it and not yet stepped stay
        pending for the next optim_step (the checkpoint holds the weights
        and optimizer state of the steps taken, not their gradients)."""
        del overwrite  # the server replaces a checkpoint atomically
        call = self._client.save(self._path(name, "weights"),
                                 allow_pending=True,
                                 ttl_seconds=ttl_seconds or 0)

        def saved(response: SaveResult) -> SaveWeightsResponse:
            path = response.handle or response.path
            if self._saved_states is not None and self._create_fields and \
                    self._create_fields.get("lora") is not None:
                self._saved_states.record(path, self._model_name,
                                          self._create_fields)
            return SaveWeightsResponse(path=path)

        return APIFuture(call, saved)

    def load_state(self, path: str, weights_access_token: Optional[str] = None
                   ) -> APIFuture[LoadWeightsResponse]:
        """Future of a LoadWeightsResponse: weights and step from the
        checkpoint `path` (a save_state path); the optimizer restarts from
        zero moments. Discards the pending window. `weights_access_token`
        (another account's checkpoints) must be None: a tally token reads
        its own tenant's checkpoints only."""
        _no_access_token(weights_access_token)
        return self._load(path, load_optimizer=False)

    def load_state_with_optimizer(
            self, path: str, weights_access_token: Optional[str] = None
    ) -> APIFuture[LoadWeightsResponse]:
        """load_state that also restores the optimizer state."""
        _no_access_token(weights_access_token)
        return self._load(path, load_optimizer=True)

    def save_weights_for_sampler(
            self, name: str, ttl_seconds: Optional[int] = None, *,
            export: bool = False, merge: bool = False,
            dtype: DTypeLike = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Future of a SaveWeightsForSamplerResponse. By default it freezes
        the weights of every earlier optim_step as the server's sampler
        snapshot `name` (SaveWeightsForSampler; a LoRA model's adapter
        alone), and the path is its handle, tally://<model_id>/samplers/
        <name>, which ServiceClient.create_sampling_client(model_path=...)
        samples. The snapshot holds server memory until the model is
        deleted (or tally_client's delete_sampler).

        With `export` (or `merge` or `dtype`, tally's extras) it writes the
        weights for inference at `name` instead (absolute, or under
        <model_id>/sampler_weights/ of --checkpoint-root): a LoRA model a
        PEFT adapter directory (adapter_config.json +
        adapter_model.safetensors) for vLLM's --lora-modules or PEFT over
        the base model, with `merge` an HF model directory of the base with
        the adapter merged in; a fully fine-tuned model (rank=None) an HF
        model directory (`merge` is refused). `dtype`: as
        tally_client.TrainingClient.export_weights (None: the model's).
        Neither touches the pending window. `ttl_seconds` applies to an
        export (as save_state's; the response's path is then its tally://
        handle); a snapshot lives until deleted, so it is refused there."""
        if not (export or merge or dtype is not None):
            if ttl_seconds:
                raise ValueError(
                    "save_weights_for_sampler: ttl_seconds applies to an "
                    "export (export=True); a sampler snapshot lives in "
                    "server memory until delete_sampler or its model is "
                    "deleted")
            return APIFuture(self._client.save_weights_for_sampler(name),
                             lambda info: SaveWeightsForSamplerResponse(
                                 path=info.path))
        call = self._client.export_weights(
            self._path(name, "sampler_weights"), dtype=dtype, merge=merge,
            ttl_seconds=ttl_seconds or 0)
        return APIFuture(call, lambda response: SaveWeightsForSamplerResponse(
            path=response.handle or response.path))

    def _load(self, path: str,
              load_optimizer: bool) -> APIFuture[LoadWeightsResponse]:
        call = self._client.load(path, load_optimizer=load_optimizer)
        return APIFuture(call, lambda _: LoadWeightsResponse(
            path=path, model_id=self.model_id))

    def _path(self, name: str, kind: str) -> str:
        """The server-side directory for checkpoint `name` of `kind`, named
        like Tinker's tinker://<model_id>/<kind>/<name>."""
        return name if name.startswith("/") else \
            f"{self.model_id}/{kind}/{name}"

    # ---- information ------------------------------------------------------

    def get_info(self) -> GetInfoResponse:
        """A GetInfoResponse (blocks): is_lora and lora_rank from the
        model's LoraConfig, tally's whole ModelInfo as model_info."""
        info = self._client.get_model()
        lora_rank = info.lora.rank if info.lora is not None else 0
        return GetInfoResponse(
            model_data=ModelData(arch=info.config.model_type or "llama",
                                 model_name=self._model_name,
                                 tokenizer_id=self._tokenizer_id),
            model_id=info.model_id, is_lora=lora_rank > 0,
            lora_rank=lora_rank or None, model_name=self._model_name,
            model_info=info.raw)

    async def get_info_async(self) -> GetInfoResponse:
        """get_info for asyncio."""
        return await asyncio.to_thread(self.get_info)

    # ---- the *_async variants: coroutines that submit and return the
    # future, as Tinker's do -----------------------------------------------

    async def forward_backward_async(
            self, data: Iterable[Datum], loss_fn: str,
            loss_fn_config: Optional[Dict[str, float]] = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """forward_backward for asyncio."""
        return self.forward_backward(data, loss_fn, loss_fn_config)

    async def forward_async(
            self, data: Iterable[Datum], loss_fn: str,
            loss_fn_config: Optional[Dict[str, float]] = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """forward for asyncio."""
        return self.forward(data, loss_fn, loss_fn_config)

    async def optim_step_async(self, adam_params: AdamParams
                               ) -> APIFuture[OptimStepResponse]:
        """optim_step for asyncio."""
        return self.optim_step(adam_params)

    async def save_state_async(self, name: str,
                               ttl_seconds: Optional[int] = None,
                               overwrite: bool = False
                               ) -> APIFuture[SaveWeightsResponse]:
        """save_state for asyncio."""
        return self.save_state(name, ttl_seconds, overwrite)

    async def load_state_async(
            self, path: str, weights_access_token: Optional[str] = None
    ) -> APIFuture[LoadWeightsResponse]:
        """load_state for asyncio."""
        return self.load_state(path, weights_access_token)

    async def load_state_with_optimizer_async(
            self, path: str, weights_access_token: Optional[str] = None
    ) -> APIFuture[LoadWeightsResponse]:
        """load_state_with_optimizer for asyncio."""
        return self.load_state_with_optimizer(path, weights_access_token)

    async def save_weights_for_sampler_async(
            self, name: str, ttl_seconds: Optional[int] = None, *,
            export: bool = False, merge: bool = False,
            dtype: DTypeLike = None
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """save_weights_for_sampler for asyncio."""
        return self.save_weights_for_sampler(name, ttl_seconds, export=export,
                                             merge=merge, dtype=dtype)

    # ---- sampling -----------------------------------------------------------

    def save_weights_and_get_sampling_client(
            self, name: Optional[str] = None, retry_config: Any = None, *,
            tokenizer: Any = None) -> SamplingClient:
        """A SamplingClient. With `name`: of the sampler snapshot `name` it
        freezes now (save_weights_for_sampler(name); waits for it), whose
        weights later optim_steps leave as they are. Without: of this
        model's latest weights in call order: each of its calls sees every
        optim_step made before it on this TrainingClient and none made after
        (nothing is copied). `retry_config`: the ServiceClient's RetryPolicy
        applies. `tokenizer`: for string stops (see SamplingClient)."""
        del retry_config
        sampler = None
        if name is not None:
            sampler = self._client.save_weights_for_sampler(name).result().name
        return SamplingClient(self._client, self._model_name, sequenced=True,
                              tokenizer=tokenizer, sampler=sampler)

    async def save_weights_and_get_sampling_client_async(
            self, name: Optional[str] = None, retry_config: Any = None, *,
            tokenizer: Any = None) -> SamplingClient:
        """save_weights_and_get_sampling_client for asyncio."""
        return self.save_weights_and_get_sampling_client(
            name, retry_config, tokenizer=tokenizer)

    def create_sampling_client(self, model_path: str,
                               retry_config: Any = None, *,
                               tokenizer: Any = None) -> SamplingClient:
        """ServiceClient.create_sampling_client(model_path=...) on this
        client's connection; this model's own id samples it in call order,
        as save_weights_and_get_sampling_client does."""
        del retry_config
        if model_path == self.model_id:
            return self.save_weights_and_get_sampling_client(
                tokenizer=tokenizer)
        return _model_sampler(self._client.server, model_path, tokenizer)

    async def create_sampling_client_async(
            self, model_path: str, retry_config: Any = None, *,
            tokenizer: Any = None) -> SamplingClient:
        """create_sampling_client for asyncio."""
        return await asyncio.to_thread(self.create_sampling_client,
                                       model_path, retry_config,
                                       tokenizer=tokenizer)

    # ---- tokenizer and telemetry ----------------------------------------

    def get_tokenizer(self) -> Any:
        """The tokenizer of the model's base, from the tokenizer files in
        its directory (get_info().model_data.tokenizer_id), which must be
        readable here: a transformers tokenizer, or without transformers a
        tokenizers one (tally_client.tinker.tokenizer)."""
        return load_tokenizer(self.get_info().model_data.tokenizer_id)

    def get_telemetry(self) -> None:
        """None: tally keeps no client telemetry (Tinker's returns None too
        when telemetry is off)."""
        return None


class ServiceClient:
    """The entry point of Tinker's SDK on a tally server: makes
    TrainingClients, which share its gRPC channel.

        service = ServiceClient(base_url="localhost:50051")
        training = service.create_lora_training_client("/data/Qwen3-0.6B")
    """

    def __init__(self, user_metadata: Optional[Dict[str, str]] = None,
                 project_id: Optional[str] = None, *,
                 base_url: Optional[str] = None,
                 api_key: Optional[str] = None, tls: TlsLike = None,
                 timeout: float = 600.0,
                 retry: Optional[RetryPolicy] = None) -> None:
        """`user_metadata`, `project_id`: accepted as Tinker's, not stored
        (tally keeps no run metadata). `base_url` (keyword, as Tinker's;
        default: $TINKER_BASE_URL, else "localhost:50051"): "host:port",
        "grpc://host:port" or "http://host:port" (plaintext), or
        "grpcs://host:port" or "https://host:port" (TLS with the system's
        roots); tally speaks gRPC on that port. `api_key`: the bearer token
        (default: $TALLY_TOKEN, else $TINKER_API_KEY). `tls`: as
        tally_client's TrainingClient (True, a Tls, or
        grpc.ChannelCredentials). `timeout`, `retry`: per-attempt seconds
        and RetryPolicy of every call. Every call goes through the
        tally_client.ServerClient `self.server` (server_info(),
        list_models())."""
        del user_metadata, project_id  # tally keeps no run metadata
        target, url_tls = _parse_base_url(
            base_url or os.environ.get("TINKER_BASE_URL") or DEFAULT_BASE_URL)
        token = api_key if api_key is not None else (
            os.environ.get("TALLY_TOKEN") or os.environ.get("TINKER_API_KEY"))
        self.server = ServerClient(target, token,
                                   url_tls if tls is None else tls,
                                   timeout=timeout, retry=retry)
        self._saved_states = _SavedStates()

    def get_server_capabilities(self) -> GetServerCapabilitiesResponse:
        """A GetServerCapabilitiesResponse: the base_model names that need
        no checkpoint (DEMO_MODEL; any server-side HF directory works too)
        and the server's ServerInfo."""
        return GetServerCapabilitiesResponse(
            supported_models=[SupportedModel(model_name=DEMO_MODEL)],
            server_info=self.server.server_info().raw)

    def create_lora_training_client(
            self, base_model: str, rank: Optional[int] = 32,
            seed: Optional[int] = None, train_mlp: bool = True,
            train_attn: bool = True, train_unembed: bool = True,
            user_metadata: Optional[Dict[str, str]] = None, *,
            reduction: str = "sum", base_seed: Optional[int] = None,
            **create_model_fields: Any) -> TrainingClient:
        """A TrainingClient of a new LoRA model: PEFT's adapter of rank
        `rank` (alpha 32, as Tinker's) on the attention's q, k, v and o
        projections (`train_attn`), the MLP's gate, up and down projections
        (`train_mlp`) and the unembedding (`train_unembed`), over the frozen
        `base_model`, which every adapter of the same base shares on the
        server. `base_model`: a server-side HF model directory (or tally
        checkpoint), read as CreateModel's init_checkpoint, or DEMO_MODEL
        for a base the server builds (the embedded default model, or of a
        `config=` passed along, drawn with `base_seed`, default 0). `seed`:
        draws the adapter's A (B starts at zero); None: the model's seed.
        `reduction`: see TrainingClient.

        tally's extras: `rank=None` fine-tunes every parameter instead (no
        adapter; train_* must stay true). `lora={...}` adds LoraConfig
        fields the arguments do not cover: "alpha", "init_adapter" (start
        from a PEFT adapter directory or a tally adapter checkpoint).
        `create_model_fields`: more CreateModelRequest fields, e.g.
        config={"vocab_size": 32, ...} (a ModelConfig dict), dtype,
        model_id (default: the server picks one)."""
        del user_metadata
        fields = dict(create_model_fields)
        extra = fields.pop("lora", None) or {}
        if not isinstance(extra, dict):
            raise ValueError("lora= takes a dict of further LoraConfig "
                             "fields (alpha, init_adapter)")
        repeated = sorted(set(extra) & set(_LORA_ARGUMENTS))
        if repeated:
            raise ValueError(f"lora= repeats {', '.join(repeated)}: pass "
                             f"them as create_lora_training_client's "
                             f"arguments")
        if base_model != DEMO_MODEL:
            fields["init_checkpoint"] = base_model
        if base_seed is not None:
            fields["seed"] = base_seed
        if rank is None:
            if extra or not (train_mlp and train_attn and train_unembed):
                raise ValueError("rank=None fine-tunes every parameter: "
                                 "lora= and train_*=False need a rank")
            if seed is not None:
                fields.setdefault("seed", seed)
        else:
            fields["lora"] = dict(extra, rank=rank, seed=seed,
                                  train_attn=train_attn, train_mlp=train_mlp,
                                  train_unembed=train_unembed)
        return self._create(base_model, fields, reduction,
                            _tokenizer_dir(base_model))

    def create_training_client_from_state(
            self, path: str, base_model: Optional[str] = None,
            user_metadata: Optional[Dict[str, str]] = None,
            weights_access_token: Optional[str] = None, *,
            reduction: str = "sum",
            **create_model_fields: Any) -> TrainingClient:
        """A TrainingClient of a new model with the weights and step of the
        tally checkpoint `path` (a save_state path); the optimizer starts
        from zero moments. `base_model`: the name get_info() reports
        (default: the state's base when this ServiceClient saved it, else
        `path`); `weights_access_token` must be None (see load_state).
        `create_model_fields` as create_lora_training_client's (dtype= for
        a bfloat16 model's checkpoint).

        A LoRA state holds the adapter only and names its base: the server
        rebuilds the adapter over that base (shared when in memory, else
        read, its identity checked: FailedPreconditionError naming a base
        changed since the save) from `path` alone, in any process. `path`
        may be a tally:// handle."""
        del user_metadata
        _no_access_token(weights_access_token)
        client = self._create_from_state(path, base_model,
                                         create_model_fields, reduction)
        client.load_state(path).result()
        return client

    def create_training_client_from_state_with_optimizer(
            self, path: str, base_model: Optional[str] = None,
            user_metadata: Optional[Dict[str, str]] = None,
            weights_access_token: Optional[str] = None, *,
            reduction: str = "sum",
            **create_model_fields: Any) -> TrainingClient:
        """create_training_client_from_state that also restores the
        optimizer state."""
        del user_metadata
        _no_access_token(weights_access_token)
        client = self._create_from_state(path, base_model,
                                         create_model_fields, reduction)
        client.load_state_with_optimizer(path).result()
        return client

    async def get_server_capabilities_async(
            self) -> GetServerCapabilitiesResponse:
        """get_server_capabilities for asyncio."""
        return await asyncio.to_thread(self.get_server_capabilities)

    create_lora_training_client_async = _in_thread(
        create_lora_training_client)
    create_training_client_from_state_async = _in_thread(
        create_training_client_from_state)
    create_training_client_from_state_with_optimizer_async = _in_thread(
        create_training_client_from_state_with_optimizer)

    def create_sampling_client(
            self, model_path: Optional[str] = None,
            base_model: Optional[str] = None, retry_config: Any = None, *,
            tokenizer: Any = None,
            **create_model_fields: Any) -> SamplingClient:
        """A SamplingClient (no saved directory can be sampled):

        - `model_path`: the model_id of a model on the server (a
          TrainingClient's model_id): samples the weights of the last
          optim_step the server finished on it, with unsequenced calls that
          leave the sequence of the client training it alone (to sample in
          call order, use that TrainingClient's
          save_weights_and_get_sampling_client). Or a sampler snapshot's
          handle, tally://<model_id>/samplers/<name> (what
          save_weights_for_sampler returns): samples its frozen weights
          (NotFoundError naming it when absent). A path (a save_state or
          save_weights_for_sampler directory) is a ValueError: load it with
          create_training_client_from_state and sample that model. An
          unknown model_id raises NotFoundError.
        - `base_model`: the untrained base, as create_lora_training_client
          takes it (a server-side HF directory, or DEMO_MODEL with
          `create_model_fields` such as config= and base_seed=): the client
          creates a LoRA adapter of rank 1 on the attention with B = 0,
          which computes exactly the base and shares it with the other
          adapters of that base, and deletes it on close().

        `retry_config`: the ServiceClient's RetryPolicy applies.
        `tokenizer`: for string stops (see SamplingClient)."""
        del retry_config
        if (model_path is None) == (base_model is None):
            raise ValueError("create_sampling_client takes one of model_path "
                             "(a model_id on the server) or base_model")
        if model_path is not None:
            if create_model_fields:
                raise ValueError("create_sampling_client(model_path=...) "
                                 "creates no model: it takes no CreateModel "
                                 "fields")
            return _model_sampler(self.server, model_path, tokenizer)
        assert base_model is not None
        base_seed = create_model_fields.pop("base_seed", None)
        training = self.create_lora_training_client(
            base_model, rank=1, train_mlp=False, train_unembed=False,
            base_seed=base_seed, **create_model_fields)
        client = training._client  # pylint: disable=protected-access
        return SamplingClient(client, base_model, sequenced=True,
                              tokenizer=tokenizer, owns_model=True)

    async def create_sampling_client_async(
            self, model_path: Optional[str] = None,
            base_model: Optional[str] = None, retry_config: Any = None, *,
            tokenizer: Any = None,
            **create_model_fields: Any) -> SamplingClient:
        """create_sampling_client for asyncio."""
        return await asyncio.to_thread(
            self.create_sampling_client, model_path, base_model, retry_config,
            tokenizer=tokenizer, **create_model_fields)

    def get_telemetry(self) -> None:
        """None: tally keeps no client telemetry."""
        return None

    def create_rest_client(self) -> RestClient:
        """A RestClient: Tinker's checkpoint calls (list, delete, download)
        over tally's artifact RPCs (the server needs --checkpoint-root)."""
        return RestClient(self.server)

    def close(self) -> None:
        """Closes the channel every TrainingClient of this ServiceClient
        uses."""
        self.server.close()

    def __enter__(self) -> "ServiceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self, model_name: str, fields: Dict[str, Any],
                reduction: str, tokenizer_id: Optional[str]) -> TrainingClient:
        """A TrainingClient of a model made by CreateModel(`fields`), whose
        tokenizer files are in directory `tokenizer_id` (None: unknown)."""
        fields = dict(fields)
        model_id = fields.pop("model_id", "")
        info = self.server.training_client(model_id).create_model(
            **copy.deepcopy(fields))
        # A new model executes seq_id 1 first: no GetModel on the first call.
        return TrainingClient(
            self.server.training_client(
                info.model_id, first_seq_id=max(1, info.next_seq_id)),
            model_name, reduction, create_fields=fields,
            saved_states=self._saved_states,
            tokenizer_id=tokenizer_id)

    def _create_from_state(self, path: str, base_model: Optional[str],
                           create_model_fields: Dict[str, Any],
                           reduction: str) -> TrainingClient:
        """The model a load of state `path` fits: a LoRA state this
        ServiceClient saved is an adapter of the same base and LoraConfig
        (its first values: the state, loaded again right after for the
        step and optimizer; its model name and tokenizer known), anything
        else a model with init_checkpoint `path` (which the server rebuilds
        over its base when it is a LoRA state)."""
        known = self._saved_states.get(path)
        if known is None or "lora" in create_model_fields:
            return self._create(base_model or path,
                                {"init_checkpoint": path,
                                 **create_model_fields}, reduction,
                                tokenizer_id=base_model)
        model_name, fields = known
        model_name = base_model or model_name
        fields = dict(fields, **create_model_fields)
        lora = fields["lora"]
        fields["lora"] = dict(lora) if isinstance(lora, dict) else \
            tally.lora_config(lora)
        if isinstance(fields["lora"], dict):
            fields["lora"]["init_adapter"] = path
        else:
            fields["lora"] = copy.deepcopy(fields["lora"])
            fields["lora"].init_adapter = path
        return self._create(model_name, fields, reduction,
                            _tokenizer_dir(model_name))

class _SavedStates:
    """The LoRA states a ServiceClient's TrainingClients saved: server path
    -> (model name, CreateModel fields), which rebuild the adapter's model
    (its checkpoint holds the adapter, not the base). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._states: Dict[str, Tuple[str, Dict[str, Any]]] = {}

    def record(self, path: str, model_name: str,
               fields: Mapping[str, Any]) -> None:
        fields = {k: v for k, v in fields.items() if k != "model_id"}
        with self._lock:
            self._states[path] = (model_name, copy.deepcopy(fields))

    def get(self, path: str) -> Optional[Tuple[str, Dict[str, Any]]]:
        with self._lock:
            known = self._states.get(path)
        return None if known is None else (known[0], copy.deepcopy(known[1]))


def _model_sampler(server: ServerClient, model_path: str,
                   tokenizer: Any) -> SamplingClient:
    """An unsequenced SamplingClient of `model_path` on `server`: a model_id,
    or a sampler snapshot's handle tally://<model_id>/samplers/<name> (what
    save_weights_for_sampler returns). The model's existence is checked
    (NotFoundError otherwise); a snapshot's when sampled."""
    model_id, sampler = model_path, None
    if model_path.startswith(SAMPLER_PATH_PREFIX):
        model_id, kind, sampler = \
            model_path[len(SAMPLER_PATH_PREFIX):].partition("/samplers/")
        if not kind or not model_id or not sampler or "/" in sampler:
            raise ValueError(
                f"model_path {model_path!r}: a sampler snapshot's handle is "
                f"tally://<model_id>/samplers/<name>")
    if "/" in model_id or "://" in model_id:
        raise ValueError(
            f"model_path {model_path!r}: tally samples a model on the server "
            f"(its model_id) or a sampler snapshot (tally://<model_id>/"
            f"samplers/<name>), not a saved directory; load the directory "
            f"with create_training_client_from_state(path) and sample that "
            f"model")
    client = server.training_client(model_id)
    info = client.get_model()
    return SamplingClient(client, info.base or model_id, sequenced=False,
                          tokenizer=tokenizer, sampler=sampler)


def _parse_base_url(base_url: str) -> Tuple[str, Optional[bool]]:
    """(gRPC target, TLS default) of a base_url."""
    scheme, separator, target = base_url.partition("://")
    if not separator:
        return base_url, None
    if scheme in ("grpc", "grpcs", "http", "https"):
        return target.rstrip("/"), scheme in ("grpcs", "https") or None
    raise ValueError(f"base_url {base_url!r}: tally speaks gRPC; give "
                     f"host:port, grpc://host:port or grpcs://host:port")


def _no_access_token(weights_access_token: Optional[str]) -> None:
    if weights_access_token is not None:
        raise ValueError("weights_access_token: tally reads the checkpoints "
                         "of the caller's own tenant only; pass None")


def _tokenizer_dir(base_model: str) -> Optional[str]:
    """Where the tokenizer files of `base_model` are: its directory, none
    for DEMO_MODEL."""
    return None if base_model == DEMO_MODEL else base_model


def _custom_data(data: Iterable[Datum], loss_type_input: str) -> List[Datum]:
    """`data` as a list, for a custom loss of input `loss_type_input`."""
    if loss_type_input != "logprobs":
        raise ValueError(f"loss_type_input {loss_type_input!r}: the only "
                         f"supported value is 'logprobs'")
    return list(data)
