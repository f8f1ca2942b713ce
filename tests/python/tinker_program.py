"""A training program written only against the public API of Tinker's SDK
(names, arguments, results), run by test_tinker_program.py in fresh
processes against a real tally-server. The only tally names are the two
imports; the base URL and the base model's directory come from argv.

    python3 tinker_program.py train BASE_URL BASE_MODEL OUT_JSON
    python3 tinker_program.py resume BASE_URL STATE_PATH OUT_JSON
    python3 tinker_program.py rest BASE_URL STATE_PATH OUT_JSON

`train`: supervised steps (cross_entropy), then RL with sampling the way
the cookbook's rl_loop builds its datums (prompt positions padded with
logprob 0 and advantage 0, no mask; importance_sampling), a refused call
caught as Tinker's exception classes, and save_state. `resume`: a new
TrainingClient from the saved state with its optimizer, one forward.
`rest`: the RestClient lists the user's checkpoints, downloads the saved
state's archive and deletes it. Each writes what it measured to OUT_JSON.
"""

import io
import json
import sys
import tarfile

import numpy as np
import torch

from tally_client import tinker  # was: import tinker
from tally_client.tinker import types  # was: from tinker import types
from tally_client.tinker.types.tensor_data import TensorData

SEQUENCE = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
PROMPT = [1, 5, 9]
TARGET = 7
MAX_TOKENS = 4
GROUP_SIZE = 16
SL_STEPS = 6
RL_STEPS = 6


def sl_datum():
    """The supervised datum: SEQUENCE, next-token targets as a (tokens, 1)
    nested list of floats (Tinker takes integral floats and n-D data),
    weight 0 on the first position, as a numpy array."""
    targets = [[float(token)] for token in SEQUENCE[1:]]
    weights = np.array([0.0] + [1.0] * (len(SEQUENCE) - 2), dtype=np.float32)
    return types.Datum(
        model_input=types.ModelInput.from_ints(SEQUENCE[:-1]),
        loss_fn_inputs={"target_tokens": targets, "weights": weights})


def rl_datum(prompt, tokens, logprobs, advantage):
    """The cookbook's rl_loop datum: the prompt's positions padded with
    target 0, logprob 0 and advantage 0, and no mask."""
    ob_len = prompt.length - 1
    model_input = prompt.append(types.EncodedTextChunk(tokens=tokens[:-1]))
    return types.Datum(
        model_input=model_input,
        loss_fn_inputs={
            "target_tokens": TensorData.from_torch(
                torch.tensor([0] * ob_len + tokens)),
            "logprobs": TensorData.from_torch(
                torch.tensor([0.0] * ob_len + logprobs)),
            "advantages": TensorData.from_torch(torch.tensor(
                [0.0] * ob_len + [advantage] * (model_input.length - ob_len))),
        })


def reward(tokens):
    return sum(token == TARGET for token in tokens) / MAX_TOKENS


def supervised(training_client, report):
    adam = tinker.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.95,
                             eps=1e-8)
    datum = sl_datum()
    for _ in range(SL_STEPS):
        fwd_bwd = training_client.forward_backward([datum],
                                                   loss_fn="cross_entropy")
        optim = training_client.optim_step(adam)
        report["sl_losses"].append(fwd_bwd.result().metrics["loss:sum"])
        report["optim_metrics"] = optim.result().metrics
    report["output_type"] = fwd_bwd.result().loss_fn_output_type


def reinforce(training_client, report):
    adam = types.AdamParams(learning_rate=5e-2, beta1=0.9, beta2=0.95,
                            eps=1e-8)
    prompt = types.ModelInput.from_ints(PROMPT)
    for step in range(RL_STEPS + 1):
        sampling_client = \
            training_client.save_weights_and_get_sampling_client()
        result = sampling_client.sample(
            prompt=prompt, num_samples=GROUP_SIZE,
            sampling_params=types.SamplingParams(max_tokens=MAX_TOKENS,
                                                 seed=step, stop=[])).result()
        rewards = [reward(sequence.tokens) for sequence in result.sequences]
        report["rewards"].append(sum(rewards) / len(rewards))
        if step == RL_STEPS:
            break
        mean = sum(rewards) / len(rewards)
        datums = [rl_datum(prompt, sequence.tokens, sequence.logprobs,
                           score - mean)
                  for sequence, score in zip(result.sequences, rewards)]
        fwd_bwd = training_client.forward_backward(
            datums, loss_fn="importance_sampling")
        training_client.optim_step(adam).result()
        report["rl_metrics"].append(fwd_bwd.result().metrics)


def refused_call(training_client, report):
    """A call the server refuses, caught as the cookbook catches them."""
    try:
        training_client.forward_backward([sl_datum()], "ppo",
                                         {"no_such_key": 1.0}).result()
    except tinker.BadRequestError as error:
        report["refused"] = [type(error).__name__, error.status_code,
                             isinstance(error, tinker.TinkerError)]


def train(base_url, base_model, out):
    service_client = tinker.ServiceClient(base_url=base_url,
                                          user_metadata={"recipe": "test"})
    training_client = service_client.create_lora_training_client(
        base_model=base_model, rank=8)
    report = {"sl_losses": [], "rewards": [], "rl_metrics": []}
    supervised(training_client, report)
    reinforce(training_client, report)
    refused_call(training_client, report)
    report["info"] = training_client.get_info().model_data.tokenizer_id
    report["state_path"] = training_client.save_state(
        "final", ttl_seconds=3600).result().path
    report["loss_at_save"] = training_client.forward(
        [sl_datum()], "cross_entropy").result().metrics["loss:sum"]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(report, f)


def resume(base_url, state_path, out):
    service_client = tinker.ServiceClient(base_url=base_url)
    training_client = \
        service_client.create_training_client_from_state_with_optimizer(
            state_path)
    loss = training_client.forward([sl_datum()], "cross_entropy").result()
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"loss": loss.metrics["loss:sum"]}, f)


def rest(base_url, state_path, out):
    rest_client = tinker.ServiceClient(base_url=base_url).create_rest_client()

    def listed():
        return {c.tinker_path: [c.checkpoint_type, c.size_bytes > 0,
                                c.expires_at is not None]
                for c in rest_client.list_user_checkpoints().result()
                .checkpoints}

    before = listed()
    archive = rest_client.download_checkpoint_archive_from_tinker_path(
        state_path).result()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
        files = sorted(tar.getnames())
    rest_client.delete_checkpoint_from_tinker_path(state_path).result()
    with open(out, "w", encoding="utf-8") as f:
        json.dump({"before": before, "files": files, "after": listed()}, f)


if __name__ == "__main__":
    {"train": train, "resume": resume, "rest": rest}[sys.argv[1]](
        *sys.argv[2:])
