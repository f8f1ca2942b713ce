"""Independent evidence that tally's math is Llama's.

Each test trains a tiny Llama on a running tally-server, reads the weights
tally saved before and after the step with a numpy-only safetensors reader,
and replays the same step with a Llama written here in plain PyTorch from
the HF definition (RMSNorm, rotate-half RoPE, GQA, SwiGLU, causal attention)
and torch.optim. Losses, log-probs, the gradient norm, the clip coefficient
and every updated weight must agree to ~1e-10 in float64. The Mixtral test
does the same with HF MixtralSparseMoeBlock's routing written here in torch.
The reference models live in hf_reference.py (shared with
test_hf_families.py, which covers the other families and HF directories).
"""

import math
import os
import unittest

import numpy as np
import torch

from hf_reference import (IGNORE, ReferenceLlama, ReferenceMixtral, SampleTerms,
                          parameter_names)
from tally_testing import (TINY_LLAMA, ServerTestCase, pb, read_json,
                           read_safetensors)


FLOAT64_RTOL = 1e-10
FLOAT32_RTOL = 1e-5


def make_samples():
    """Five samples of different lengths: unweighted, non-unit weights, a zero
    weight, ignored targets, and one sample with no valid token at all.
    Weights are exact in float32 so the wire format loses nothing."""
    rng = np.random.default_rng(20240611)

    def tokens(n):
        return [int(t) for t in rng.integers(0, TINY_LLAMA["vocab_size"], n)]

    samples = []
    # 0: plain, every position valid, weights omitted (all 1).
    samples.append((tokens(7), tokens(7), None))
    # 1: non-unit weights and one zero weight.
    samples.append((tokens(4), tokens(4), [1.5, 0.0, 0.25, 2.0]))
    # 2: ignored targets at the start and in the middle, mixed weights.
    targets = tokens(11)
    targets[0] = targets[1] = targets[6] = IGNORE
    samples.append((tokens(11), targets,
                    [1.0, 1.0, 0.5, 0.5, 3.0, 1.0, 1.0, 0.75, 1.0, 1.0, 1.25]))
    # 3: every target ignored; contributes nothing, counts as no sample.
    samples.append((tokens(3), [IGNORE] * 3, None))
    # 4: a single-token sample.
    samples.append((tokens(1), tokens(1), [2.5]))
    return samples


SAMPLES = make_samples()
CALLS = [SAMPLES[:2], SAMPLES[2:]]  # the accumulation window: two calls


def to_proto(sample):
    inputs, targets, weights = sample
    return pb.Sample(input_tokens=inputs, target_tokens=targets,
                     weights=weights or [])


def assert_close(test, got, expected, rtol, what):
    expected = float(expected)
    tolerance = rtol * max(abs(expected), 1e-30)
    test.assertLessEqual(abs(got - expected), tolerance,
                         f"{what}: tally {got!r}, reference {expected!r}")


def relative_max_diff(got, expected):
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    return float(np.max(np.abs(got - expected))) / scale


