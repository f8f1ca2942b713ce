"""Independent evidence that tally's RL losses are Tinker's.

Each case trains the tiny float64 Llama of test_llama_reference.py on a
running tally-server with one of the ForwardBackward losses (cross_entropy,
importance_sampling, ppo, cispo, dro) and reductions (TOKEN_MEAN,
SAMPLE_MEAN, SUM), reads the weights tally saved before and after the step,
and replays the window in plain PyTorch with hf_reference.ReferenceLlama.
The losses below are written from the published formulas (tinker-cookbook
docs/losses.mdx: "Loss functions in Tinker"), not from tally's code. Per
token, with logp the trainer's log-probability of the target, q the
sampler's (sampling_logprobs), A the advantage, w the weight (any sign) and
ratio = exp(logp - q):

  cross_entropy        -logp
  importance_sampling  -ratio * A
  ppo                  -min(ratio * A, clamp(ratio, low, high) * A)
  cispo                -stop_gradient(clamp(ratio, low, high)) * logp * A
  dro                  -(logp * A - beta / 2 * (logp - q)^2)

A token is valid iff its target is not -100 and w != 0; it contributes
w * loss. The window's objective is TOKEN_MEAN (sum / valid tokens),
SAMPLE_MEAN (mean over samples with a valid token of sum_b / T_b) or SUM.

Everything the server reports (per-sample loss_sum, valid_tokens, logprobs,
token_losses, PolicyStats, the call totals, the step's gradient norm and
normalizer) and every updated weight must equal the reference to 1e-10.
The wire carries weights, advantages and sampling_logprobs as float32: the
test builds them as float32 values, so nothing is lost in transit.
"""

import collections
import math
import os
import typing
import unittest

import grpc
import numpy as np
import torch

from hf_reference import IGNORE, ReferenceLlama, window_loss
from tally_client import client as tally_client_module
from tally_client.tinker import types as tinker_types
from tally_testing import TINY_LLAMA, ServerTestCase, pb, read_json, read_safetensors
from test_llama_reference import assert_close, relative_max_diff


FLOAT64_RTOL = 1e-10

CE = pb.LOSS_FN_CROSS_ENTROPY
IS = pb.LOSS_FN_IMPORTANCE_SAMPLING
PPO = pb.LOSS_FN_PPO
CISPO = pb.LOSS_FN_CISPO
DRO = pb.LOSS_FN_DRO
LOSS_NAMES = {CE: "cross_entropy", IS: "importance_sampling", PPO: "ppo",
              CISPO: "cispo", DRO: "dro"}

TOKEN_MEAN = pb.LOSS_REDUCTION_TOKEN_MEAN
SAMPLE_MEAN = pb.LOSS_REDUCTION_SAMPLE_MEAN
SUM = pb.LOSS_REDUCTION_SUM
REDUCTION_NAMES = {TOKEN_MEAN: "token_mean", SAMPLE_MEAN: "sample_mean", SUM: "sum"}

# Tinker's defaults (losses.mdx: clip_low_threshold / clip_high_threshold,
# epsilon 0.2 on both sides).
DEFAULT_CLIP_LOW, DEFAULT_CLIP_HIGH = 0.8, 1.2

# Every clip bound a case below uses; sampling offsets keep away from them so
# that no ratio sits on a boundary (where 1e-16 decides the branch).
CLIP_BOUNDS = (0.7, 0.8, 0.85, 0.9, 1.1, 1.15, 1.2, 1.3)

POLICY_FLOATS = ("ratio_mean", "ratio_min", "ratio_max", "clipped_fraction",
                 "logprob_gap_mean", "logprob_gap_max", "kl_k1", "kl_k3")

SGD = {"kind": "sgd", "lr": 0.5, "weight_decay": 0.1}
ADAMW = {"kind": "adamw", "lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8,
         "weight_decay": 0.1, "max_norm": 0.05}


# ---------------------------------------------------------------------------
# Samples
# ---------------------------------------------------------------------------

class RLSample:
    """A sample's fixed parts: tokens, weights (None: all 1), advantages
    (float32) and `offsets`, from which the sampling logprobs are made once
    the model's own logprobs are known: q = float32(logp + offset), so
    ratio = exp(logp - q) ~ exp(-offset) lands where the test wants it."""

    def __init__(self, inputs, targets, weights, advantages, offsets):
        assert len(inputs) == len(targets) == len(advantages) == len(offsets)
        assert weights is None or len(weights) == len(inputs)
        self.inputs = [int(t) for t in inputs]
        self.targets = [int(t) for t in targets]
        if weights is not None:
            weights = np.asarray(weights, dtype=np.float32)
        self.weights = weights
        self.advantages = np.asarray(advantages, dtype=np.float32)
        self.offsets = np.asarray(offsets, dtype=np.float64)

    def weight_values(self):
        if self.weights is None:
            return np.ones(len(self.inputs))
        return self.weights.astype(np.float64)

    def valid(self):
        """target != -100 and weight != 0 (any sign counts)."""
        return np.array([t != IGNORE and w != 0.0
                         for t, w in zip(self.targets, self.weight_values())])

    def sampling_logprobs(self, logp):
        """float32 q from the reference's log-probabilities `logp` (before
        the step; 0 at ignored targets)."""
        return (np.asarray(logp, dtype=np.float64) + self.offsets).astype(np.float32)


