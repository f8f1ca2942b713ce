"""Tinker's SamplingClient on a tally server: completions and prompt
log-probabilities from the weights a model is training, in the same server
process (tally's Sample and ComputeLogprobs), with no weight transfer and no
sampler-trainer numeric gap.

    sampler = training_client.save_weights_and_get_sampling_client()
    result = sampler.sample(types.ModelInput.from_ints([1, 2, 3]),
                            num_samples=4,
                            sampling_params=types.SamplingParams(
                                max_tokens=16, temperature=0.7,
                                stop=[eos_id])).result()
    for sequence in result.sequences:
        print(sequence.tokens, sequence.logprobs, sequence.stop_reason)

Which weights a SamplingClient reads:
- from TrainingClient.save_weights_and_get_sampling_client(): the training
  model's latest weights in call order: each sample sees every optim_step
  made before it on that TrainingClient, and none made after.
- from save_weights_and_get_sampling_client(name), or
  ServiceClient.create_sampling_client(model_path=<the tally://<model_id>/
  samplers/<name> handle save_weights_for_sampler(name) returns>): the
  sampler snapshot `name`, frozen on the server when it was saved; later
  optim_steps do not change it.
- from ServiceClient.create_sampling_client(model_path=model_id): the
  weights of the last optim_step the server finished on that model (the
  calls are unsequenced, so that they never disturb the sequence of the
  client that trains it).
- from ServiceClient.create_sampling_client(base_model=...): an untrained
  model of that base that the client creates (an adapter with B = 0 over the
  shared base, so exactly the base's outputs) and deletes on close().

A string stop needs a tokenizer: the one given (SamplingClient(tokenizer=
...), or the `tokenizer=` of the calls that make one), else get_tokenizer()'s
(the base directory's files, readable where the client runs); without
either, sample() raises ValueError before anything is sent.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from tally_client import client as tally
from tally_client.results import SamplingResult, StopReason
from tally_client.sampling import StopLike
from tally_client.tinker.api_future import APIFuture
from tally_client.tinker.tokenizer import load_tokenizer
from tally_client.tinker.types import (ModelInput, SampledSequence,
                                       SampleResponse, SamplingParams)
from tally_client.tinker.types import StopReason as TinkerStopReason

# The base_model that names no checkpoint: the server builds the model, as
# the embedded default (a small byte-level Llama) or of the `config` passed.
DEMO_MODEL = "tally/demo"

# Tinker's stop reasons by tally's.
_STOP_REASONS: Dict[int, TinkerStopReason] = {StopReason.LENGTH: "length",
                                              StopReason.STOP: "stop"}


class SamplingClient:
    """Samples one model of a tally server with Tinker's SamplingClient
    calls. Made by ServiceClient.create_sampling_client or
    TrainingClient.save_weights_and_get_sampling_client; thread-safe."""

    def __init__(self, client: tally.TrainingClient, base_model: str, *,
                 sequenced: bool, tokenizer: Any = None,
                 owns_model: bool = False,
                 sampler: Optional[str] = None) -> None:
        """`client`: the tally_client.TrainingClient of the model sampled.
        `base_model`: what get_base_model() answers. `sequenced`: each call
        takes the client's next seq_id (it sees every optim_step made
        before it on `client`); False: unsequenced (the last step the
        server finished). `tokenizer`: anything with
        encode(text, add_special_tokens=False) (a transformers tokenizer),
        for string stops. `owns_model`: close() deletes the model.
        `sampler`: the model's sampler snapshot to read (None: the live
        weights)."""
        self._client = client
        self._base_model = base_model
        self._sequenced = sequenced
        self._tokenizer = tokenizer
        self._owns_model = owns_model
        self._sampler = sampler
        self.model_id = client.model_id

    def sample(self, prompt: ModelInput, num_samples: int,
               sampling_params: SamplingParams,
               include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0) -> APIFuture[SampleResponse]:
        """Future of a SampleResponse: `num_samples` completions of `prompt`
        drawn as `sampling_params` says, each token with its logprob before
        temperature, top-k and top-p. `include_prompt_logprobs`: also the
        prompt's logprobs (None first); `topk_prompt_logprobs` k > 0: also
        the k most probable tokens at each prompt position. A bad
        parameter the client can see (no max_tokens, a string stop without
        a tokenizer) is a ValueError; one the server refuses comes back as
        InvalidArgumentError naming the field."""
        if sampling_params.max_tokens is None:
            raise ValueError("sampling_params.max_tokens: tally needs the "
                             "most tokens per sequence (>= 1)")
        call = self._client.sample(
            [prompt.to_ints()], num_samples,
            max_tokens=sampling_params.max_tokens,
            temperature=sampling_params.temperature,
            top_p=sampling_params.top_p, top_k=sampling_params.top_k,
            stop=self._stop(sampling_params.stop), seed=sampling_params.seed,
            include_prompt_logprobs=include_prompt_logprobs,
            topk_prompt_logprobs=topk_prompt_logprobs,
            sequenced=self._sequenced, sampler=self._sampler)
        return APIFuture(call, lambda response: _sample_response(
            response, include_prompt_logprobs, topk_prompt_logprobs))

    async def sample_async(self, prompt: ModelInput, num_samples: int,
                           sampling_params: SamplingParams,
                           include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0) -> SampleResponse:
        """sample for asyncio: the SampleResponse itself, as Tinker's."""
        return await self.sample(prompt, num_samples, sampling_params,
                                 include_prompt_logprobs,
                                 topk_prompt_logprobs)

    def compute_logprobs(self, prompt: ModelInput
                         ) -> APIFuture[List[Optional[float]]]:
        """Future of the log-probability of each token of `prompt` given the
        tokens before it: None for the first, which has no context."""
        call = self._client.compute_logprobs([prompt.to_ints()],
                                             sequenced=self._sequenced,
                                             sampler=self._sampler)
        return APIFuture(call, lambda response: [None] + list(
            response.prompts[0].logprobs))

    async def compute_logprobs_async(self, prompt: ModelInput
                                     ) -> List[Optional[float]]:
        """compute_logprobs for asyncio: the list itself, as Tinker's."""
        return await self.compute_logprobs(prompt)

    def get_tokenizer(self) -> Any:
        """The tokenizer this client was given, else the one in the base
        model's directory (get_base_model()), which must be readable here
        (tally_client.tinker.tokenizer.load_tokenizer)."""
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(
                None if self._base_model == DEMO_MODEL else self._base_model)
        return self._tokenizer

    def get_telemetry(self) -> None:
        """None: tally keeps no client telemetry."""
        return None

    def get_base_model(self) -> str:
        """The base model this client samples (or its model_id)."""
        return self._base_model

    async def get_base_model_async(self) -> str:
        """get_base_model for asyncio."""
        return self.get_base_model()

    def close(self) -> None:
        """Deletes the model a create_sampling_client(base_model=...) made;
        leaves any other model alone."""
        if self._owns_model:
            self._owns_model = False
            self._client.delete_model()

    def __enter__(self) -> "SamplingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop(self, stop: Any) -> StopLike:
        """tally's stop conditions of SamplingParams.stop: ints are stop
        tokens, strings stop sequences encoded by the tokenizer."""
        if stop is None:
            return None
        items: Sequence[Any] = [stop] if isinstance(stop, str) else stop
        strings = [isinstance(item, str) for item in items]
        if not any(strings):
            return list(items)
        if not all(strings):
            raise ValueError("sampling_params.stop: strings or token ids, "
                             "not both")
        try:
            tokenizer = self.get_tokenizer()
        except (ValueError, ImportError) as error:
            raise ValueError(
                f"sampling_params.stop: a string stop needs a tokenizer "
                f"({error}): pass stop token ids, or make the sampling "
                f"client with tokenizer=...") from error
        return [tokenizer.encode(item, add_special_tokens=False)
                for item in items]


def _sample_response(response: SamplingResult, include_prompt_logprobs: bool,
                     topk_prompt_logprobs: int) -> SampleResponse:
    """The SampleResponse of a one-prompt SamplingResult."""
    sequences = [SampledSequence(stop_reason=_stop_reason(sequence.stop_reason),
                                 tokens=list(sequence.tokens),
                                 logprobs=list(sequence.logprobs))
                 for sequence in response.sequences]
    prompt = response.prompt_logprobs[0] if response.prompt_logprobs else None
    prompt_logprobs = topk = None
    if include_prompt_logprobs and prompt is not None:
        prompt_logprobs = [None] + list(prompt.logprobs)
    if topk_prompt_logprobs > 0 and prompt is not None:
        topk = [None] + [list(zip(position.tokens, position.logprobs))
                         for position in prompt.topk]
    return SampleResponse(sequences=sequences, prompt_logprobs=prompt_logprobs,
                          topk_prompt_logprobs=topk, seed=response.seed,
                          step=response.step)


def _stop_reason(reason: Any) -> TinkerStopReason:
    if reason not in _STOP_REASONS:
        raise ValueError(f"the server answered stop_reason {reason!r}, which "
                         f"this client does not know")
    return _STOP_REASONS[reason]