class LlamaReferenceTest(ServerTestCase):

    def create_model(self, model_id, dtype, tie, optimizer, moe=None, **kwargs):
        config = pb.ModelConfig(tie_word_embeddings=tie, **TINY_LLAMA,
                                **(moe or {}))
        info = self.stub.CreateModel(pb.CreateModelRequest(
            model_id=model_id, config=config, seed=7, dtype=dtype,
            optimizer=optimizer, **kwargs))
        self.assertEqual(info.model_id, model_id)
        return info

    def save(self, model_id, name):
        path = os.path.join(self.temp_dir, name)
        self.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model_id=model_id,
                                                          path=path))
        return path

    def read_checkpoint(self, path, tie, safetensors_dtype, moe=None):
        """(config.json, {name: array}) after checking both against the
        model that was asked for."""
        config = read_json(os.path.join(path, "config.json"))
        for field, value in dict(TINY_LLAMA, **(moe or {})).items():
            self.assertEqual(config[field], value, f"config.json {field}")
        self.assertEqual(config["tie_word_embeddings"], tie)
        tensors = read_safetensors(os.path.join(path, "model.safetensors"))
        # A tied model stores no lm_head.weight, as HF does.
        self.assertEqual(sorted(tensors), parameter_names(config))
        for name, value in tensors.items():
            self.assertEqual(value.dtype, np.dtype(safetensors_dtype), name)
        return config, tensors

    def forward_backward(self, model_id, calls, reduction, return_logprobs=False,
                         forward_only=False):
        return [self.stub.ForwardBackward(pb.ForwardBackwardRequest(
            model_id=model_id, samples=[to_proto(s) for s in call],
            reduction=reduction, return_logprobs=return_logprobs,
            forward_only=forward_only)) for call in calls]

    def check_call_losses(self, responses, reference_calls, reduction, rtol):
        """Per-call and per-sample loss_sum, valid_tokens, loss_mean and the
        window counters against the reference terms."""
        window_tokens = window_samples = 0
        for index, (response, terms) in enumerate(zip(responses, reference_calls)):
            what = f"call {index}"
            self.assertEqual(len(response.samples), len(terms), what)
            for j, (result, term) in enumerate(zip(response.samples, terms)):
                assert_close(self, result.loss_sum, term.loss_sum, rtol,
                             f"{what} sample {j} loss_sum")
                self.assertEqual(result.valid_tokens, term.valid_tokens,
                                 f"{what} sample {j} valid_tokens")
            loss_sum = sum(float(t.loss_sum) for t in terms)
            tokens = sum(t.valid_tokens for t in terms)
            counted = [t for t in terms if t.valid_tokens > 0]
            assert_close(self, response.loss_sum, loss_sum, rtol, f"{what} loss_sum")
            self.assertEqual(response.valid_tokens, tokens, f"{what} valid_tokens")
            self.assertEqual(response.num_samples, len(counted), f"{what} num_samples")
            if reduction == pb.LOSS_REDUCTION_SAMPLE_MEAN:
                mean = sum(float(t.loss_sum) / t.valid_tokens
                           for t in counted) / len(counted)
            else:
                mean = loss_sum / tokens
            assert_close(self, response.loss_mean, mean, rtol, f"{what} loss_mean")
            window_tokens += tokens
            window_samples += len(counted)
            self.assertEqual(response.accumulated_calls, index + 1, what)
            self.assertEqual(response.accumulated_tokens, window_tokens, what)
            self.assertEqual(response.accumulated_samples, window_samples, what)

    def reference_window(self, model):
        """SampleTerms of every sample, grouped by call."""
        return [[SampleTerms(model, s) for s in call] for call in CALLS]

    def check_weights(self, model_id, after, reference, before):
        for name, expected in reference.items():
            diff = relative_max_diff(after[name], expected)
            self.assertLess(diff, FLOAT64_RTOL, f"{model_id}: updated {name}")
        moved = max(float(np.max(np.abs(after[n] - before[n]))) for n in after)
        self.assertGreater(moved, 1e-3, f"{model_id}: the step changed nothing")

    def run_token_mean_adamw(self, tie):
        """Two-call TOKEN_MEAN window then a clipped AdamW step."""
        model_id = "tied" if tie else "untied"
        lr, betas, eps, weight_decay, max_norm = 1e-2, (0.9, 0.95), 1e-8, 0.1, 0.05
        adam = pb.AdamParams(learning_rate=lr, beta1=betas[0], beta2=betas[1],
                             eps=eps, weight_decay=weight_decay)
        if tie:  # hyperparameters from the step request, over other defaults
            self.create_model(model_id, pb.DTYPE_FLOAT64, tie, pb.OPTIMIZER_ADAMW,
                              default_adam=pb.AdamParams(learning_rate=1e-3),
                              default_max_grad_norm=100.0)
            step_request = pb.OptimStepRequest(model_id=model_id, adam=adam,
                                               max_grad_norm=max_norm)
        else:  # hyperparameters from the model's defaults
            self.create_model(model_id, pb.DTYPE_FLOAT64, tie, pb.OPTIMIZER_ADAMW,
                              default_adam=adam, default_max_grad_norm=max_norm)
            step_request = pb.OptimStepRequest(model_id=model_id)

        config, before = self.read_checkpoint(self.save(model_id, "A"), tie, "<f8")
        responses = self.forward_backward(model_id, CALLS,
                                          pb.LOSS_REDUCTION_TOKEN_MEAN)
        step = self.stub.OptimStep(step_request)
        _, after = self.read_checkpoint(self.save(model_id, "B"), tie, "<f8")

        model = ReferenceLlama(config, before, torch.float64)
        terms = self.reference_window(model)
        self.check_call_losses(responses, terms, pb.LOSS_REDUCTION_TOKEN_MEAN,
                               FLOAT64_RTOL)

        flat = [t for call in terms for t in call]
        tokens = sum(t.valid_tokens for t in flat)
        loss = sum(t.loss_sum for t in flat) / tokens
        loss.backward()
        params = list(model.params.values())
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
        clip_coef = min(1.0, max_norm / (norm + 1e-6))

        self.assertEqual(step.step, 1)
        self.assertFalse(step.skipped, step.skip_reason)
        self.assertEqual(step.normalizer, tokens)
        self.assertEqual(step.learning_rate, lr)
        assert_close(self, step.grad_norm, norm, FLOAT64_RTOL, "grad_norm")
        assert_close(self, step.clip_coef, clip_coef, FLOAT64_RTOL, "clip_coef")
        self.assertLess(step.clip_coef, 0.9, "clipping must be active")

        with torch.no_grad():
            for p in params:
                p.grad.mul_(clip_coef)
        optimizer = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps,
                                      weight_decay=weight_decay)
        optimizer.step()
        reference = {n: p.detach().numpy() for n, p in model.params.items()}
        self.check_weights(model_id, after, reference, before)

    def test_token_mean_adamw_untied(self):
        self.start_server()
        self.run_token_mean_adamw(tie=False)

    def test_token_mean_adamw_tied(self):
        self.start_server()
        self.run_token_mean_adamw(tie=True)

    def test_sample_mean_sgd_with_logprobs(self):
        """SAMPLE_MEAN window, SGD step, per-position logprobs.

        SGD because the gradient's scale shows in its weights; AdamW's first
        step would hide a constant factor."""
        self.start_server()
        model_id = "sgd"
        lr, weight_decay = 0.5, 0.1
        self.create_model(model_id, pb.DTYPE_FLOAT64, False, pb.OPTIMIZER_SGD,
                          default_adam=pb.AdamParams(learning_rate=lr,
                                                     weight_decay=weight_decay))
        config, before = self.read_checkpoint(self.save(model_id, "A"), False, "<f8")
        responses = self.forward_backward(model_id, CALLS,
                                          pb.LOSS_REDUCTION_SAMPLE_MEAN,
                                          return_logprobs=True)
        step = self.stub.OptimStep(pb.OptimStepRequest(model_id=model_id,
                                                       max_grad_norm=0.0))
        _, after = self.read_checkpoint(self.save(model_id, "B"), False, "<f8")

        model = ReferenceLlama(config, before, torch.float64)
        terms = self.reference_window(model)
        self.check_call_losses(responses, terms, pb.LOSS_REDUCTION_SAMPLE_MEAN,
                               FLOAT64_RTOL)
        for index, (response, call_terms) in enumerate(zip(responses, terms)):
            for j, (result, term) in enumerate(zip(response.samples, call_terms)):
                expected = term.logprobs.detach().numpy()
                got = np.array(result.logprobs)
                self.assertEqual(got.shape, expected.shape,
                                 f"call {index} sample {j} logprobs")
                self.assertLess(relative_max_diff(got, expected), FLOAT64_RTOL,
                                f"call {index} sample {j} logprobs: tally {got}, "
                                f"reference {expected}")
                ignored = [t == IGNORE for t in CALLS[index][j][1]]
                self.assertTrue(np.all(got[ignored] == 0.0))

        counted = [t for call in terms for t in call if t.valid_tokens > 0]
        loss = sum(t.loss_sum / t.valid_tokens for t in counted) / len(counted)
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum())
                             for p in model.params.values()))
        self.assertEqual(step.normalizer, len(counted))
        assert_close(self, step.grad_norm, norm, FLOAT64_RTOL, "grad_norm")
        self.assertEqual(step.clip_coef, 1.0)

        reference = {}
        with torch.no_grad():
            for name, p in model.params.items():
                reference[name] = (p * (1 - lr * weight_decay) - lr * p.grad).numpy()
        self.check_weights(model_id, after, reference, before)

    def test_float32_forward_loss(self):
        self.start_server()
        model_id = "f32"
        self.create_model(model_id, pb.DTYPE_FLOAT32, False, pb.OPTIMIZER_ADAMW)
        config, weights = self.read_checkpoint(self.save(model_id, "A"), False, "<f4")
        responses = self.forward_backward(model_id, [SAMPLES],
                                          pb.LOSS_REDUCTION_TOKEN_MEAN,
                                          forward_only=True)
        model = ReferenceLlama(config, weights, torch.float32)
        with torch.no_grad():
            terms = [SampleTerms(model, s) for s in SAMPLES]
        response = responses[0]
        for j, (result, term) in enumerate(zip(response.samples, terms)):
            assert_close(self, result.loss_sum, term.loss_sum, FLOAT32_RTOL,
                         f"sample {j} loss_sum")
        tokens = sum(t.valid_tokens for t in terms)
        self.assertEqual(response.valid_tokens, tokens)
        assert_close(self, response.loss_mean,
                     sum(float(t.loss_sum) for t in terms) / tokens,
                     FLOAT32_RTOL, "loss_mean")
        # forward_only accumulates nothing.
        self.assertEqual(response.accumulated_calls, 0)
        info = self.stub.GetModel(pb.GetModelRequest(model_id=model_id))
        self.assertEqual(info.accumulated_calls, 0)
        self.assertEqual(info.accumulated_tokens, 0)

    def test_mixtral_sgd(self):
        """A 4-expert top-2 Mixtral: TOKEN_MEAN and SAMPLE_MEAN windows, SGD
        steps, against MixtralSparseMoeBlock semantics, through HF's
        per-expert checkpoint names; then with HF's load_balancing_loss_func
        per sample (output_router_logits true), and a coefficient without
        output_router_logits, which adds nothing (HF semantics). One call
        holds a single token, so in that call two experts of every layer
        receive none."""
        self.start_server()
        calls = [[SAMPLES[4]], SAMPLES[:4]]
        lr = 0.5
        for reduction, aux_coef, router_logits in (
                (pb.LOSS_REDUCTION_TOKEN_MEAN, 0.0, False),
                (pb.LOSS_REDUCTION_SAMPLE_MEAN, 0.0, False),
                (pb.LOSS_REDUCTION_TOKEN_MEAN, 0.25, False),
                (pb.LOSS_REDUCTION_SAMPLE_MEAN, 0.25, True)):
            moe = {"num_local_experts": 4, "num_experts_per_tok": 2,
                   "router_aux_loss_coef": aux_coef}
            if router_logits:
                moe["output_router_logits"] = True
            model_id = f"mixtral{reduction}_{aux_coef}_{router_logits}"
            self.create_model(model_id, pb.DTYPE_FLOAT64, False, pb.OPTIMIZER_SGD,
                              moe=moe, default_adam=pb.AdamParams(
                                  learning_rate=lr, weight_decay=0.0))
            config, before = self.read_checkpoint(
                self.save(model_id, f"A{model_id}"), False, "<f8", moe)
            self.assertEqual(config["model_type"], "mixtral")
            responses = self.forward_backward(model_id, calls, reduction)
            step = self.stub.OptimStep(pb.OptimStepRequest(model_id=model_id,
                                                           max_grad_norm=0.0))
            _, after = self.read_checkpoint(
                self.save(model_id, f"B{model_id}"), False, "<f8", moe)

            model = ReferenceMixtral(config, before, torch.float64)
            terms = [[SampleTerms(model, s) for s in call] for call in calls]
            self.check_call_losses(responses, terms, reduction, FLOAT64_RTOL)
            flat = [t for call in terms for t in call if t.valid_tokens > 0]
            if reduction == pb.LOSS_REDUCTION_TOKEN_MEAN:
                loss = sum(t.loss_sum for t in flat) / sum(t.valid_tokens for t in flat)
            else:
                loss = sum(t.loss_sum / t.valid_tokens for t in flat) / len(flat)
            loss.backward()
            for p in model.params.values():  # an expert no token reached
                if p.grad is None:
                    p.grad = torch.zeros_like(p)

            def norm(names):
                return math.sqrt(sum(float(model.params[n].grad.pow(2).sum())
                                     for n in names))
            expert_names = [n for n in model.params if ".experts." in n]
            dense_names = [n for n in model.params if ".experts." not in n]
            assert_close(self, step.grad_norm, norm(model.params), FLOAT64_RTOL,
                         "grad_norm")
            assert_close(self, step.metrics["grad_norm_expert"], norm(expert_names),
                         FLOAT64_RTOL, "grad_norm_expert")
            assert_close(self, step.metrics["grad_norm_dense"], norm(dense_names),
                         FLOAT64_RTOL, "grad_norm_dense")
            with torch.no_grad():
                reference = {n: (p - lr * p.grad).numpy()
                             for n, p in model.params.items()}
            self.check_weights(model_id, after, reference, before)


if __name__ == "__main__":
    unittest.main()