def clear_of_bounds(offset, margin=0.01):
    """`offset` moved until exp(-offset) is at least `margin` (in log space)
    away from every clip bound of CLIP_BOUNDS."""
    critical = [-math.log(b) for b in CLIP_BOUNDS]
    while any(abs(offset - c) < margin for c in critical):
        offset += 2.5 * margin
    return offset


def make_samples(seed, offset_range):
    """Six samples of mixed lengths: plain; a zero weight; ignored targets
    and a negative weight; every target ignored; a single token of negative
    weight; negative and zero weights. Advantages of both signs (float32);
    sampling offsets uniform in [-offset_range, offset_range], moved clear of
    the clip bounds."""
    rng = np.random.default_rng(seed)
    vocab = TINY_LLAMA["vocab_size"]

    def tokens(n):
        return [int(t) for t in rng.integers(0, vocab, n)]

    def advantages(n):
        return rng.standard_normal(n).astype(np.float32)

    def offsets(n):
        return np.array([clear_of_bounds(o)
                         for o in rng.uniform(-offset_range, offset_range, n)])

    layout = []
    layout.append((tokens(7), tokens(7), None))
    layout.append((tokens(4), tokens(4), [1.5, 0.0, 0.25, 2.0]))
    targets = tokens(11)
    targets[0] = targets[1] = targets[6] = IGNORE
    layout.append((tokens(11), targets,
                   [1.0, 1.0, 0.5, -0.5, 3.0, 1.0, 1.0, 0.75, 1.0, -1.0, 1.25]))
    layout.append((tokens(3), [IGNORE] * 3, None))
    layout.append((tokens(1), tokens(1), [-1.25]))
    layout.append((tokens(6), tokens(6), [1.0, -0.5, 0.0, 1.0, 2.0, 1.0]))
    return [RLSample(x, y, w, advantages(len(x)), offsets(len(x)))
            for x, y, w in layout]


SAMPLES = make_samples(seed=18, offset_range=0.5)     # ratios in ~[0.6, 1.65]
INSIDE = make_samples(seed=19, offset_range=0.15)     # ratios in ~[0.86, 1.16]

Call = collections.namedtuple("Call", "loss_fn config indices")


def clip_range(config):
    return (config.get("clip_low_threshold", DEFAULT_CLIP_LOW),
            config.get("clip_high_threshold", DEFAULT_CLIP_HIGH))


def to_proto(sample, q, loss_fn, advantages=True, sampling=True):
    """cross_entropy samples carry no advantages (Tinker's cross_entropy has
    none), but do carry sampling logprobs, which turn PolicyStats on."""
    message = pb.Sample(input_tokens=sample.inputs, target_tokens=sample.targets)
    if sample.weights is not None:
        message.weights.extend(sample.weights.tolist())
    if advantages and loss_fn != CE:
        message.advantages.extend(sample.advantages.tolist())
    if sampling:
        message.sampling_logprobs.extend(q.tolist())
    return message


# ---------------------------------------------------------------------------
# The reference: Tinker's formulas on ReferenceLlama's log-probabilities
# ---------------------------------------------------------------------------

def token_loss(loss_fn, config, logp, q, advantages):
    """The per-token loss of losses.mdx, before the weight."""
    if loss_fn == CE:
        return -logp
    ratio = torch.exp(logp - q)
    if loss_fn == IS:
        return -(ratio * advantages)
    if loss_fn == PPO:
        low, high = clip_range(config)
        unclipped = ratio * advantages
        clipped = torch.clamp(ratio, low, high) * advantages
        return -torch.minimum(unclipped, clipped)
    if loss_fn == CISPO:
        low, high = clip_range(config)
        return -(torch.clamp(ratio, low, high).detach() * logp * advantages)
    if loss_fn == DRO:
        beta = config["beta"]
        return -(logp * advantages - 0.5 * beta * (logp - q) ** 2)
    raise ValueError(loss_fn)


class RLTerms:
    """One sample's reference quantities under `loss_fn`: logprobs (0 at
    ignored targets), token_losses (w * loss, 0 where invalid), loss_sum,
    valid_tokens, and the log-ratios d = logp - q of its valid tokens with
    whether each ratio lies outside the clip range (PolicyStats)."""

    def __init__(self, model, sample, q, loss_fn, config):
        targets = sample.targets
        logp_all = model.log_probs(sample.inputs)
        safe = torch.tensor([max(t, 0) for t in targets])
        ignored = torch.tensor([t == IGNORE for t in targets])
        logp = logp_all.gather(1, safe[:, None])[:, 0].masked_fill(ignored, 0.0)
        valid = torch.tensor(sample.valid())
        w = torch.tensor(sample.weight_values(), dtype=torch.float64)
        q = torch.tensor(q.astype(np.float64))
        advantages = torch.tensor(sample.advantages.astype(np.float64))
        loss = token_loss(loss_fn, config, logp, q, advantages)
        self.logprobs = logp
        self.token_losses = torch.where(valid, w * loss, torch.zeros_like(loss))
        self.loss_sum = self.token_losses.sum()
        self.valid_tokens = int(valid.sum())
        self.valid = valid.numpy()
        self.gaps = (logp - q).detach().numpy()[self.valid]
        self.ratios = np.exp(self.gaps)
        if loss_fn in (PPO, CISPO):
            low, high = clip_range(config)
            self.clipped = (self.ratios < low) | (self.ratios > high)
        else:
            self.clipped = np.zeros(len(self.ratios), dtype=bool)
        self.advantages = sample.advantages.astype(np.float64)[self.valid]


