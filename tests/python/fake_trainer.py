"""An in-process fake tally Trainer service for the clients' unit tests: it
records every request and answers Sample and ComputeLogprobs by fixed rules
of the request (below), so a test checks what a client sends and how it maps
the answer, without a tally-server.

    fake = FakeTrainer.start()              # grpc.server on a free port
    client = TrainingClient(fake.target, "m", first_seq_id=1)
    client.sample([[1, 2]], max_tokens=3).result()
    method, request = fake.requests[-1]     # ("Sample", pb.SampleRequest)
    fake.stop()

The rules (the functions below compute what the fake answers):
- model ids in FakeTrainer.models exist; another is NOT_FOUND.
- sample s of prompt p: `completion(prompt, s, max_tokens)`: s + 1 tokens
  (at most max_tokens), token k = (sum(prompt) + s + k) % VOCAB, logprob
  `token_logprob(token)`; stop_reason STOP when it ended before max_tokens,
  else LENGTH.
- prompt logprobs: `token_logprob(t)` for each token after the first; top-k
  at each position: tokens (t + j) % VOCAB for j < k, logprob
  token_logprob(token) - j.
- seed: the request's, else 4242; step: FakeTrainer.step.
- max_tokens < 1 is INVALID_ARGUMENT naming params.max_tokens.
- OptimStep adds one to the step; every sequenced request advances
  next_seq_id past its seq_id.
"""

import concurrent.futures
import threading

import grpc

from tally_testing import pb, pb_grpc

VOCAB = 50
SERVER_SEED = 4242


def completion(prompt, sample_index, max_tokens):
    """The tokens the fake samples for sample `sample_index` of `prompt`."""
    length = min(max_tokens, sample_index + 1)
    return [(sum(prompt) + sample_index + k) % VOCAB for k in range(length)]


def token_logprob(token):
    return -0.5 - token / 64.0


def topk(token, k):
    """(tokens, logprobs) of the fake's top-k at a position whose actual
    token is `token`."""
    tokens = [(token + j) % VOCAB for j in range(k)]
    return tokens, [token_logprob(t) - j for j, t in enumerate(tokens)]


def _prompt_logprobs(prompt, k):
    message = pb.PromptLogprobs(
        logprobs=[token_logprob(t) for t in prompt[1:]])
    if k > 0:
        for token in prompt[1:]:
            tokens, logprobs = topk(token, k)
            message.topk.add(tokens=tokens, logprobs=logprobs)
    return message


class FakeTrainer(pb_grpc.TrainerServicer):
    """The fake service; `requests` lists (method, request) in arrival
    order."""

    def __init__(self):
        self.requests = []
        self.models = {"m": 1}  # model id -> next_seq_id
        self.step = 0
        self._lock = threading.Lock()
        self._server = None
        self.target = None

    @classmethod
    def start(cls):
        fake = cls()
        fake._server = grpc.server(
            concurrent.futures.ThreadPoolExecutor(max_workers=4))
        pb_grpc.add_TrainerServicer_to_server(fake, fake._server)
        port = fake._server.add_insecure_port("localhost:0")
        fake._server.start()
        fake.target = f"localhost:{port}"
        return fake

    def stop(self):
        self._server.stop(grace=None)

    def sent(self, method):
        """The requests of `method`, in arrival order."""
        with self._lock:
            return [r for m, r in self.requests if m == method]

    def _record(self, method, request, context, valid=True):
        """Records `request`; a request for an unknown model is NOT_FOUND.
        A `valid` sequenced one uses its seq_id."""
        with self._lock:
            self.requests.append((method, request))
            if request.model_id not in self.models:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"model '{request.model_id}' not found")
            seq_id = getattr(request, "seq_id", 0)
            if seq_id and valid:
                self.models[request.model_id] = max(
                    self.models[request.model_id], seq_id + 1)

    def GetModel(self, request, context):
        self._record("GetModel", request, context)
        return pb.ModelInfo(model_id=request.model_id, step=self.step,
                            next_seq_id=self.models[request.model_id],
                            base=f"base-of-{request.model_id}")

    def CreateModel(self, request, context):
        model_id = request.model_id or f"created-{len(self.models)}"
        with self._lock:
            self.requests.append(("CreateModel", request))
            self.models[model_id] = 1
        return pb.ModelInfo(model_id=model_id, next_seq_id=1,
                            lora=request.lora if request.HasField("lora")
                            else None)

    def DeleteModel(self, request, context):
        self._record("DeleteModel", request, context)
        with self._lock:
            del self.models[request.model_id]
        return pb.DeleteModelResponse(model=pb.ModelInfo(
            model_id=request.model_id))

    def OptimStep(self, request, context):
        self._record("OptimStep", request, context)
        with self._lock:
            self.step += 1
            return pb.OptimStepResponse(step=self.step)

    def ForwardBackward(self, request, context):
        self._record("ForwardBackward", request, context)
        return pb.ForwardBackwardResponse()

    def SaveWeightsForSampler(self, request, context):
        self._record("SaveWeightsForSampler", request, context)
        return pb.SamplerInfo(
            model_id=request.model_id, name=request.name, step=self.step,
            path=f"tally://{request.model_id}/samplers/{request.name}")

    def Sample(self, request, context):
        params = request.params
        self._record("Sample", request, context, valid=params.max_tokens >= 1)
        if params.max_tokens < 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          "params.max_tokens must be >= 1")
        response = pb.SampleResponse(
            seed=params.seed if params.HasField("seed") else SERVER_SEED,
            step=self.step)
        for prompt in request.prompts:
            for s in range(max(1, request.num_samples)):
                tokens = completion(list(prompt.tokens), s, params.max_tokens)
                response.sequences.add(
                    tokens=tokens, logprobs=[token_logprob(t) for t in tokens],
                    stop_reason=pb.STOP_REASON_LENGTH
                    if len(tokens) == params.max_tokens
                    else pb.STOP_REASON_STOP)
            if request.include_prompt_logprobs or request.topk_prompt_logprobs:
                response.prompt_logprobs.append(_prompt_logprobs(
                    list(prompt.tokens), request.topk_prompt_logprobs))
        return response

    def ComputeLogprobs(self, request, context):
        self._record("ComputeLogprobs", request, context)
        return pb.ComputeLogprobsResponse(
            prompts=[_prompt_logprobs(list(p.tokens), request.topk)
                     for p in request.prompts], step=self.step)