def reference_logprobs(model, sample):
    """The reference's log-probabilities of `sample`'s targets, 0 at ignored
    targets, without a graph."""
    with torch.no_grad():
        zeros = np.zeros(len(sample.inputs), dtype=np.float32)
        return RLTerms(model, sample, zeros, CE, {}).logprobs.numpy()


def policy_stats(terms):
    """PolicyStats over the valid tokens of `terms`, pooled."""
    gaps = np.concatenate([t.gaps for t in terms])
    ratio = np.concatenate([t.ratios for t in terms])
    clipped = np.concatenate([t.clipped for t in terms])
    if len(gaps) == 0:
        return dict({f: 0.0 for f in POLICY_FLOATS}, tokens=0)
    return {"tokens": len(gaps),
            "ratio_mean": ratio.mean(),
            "ratio_min": ratio.min(),
            "ratio_max": ratio.max(),
            "clipped_fraction": clipped.sum() / len(gaps),
            "logprob_gap_mean": np.abs(gaps).mean(),
            "logprob_gap_max": np.abs(gaps).max(),
            "kl_k1": (-gaps).mean(),
            "kl_k3": (ratio - 1.0 - gaps).mean()}


def window_objective(terms, reduction):
    """The window's loss: hf_reference.window_loss for the means, the plain
    sum for SUM."""
    if reduction == SUM:
        return sum(t.loss_sum for t in terms)
    return window_loss(terms, reduction == SAMPLE_MEAN)


def window_normalizer(terms, reduction):
    if reduction == TOKEN_MEAN:
        return sum(t.valid_tokens for t in terms)
    if reduction == SAMPLE_MEAN:
        return sum(1 for t in terms if t.valid_tokens > 0)
    return 1


def grad_norm(model):
    return math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.params.values()))


def reference_step(model, optimizer):
    """Steps the reference's parameters (their .grad set) as tally's
    optimizer does; returns (clip_coef, {name: array})."""
    params = list(model.params.values())
    clip_coef = 1.0
    if optimizer["kind"] == "sgd":
        lr, decay = optimizer["lr"], optimizer["weight_decay"]
        with torch.no_grad():
            updated = {n: (p * (1 - lr * decay) - lr * p.grad).numpy()
                       for n, p in model.params.items()}
        return clip_coef, updated
    max_norm = optimizer["max_norm"]
    clip_coef = min(1.0, max_norm / (grad_norm(model) + 1e-6))
    with torch.no_grad():
        for p in params:
            p.grad.mul_(clip_coef)
    torch.optim.AdamW(params, lr=optimizer["lr"], betas=optimizer["betas"],
                      eps=optimizer["eps"],
                      weight_decay=optimizer["weight_decay"]).step()
    return clip_coef, {n: p.detach().numpy().copy() for n, p in model.params.items()}


# ---------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------

Outcome = collections.namedtuple("Outcome", "responses step before after terms")


class RLLossReferenceTest(ServerTestCase):

    # -- server side --------------------------------------------------------

    def create_model(self, model_id, optimizer):
        if optimizer["kind"] == "sgd":
            kind = pb.OPTIMIZER_SGD
            adam = pb.AdamParams(learning_rate=optimizer["lr"],
                                 weight_decay=optimizer["weight_decay"])
            max_norm = 0.0
        else:
            kind = pb.OPTIMIZER_ADAMW
            adam = pb.AdamParams(learning_rate=optimizer["lr"],
                                 beta1=optimizer["betas"][0],
                                 beta2=optimizer["betas"][1], eps=optimizer["eps"],
                                 weight_decay=optimizer["weight_decay"])
            max_norm = optimizer["max_norm"]
        info = self.stub.CreateModel(pb.CreateModelRequest(
            model_id=model_id, seed=7, dtype=pb.DTYPE_FLOAT64, optimizer=kind,
            config=pb.ModelConfig(tie_word_embeddings=False, **TINY_LLAMA),
            default_adam=adam, default_max_grad_norm=max_norm))
        self.assertEqual(info.model_id, model_id)

    def weights(self, model_id, name):
        """(config.json, {name: float64 array}) of a fresh checkpoint."""
        path = os.path.join(self.temp_dir, f"{model_id}-{name}")
        self.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model_id=model_id, path=path))
        tensors = read_safetensors(os.path.join(path, "model.safetensors"))
        for tensor_name, value in tensors.items():
            self.assertEqual(value.dtype, np.dtype("<f8"), tensor_name)
        return read_json(os.path.join(path, "config.json")), tensors

    def forward_backward(self, model_id, samples, q, call, reduction,
                         forward_only=False):
        return self.stub.ForwardBackward(pb.ForwardBackwardRequest(
            model_id=model_id,
            samples=[to_proto(samples[i], q[i], call.loss_fn) for i in call.indices],
            reduction=reduction, loss_fn=call.loss_fn,
            loss_fn_config=call.config, return_logprobs=True,
            forward_only=forward_only))

    def counters(self, model_id):
        info = self.stub.GetModel(pb.GetModelRequest(model_id=model_id))
        return (info.step, info.accumulated_calls, info.accumulated_tokens,
                info.accumulated_samples, info.pending_reduction)

    # -- checks ---------------------------------------------------------------

    def check_policy(self, got, terms, what):
        expected = policy_stats(terms)
        self.assertEqual(got.tokens, expected["tokens"], f"{what} policy tokens")
        for field in POLICY_FLOATS:
            assert_close(self, getattr(got, field), expected[field], FLOAT64_RTOL,
                         f"{what} policy {field}")

    def check_arrays(self, got, expected, zero_mask, what):
        got = np.array(got)
        self.assertEqual(got.shape, expected.shape, what)
        self.assertLess(relative_max_diff(got, expected), FLOAT64_RTOL,
                        f"{what}: tally {got}, reference {expected}")
        self.assertTrue(np.all(got[zero_mask] == 0.0), f"{what}: {got} not 0 at {zero_mask}")

    def check_response(self, response, terms, samples, call, reduction, what):
        """One call's results against its RLTerms (every sample carries
        sampling logprobs, so PolicyStats are set)."""
        self.assertEqual(len(response.samples), len(terms), what)
        for j, (result, term) in enumerate(zip(response.samples, terms)):
            where = f"{what} sample {call.indices[j]}"
            sample = samples[call.indices[j]]
            assert_close(self, result.loss_sum, term.loss_sum, FLOAT64_RTOL,
                         f"{where} loss_sum")
            self.assertEqual(result.valid_tokens, term.valid_tokens, f"{where} valid_tokens")
            ignored = np.array([t == IGNORE for t in sample.targets])
            self.check_arrays(result.logprobs, term.logprobs.detach().numpy(), ignored,
                              f"{where} logprobs")
            self.check_arrays(result.token_losses, term.token_losses.detach().numpy(),
                              ~term.valid, f"{where} token_losses")
            self.assertTrue(result.HasField("policy"), f"{where} policy")
            self.check_policy(result.policy, [term], where)
        loss_sum = sum(float(t.loss_sum) for t in terms)
        tokens = sum(t.valid_tokens for t in terms)
        counted = [t for t in terms if t.valid_tokens > 0]
        assert_close(self, response.loss_sum, loss_sum, FLOAT64_RTOL, f"{what} loss_sum")
        self.assertEqual(response.valid_tokens, tokens, f"{what} valid_tokens")
        self.assertEqual(response.num_samples, len(counted), f"{what} num_samples")
        if reduction == SAMPLE_MEAN:
            mean = (sum(float(t.loss_sum) / t.valid_tokens for t in counted) / len(counted)
                    if counted else 0.0)
        else:
            mean = loss_sum / tokens if tokens else 0.0
        assert_close(self, response.loss_mean, mean, FLOAT64_RTOL, f"{what} loss_mean")
        self.assertTrue(response.HasField("policy"), f"{what} policy")
        self.check_policy(response.policy, terms, what)

    def check_weights(self, model_id, after, expected, before):
        self.assertEqual(sorted(after), sorted(expected), model_id)
        for name, value in expected.items():
            diff = relative_max_diff(after[name], value)
            self.assertLess(diff, FLOAT64_RTOL, f"{model_id}: updated {name}")
        moved = max(float(np.max(np.abs(after[n] - before[n]))) for n in after)
        self.assertGreater(moved, 1e-4, f"{model_id}: the step changed nothing")

    # -- one window, end to end ----------------------------------------------

    def run_window(self, model_id, samples, calls, reduction, optimizer=SGD):
        """Creates `model_id`, builds the sampling logprobs from its initial
        weights, runs `calls` (one window, `reduction`) and one step, and
        checks every response, the step and every updated weight against
        the reference of the whole window."""
        self.create_model(model_id, optimizer)
        config, before = self.weights(model_id, "before")
        model = ReferenceLlama(config, before, torch.float64)
        q = [s.sampling_logprobs(reference_logprobs(model, s)) for s in samples]

        responses = [self.forward_backward(model_id, samples, q, call, reduction)
                     for call in calls]
        step_request = pb.OptimStepRequest(model_id=model_id)
        if optimizer["kind"] == "sgd":
            step_request.max_grad_norm = 0.0
        step = self.stub.OptimStep(step_request)
        _, after = self.weights(model_id, "after")

        terms = [[RLTerms(model, samples[i], q[i], call.loss_fn, call.config)
                  for i in call.indices] for call in calls]
        window_tokens = window_samples = 0
        for index, (response, call, call_terms) in enumerate(zip(responses, calls, terms)):
            what = f"{model_id} call {index} ({LOSS_NAMES[call.loss_fn]})"
            self.check_response(response, call_terms, samples, call, reduction, what)
            window_tokens += sum(t.valid_tokens for t in call_terms)
            window_samples += sum(1 for t in call_terms if t.valid_tokens > 0)
            self.assertEqual(response.accumulated_calls, index + 1, what)
            self.assertEqual(response.accumulated_tokens, window_tokens, what)
            self.assertEqual(response.accumulated_samples, window_samples, what)

        flat = [t for call_terms in terms for t in call_terms]
        window_objective(flat, reduction).backward()
        norm = grad_norm(model)
        clip_coef, expected = reference_step(model, optimizer)
        self.assertEqual(step.step, 1, model_id)
        self.assertFalse(step.skipped, step.skip_reason)
        self.assertEqual(step.normalizer, window_normalizer(flat, reduction), model_id)
        assert_close(self, step.grad_norm, norm, FLOAT64_RTOL, f"{model_id} grad_norm")
        assert_close(self, step.clip_coef, clip_coef, FLOAT64_RTOL, f"{model_id} clip_coef")
        self.check_weights(model_id, after, expected, before)
        return Outcome(responses, step, before, after, terms)

    def assert_clipping_exercised(self, terms, loss_fn, what):
        """The data of `terms` reach both sides of the clip range, for PPO
        with advantages of both signs on each side (all four branches of
        min), and leave some ratios inside it."""
        ratios = np.concatenate([t.ratios for t in terms])
        clipped = np.concatenate([t.clipped for t in terms])
        advantages = np.concatenate([t.advantages for t in terms])
        low_side = clipped & (ratios < 1.0)
        high_side = clipped & (ratios > 1.0)
        self.assertTrue(low_side.any() and high_side.any(), what)
        self.assertTrue((~clipped).any(), what)
        if loss_fn == PPO:
            for side in (low_side, high_side):
                self.assertTrue((side & (advantages > 0)).any(), what)
                self.assertTrue((side & (advantages < 0)).any(), what)

    # 0 ---------------------------------------------------------------------

    def test_the_clients_loss_names_are_the_servers(self):
        """The loss names the Python client, its Tinker layer and this test
        know are the server's (ServerInfo.losses, its loss table), in the
        order of the LossFn enum they map to."""
        self.start_server()
        served = list(self.stub.GetServerInfo(pb.GetServerInfoRequest()).losses)
        self.assertEqual(served[0], "cross_entropy")
        # pylint: disable-next=protected-access
        self.assertEqual(list(tally_client_module._LOSS_FNS), served)
        self.assertEqual([pb.LossFn.Name(v).lower()[len("loss_fn_"):]
                          for v in tally_client_module._LOSS_FNS.values()],
                         served)
        self.assertEqual(list(typing.get_args(tinker_types.LossFnType)), served)
        self.assertEqual(list(LOSS_NAMES.values()), served)

    # 1 ---------------------------------------------------------------------

    def test_each_loss_and_reduction(self):
        """5 losses x 3 reductions, a two-call window each, one SGD step:
        every output, the gradient norm and every weight against the
        reference. Non-default clip ranges (one with only the high bound)
        and a different beta per reduction."""
        self.start_server()
        configs = {
            (CE, TOKEN_MEAN): {}, (CE, SAMPLE_MEAN): {}, (CE, SUM): {},
            (IS, TOKEN_MEAN): {}, (IS, SAMPLE_MEAN): {}, (IS, SUM): {},
            (PPO, TOKEN_MEAN): {},
            (PPO, SAMPLE_MEAN): {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
            (PPO, SUM): {"clip_high_threshold": 1.3},
            (CISPO, TOKEN_MEAN): {"clip_low_threshold": 0.7, "clip_high_threshold": 1.3},
            (CISPO, SAMPLE_MEAN): {},
            (CISPO, SUM): {"clip_low_threshold": 0.85, "clip_high_threshold": 1.15},
            (DRO, TOKEN_MEAN): {"beta": 0.05},
            (DRO, SAMPLE_MEAN): {"beta": 0.3},
            (DRO, SUM): {"beta": 1.0},
        }
        for (loss_fn, reduction), config in configs.items():
            model_id = f"{LOSS_NAMES[loss_fn]}_{REDUCTION_NAMES[reduction]}"
            with self.subTest(model_id):
                calls = [Call(loss_fn, config, [0, 1, 2]), Call(loss_fn, config, [3, 4, 5])]
                outcome = self.run_window(model_id, SAMPLES, calls, reduction)
                if loss_fn in (PPO, CISPO):
                    # The clip range is reached on both sides in the window.
                    self.assert_clipping_exercised(sum(outcome.terms, []), loss_fn,
                                                   model_id)
                else:
                    for response in outcome.responses:
                        self.assertEqual(response.policy.clipped_fraction, 0.0, model_id)

    # 2 ---------------------------------------------------------------------

    def test_window_splits_and_mixed_losses(self):
        """The same window in one call and in three gives the same update;
        a window whose calls use different losses (one reduction) is the
        reference's mixed objective, for every reduction, with SGD and with
        a clipped AdamW step."""
        self.start_server()
        ppo = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
        one = self.run_window("ppo_one_call", SAMPLES, [Call(PPO, ppo, [0, 1, 2, 3, 4, 5])],
                              SAMPLE_MEAN)
        three = self.run_window("ppo_three_calls", SAMPLES,
                                [Call(PPO, ppo, [0]), Call(PPO, ppo, [1, 2, 3]),
                                 Call(PPO, ppo, [4, 5])], SAMPLE_MEAN)
        assert_close(self, three.step.grad_norm, one.step.grad_norm, FLOAT64_RTOL,
                     "grad_norm, 3 calls vs 1")
        for name, value in one.after.items():
            self.assertLess(relative_max_diff(three.after[name], value), FLOAT64_RTOL,
                            f"3 calls vs 1: {name}")

        mixes = {
            TOKEN_MEAN: [Call(PPO, {}, [0, 1]), Call(DRO, {"beta": 0.2}, [2, 3]),
                         Call(CE, {}, [4, 5])],
            SAMPLE_MEAN: [Call(CISPO, {"clip_high_threshold": 1.15}, [0, 5]),
                          Call(IS, {}, [1, 2]), Call(CE, {}, [3, 4])],
            SUM: [Call(IS, {}, [2]), Call(PPO, {"clip_low_threshold": 0.85}, [0, 1, 3]),
                  Call(DRO, {"beta": 0.5}, [4, 5])],
        }
        for reduction, calls in mixes.items():
            model_id = f"mixed_{REDUCTION_NAMES[reduction]}"
            with self.subTest(model_id):
                self.run_window(model_id, SAMPLES, calls, reduction)
        with self.subTest("mixed_token_mean_adamw"):
            outcome = self.run_window("mixed_token_mean_adamw", SAMPLES,
                                      mixes[TOKEN_MEAN], TOKEN_MEAN, ADAMW)
            self.assertLess(outcome.step.clip_coef, 0.9, "clipping must be active")

    # 3 ---------------------------------------------------------------------

    def test_dpo_through_signed_cross_entropy_weights(self):
        """Tinker's forward_backward_custom, by hand: the client computes a
        DPO loss (Rafailov et al. 2023) with autograd from forward_only
        logprobs and sends w_t = -dLoss/dlogp_t as cross_entropy weights
        with SUM, whose gradient sum_t w_t * -grad logp_t is dLoss/dtheta.
        Two SGD steps; the reference logprobs are the initial model's (the
        frozen copy).

        Tier 1, strict (1e-10): the server's update equals the reference of
        the surrogate with the weights as sent (float32). Tier 2: it equals
        direct autograd of the DPO loss in the reference; step 1 exactly
        (the policy is the reference model, so every margin is 0 and
        beta = 1/8 makes each weight +-beta/2/pairs = 1/32, exact in
        float32), step 2 to the float32 rounding of the weights on the wire
        (1e-6)."""
        self.start_server()
        model_id, beta, lr = "dpo", 0.125, 0.5
        optimizer = {"kind": "sgd", "lr": lr, "weight_decay": 0.0}
        self.create_model(model_id, optimizer)

        rng = np.random.default_rng(2305)
        vocab = TINY_LLAMA["vocab_size"]
        samples = []  # chosen, rejected, chosen, rejected
        for prompt_length, lengths in ((4, (3, 5)), (3, (4, 2))):
            prompt = [int(t) for t in rng.integers(0, vocab, prompt_length)]
            for length in lengths:
                tokens = prompt + [int(t) for t in rng.integers(0, vocab, length)]
                targets = tokens[1:]
                targets[:prompt_length - 1] = [IGNORE] * (prompt_length - 1)
                samples.append((tokens[:-1], targets))
        pairs = [(0, 1), (2, 3)]

        def forward_only(weights=None):
            protos = [pb.Sample(input_tokens=x, target_tokens=y) for x, y in samples]
            response = self.stub.ForwardBackward(pb.ForwardBackwardRequest(
                model_id=model_id, samples=protos, reduction=SUM, loss_fn=CE,
                forward_only=True, return_logprobs=True))
            self.assertEqual(response.accumulated_calls, 0)
            # No sample carries sampling logprobs: no PolicyStats.
            self.assertFalse(response.HasField("policy"))
            return [torch.tensor(list(r.logprobs), dtype=torch.float64)
                    for r in response.samples]

        masks = [torch.tensor([t != IGNORE for t in y]) for _, y in samples]

        def dpo_loss(logprobs, reference_logprobs):
            """-mean over pairs of log sigmoid(beta * ((pi_c - ref_c) -
            (pi_r - ref_r))), sequence logprobs summed over the response."""
            def sequence(lp, i):
                return (lp[i] * masks[i]).sum()
            losses = []
            for chosen, rejected in pairs:
                margin = ((sequence(logprobs, chosen) - sequence(reference_logprobs, chosen))
                          - (sequence(logprobs, rejected)
                             - sequence(reference_logprobs, rejected)))
                losses.append(-torch.nn.functional.logsigmoid(beta * margin))
            return sum(losses) / len(losses)

        frozen_logprobs = forward_only()  # the frozen copy: the initial model
        initial = None
        for step_index in (1, 2):
            what = f"DPO step {step_index}"
            config, before = self.weights(model_id, f"before{step_index}")
            initial = initial or before
            # The client: forward_only logprobs, autograd, signed weights.
            logprobs = [lp.requires_grad_(True) for lp in forward_only()]
            dpo_loss(logprobs, frozen_logprobs).backward()
            weights = [np.where(masks[i].numpy(), -lp.grad.numpy(), 0.0).astype(np.float32)
                       for i, lp in enumerate(logprobs)]
            if step_index == 1:
                for w, mask in zip(weights, masks):
                    self.assertTrue(np.all(np.abs(w[mask.numpy()]) == 1 / 32), w)
            response = self.stub.ForwardBackward(pb.ForwardBackwardRequest(
                model_id=model_id, reduction=SUM, loss_fn=CE, return_logprobs=True,
                samples=[pb.Sample(input_tokens=x, target_tokens=y, weights=w.tolist())
                         for (x, y), w in zip(samples, weights)]))
            step = self.stub.OptimStep(pb.OptimStepRequest(model_id=model_id,
                                                           max_grad_norm=0.0))
            _, after = self.weights(model_id, f"after{step_index}")
            self.assertEqual(step.normalizer, 1.0, what)

            # The reference, tier 1: the surrogate with the weights as sent.
            model = ReferenceLlama(config, before, torch.float64)
            terms = [RLTerms(model, RLSample(x, y, w, np.zeros(len(x)), np.zeros(len(x))),
                             np.zeros(len(x), np.float32), CE, {})
                     for (x, y), w in zip(samples, weights)]
            for j, (result, term) in enumerate(zip(response.samples, terms)):
                assert_close(self, result.loss_sum, term.loss_sum, FLOAT64_RTOL,
                             f"{what} sample {j} loss_sum")
                self.check_arrays(result.logprobs, term.logprobs.detach().numpy(),
                                  ~masks[j].numpy(), f"{what} sample {j} logprobs")
                self.check_arrays(result.token_losses, term.token_losses.detach().numpy(),
                                  ~masks[j].numpy(), f"{what} sample {j} token_losses")
            params = list(model.params.values())
            surrogate = torch.autograd.grad(window_objective(terms, SUM), params,
                                            retain_graph=True)
            surrogate_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in surrogate))
            assert_close(self, step.grad_norm, surrogate_norm, FLOAT64_RTOL,
                         f"{what} grad_norm vs the surrogate")
            for (name, p), g in zip(model.params.items(), surrogate):
                expected = (p - lr * g).detach().numpy()
                self.assertLess(relative_max_diff(after[name], expected), FLOAT64_RTOL,
                                f"{what} {name} vs the surrogate")

            # Tier 2: direct autograd of DPO in the reference, whose frozen
            # copy is the reference model on the initial weights.
            frozen = ReferenceLlama(config, initial, torch.float64)
            frozen_reference = [torch.tensor(reference_logprobs(
                frozen, RLSample(x, y, None, np.zeros(len(x)), np.zeros(len(x)))))
                for x, y in samples]
            direct = torch.autograd.grad(
                dpo_loss([t.logprobs for t in terms], frozen_reference), params)
            direct_norm = math.sqrt(sum(float(g.pow(2).sum()) for g in direct))
            rtol = FLOAT64_RTOL if step_index == 1 else 1e-6
            assert_close(self, step.grad_norm, direct_norm, rtol,
                         f"{what} grad_norm vs direct DPO autograd")
            for (name, p), g in zip(model.params.items(), direct):
                expected = (p - lr * g).detach().numpy()
                self.assertLess(relative_max_diff(after[name], expected), rtol,
                                f"{what} {name} vs direct DPO autograd")
            moved = max(float(np.max(np.abs(after[n] - before[n]))) for n in after)
            self.assertGreater(moved, 1e-4, f"{what}: the step changed nothing")

    # 4 ---------------------------------------------------------------------

    def test_ppo_is_importance_sampling_inside_the_clip_range(self):
        """With every ratio inside [0.8, 1.2], PPO's min picks ratio * A
        everywhere: the same losses, gradient and update as
        importance_sampling. Then an exact clipped_fraction: 3 of 8 valid
        tokens outside [0.8, 1.2] (5 of 8 outside [0.9, 1.1]); an ignored
        target and a zero weight, both far outside, do not count."""
        self.start_server()
        calls = {loss_fn: [Call(loss_fn, {}, [0, 1, 2]), Call(loss_fn, {}, [3, 4, 5])]
                 for loss_fn in (PPO, IS)}
        ppo = self.run_window("ppo_inside", INSIDE, calls[PPO], TOKEN_MEAN)
        importance = self.run_window("is_inside", INSIDE, calls[IS], TOKEN_MEAN)
        for name, value in ppo.before.items():
            np.testing.assert_array_equal(importance.before[name], value, name)
        for call_terms in ppo.terms:
            for t in call_terms:
                self.assertTrue(np.all((t.ratios > DEFAULT_CLIP_LOW)
                                       & (t.ratios < DEFAULT_CLIP_HIGH)))
        for index, (a, b) in enumerate(zip(ppo.responses, importance.responses)):
            for j, (x, y) in enumerate(zip(a.samples, b.samples)):
                what = f"call {index} sample {j}"
                assert_close(self, x.loss_sum, y.loss_sum, FLOAT64_RTOL, what)
                self.assertLess(relative_max_diff(np.array(x.token_losses),
                                                  np.array(y.token_losses)),
                                FLOAT64_RTOL, what)
            self.assertEqual(a.policy.clipped_fraction, 0.0)
        assert_close(self, ppo.step.grad_norm, importance.step.grad_norm, FLOAT64_RTOL,
                     "grad_norm, ppo vs importance_sampling")
        for name, value in importance.after.items():
            self.assertLess(relative_max_diff(ppo.after[name], value), FLOAT64_RTOL,
                            f"ppo vs importance_sampling: {name}")

        # ratio ~ exp(-offset): 0.67, 1.35, 0.95, 1.0, 1.05, 0.61, 0.86, 1.16
        # on the valid tokens; positions 2 (ignored target) and 6 (zero
        # weight) would be far outside.
        rng = np.random.default_rng(8)
        vocab = TINY_LLAMA["vocab_size"]
        targets = [int(t) for t in rng.integers(0, vocab, 10)]
        targets[2] = IGNORE
        weights = [1.0, 2.0, 1.0, -1.0, 1.0, 0.5, 0.0, 1.0, 1.0, 1.0]
        offsets = [0.4, -0.3, 1.0, 0.05, 0.0, -0.05, -1.0, 0.5, 0.15, -0.15]
        advantages = [1.0, -1.0, 1.0, 0.5, -0.5, 2.0, 1.0, -2.0, 1.0, -1.0]
        constructed = [RLSample(rng.integers(0, vocab, 10), targets, weights,
                                advantages, offsets)]
        outcome = self.run_window("clipped_fraction", constructed,
                                  [Call(PPO, {}, [0])], TOKEN_MEAN)
        response = outcome.responses[0]
        self.assertEqual(response.valid_tokens, 8)
        self.assertEqual(response.policy.tokens, 8)
        self.assertEqual(response.policy.clipped_fraction, 3 / 8)
        self.assertEqual(response.samples[0].policy.clipped_fraction, 3 / 8)
        # The same sample, forward only, under other losses and ranges (the
        # weights moved: new sampling logprobs, same offsets).
        config, weights_now = self.weights("clipped_fraction", "now")
        model = ReferenceLlama(config, weights_now, torch.float64)
        q = [constructed[0].sampling_logprobs(reference_logprobs(model, constructed[0]))]
        for loss_fn, config_map, fraction in (
                (PPO, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, 5 / 8),
                (CISPO, {}, 3 / 8), (CISPO, {"clip_low_threshold": 0.9}, 4 / 8),
                (IS, {}, 0.0), (DRO, {"beta": 0.1}, 0.0), (CE, {}, 0.0)):
            what = f"{LOSS_NAMES[loss_fn]} {dict(config_map)}"
            response = self.forward_backward("clipped_fraction", constructed, q,
                                             Call(loss_fn, config_map, [0]), TOKEN_MEAN,
                                             forward_only=True)
            self.assertEqual(response.accumulated_calls, 0, what)
            self.assertEqual(response.policy.tokens, 8, what)
            self.assertEqual(response.policy.clipped_fraction, fraction, what)
            with torch.no_grad():
                term = RLTerms(model, constructed[0], q[0], loss_fn, config_map)
            self.assertEqual(term.clipped.sum() / 8, fraction, what)
            self.check_response(response, [term], constructed,
                                Call(loss_fn, config_map, [0]), TOKEN_MEAN, what)

    # 5 ---------------------------------------------------------------------

    def test_refused_calls_change_nothing(self):
        """Missing advantages or sampling logprobs, an unknown config key,
        dro without beta, advantages of the wrong length: INVALID_ARGUMENT
        naming the field or key. Each refused call comes after a valid one
        in the same window, its first sample well-formed; the window's
        counters stay, and the step equals the reference of the valid call
        alone."""
        self.start_server()
        model_id = "refusals"
        self.create_model(model_id, SGD)
        config, before = self.weights(model_id, "before")
        model = ReferenceLlama(config, before, torch.float64)
        q = [s.sampling_logprobs(reference_logprobs(model, s)) for s in SAMPLES]
        valid_call = Call(PPO, {}, [0, 1, 2])
        first = self.forward_backward(model_id, SAMPLES, q, valid_call, TOKEN_MEAN)
        counters = self.counters(model_id)
        self.assertEqual(counters[1:], (1, first.valid_tokens, first.num_samples,
                                        TOKEN_MEAN))

        def request(loss_fn, config, bad_sample):
            good = to_proto(SAMPLES[0], q[0], loss_fn)
            return pb.ForwardBackwardRequest(
                model_id=model_id, samples=[good, bad_sample], reduction=TOKEN_MEAN,
                loss_fn=loss_fn, loss_fn_config=config, return_logprobs=True)

        short = to_proto(SAMPLES[5], q[5], CISPO)
        del short.advantages[-1]
        cases = [
            ("ppo without advantages", "advantages",
             request(PPO, {}, to_proto(SAMPLES[5], q[5], PPO, advantages=False))),
            ("importance_sampling without sampling logprobs", "sampling_logprobs",
             request(IS, {}, to_proto(SAMPLES[5], q[5], IS, sampling=False))),
            ("cispo without sampling logprobs", "sampling_logprobs",
             request(CISPO, {}, to_proto(SAMPLES[5], q[5], CISPO, sampling=False))),
            ("dro without advantages", "advantages",
             request(DRO, {"beta": 0.1}, to_proto(SAMPLES[5], q[5], DRO, advantages=False))),
            ("ppo with an unknown config key", "clip_epsilon",
             request(PPO, {"clip_low_threshold": 0.9, "clip_epsilon": 0.2},
                     to_proto(SAMPLES[5], q[5], PPO))),
            ("dro with an unknown config key", "gamma",
             request(DRO, {"beta": 0.1, "gamma": 1.0}, to_proto(SAMPLES[5], q[5], DRO))),
            ("dro without beta", "beta",
             request(DRO, {}, to_proto(SAMPLES[5], q[5], DRO))),
            ("cispo with advantages one short", "advantages", request(CISPO, {}, short)),
        ]
        for what, named, bad_request in cases:
            with self.subTest(what):
                with self.assertRaises(grpc.RpcError) as raised:
                    self.stub.ForwardBackward(bad_request)
                error = raised.exception
                self.assertEqual(error.code(), grpc.StatusCode.INVALID_ARGUMENT,
                                 error.details())
                self.assertIn(named, error.details())
                self.assertEqual(self.counters(model_id), counters, what)

        step = self.stub.OptimStep(pb.OptimStepRequest(model_id=model_id,
                                                       max_grad_norm=0.0))
        _, after = self.weights(model_id, "after")
        terms = [RLTerms(model, SAMPLES[i], q[i], PPO, {}) for i in valid_call.indices]
        self.check_response(first, terms, SAMPLES, valid_call, TOKEN_MEAN, "valid call")
        window_objective(terms, TOKEN_MEAN).backward()
        self.assertEqual(step.normalizer, first.valid_tokens)
        assert_close(self, step.grad_norm, grad_norm(model), FLOAT64_RTOL, "grad_norm")
        _, expected = reference_step(model, SGD)
        self.check_weights(model_id, after, expected, before)


if __name__ == "__main__":
    unittest.main()
