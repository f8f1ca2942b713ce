"""Independent evidence that tally's math is Llama's.

Each test trains a tiny Llama on a running tally-server, reads the weights
tally saved before and after the step with a numpy-only safetensors reader,
and replays the same step with a Llama written here in plain PyTorch from
the HF definition (RMSNorm, rotate-half RoPE, GQA, SwiGLU, causal attention)
and torch.optim. Losses, log-probs, the gradient norm, the clip coefficient
and every updated weight must agree to ~1e-10 in float64. The Mixtral test
does the same with HF MixtralSparseMoeBlock's routing written here in torch.
"""

import math
import os
import unittest

import numpy as np
import torch

from tally_testing import (TINY_LLAMA, ServerTestCase, pb, read_json,
                           read_safetensors)

IGNORE = -100


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


def parameter_names(config):
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + "input_layernorm.weight",
                  p + "post_attention_layernorm.weight"]
        names += [p + f"self_attn.{m}_proj.weight" for m in "qkvo"]
        if config.get("num_local_experts", 0) > 0:
            moe = p + "block_sparse_moe."
            names.append(moe + "gate.weight")
            names += [moe + f"experts.{e}.{w}.weight"
                      for e in range(config["num_local_experts"])
                      for w in ("w1", "w2", "w3")]
        else:
            names += [p + f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")]
    if not config["tie_word_embeddings"]:
        names.append("lm_head.weight")
    return sorted(names)


class ReferenceLlama:
    """HF LlamaForCausalLM's forward pass, one unpadded sequence at a time."""

    def __init__(self, config, tensors, dtype):
        self.config = config
        self.dtype = dtype
        self.params = {name: torch.tensor(value, dtype=dtype, requires_grad=True)
                       for name, value in tensors.items()}
        self.heads = config["num_attention_heads"]
        self.kv_heads = config["num_key_value_heads"]
        self.head_dim = config["hidden_size"] // self.heads

    def lm_head(self):
        if self.config["tie_word_embeddings"]:
            return self.params["model.embed_tokens.weight"]
        return self.params["lm_head.weight"]

    def rms_norm(self, x, weight):
        eps = self.config["rms_norm_eps"]
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rotary(self, length):
        d = self.head_dim
        exponents = torch.arange(0, d, 2, dtype=torch.float64) / d
        inv_freq = 1.0 / (self.config["rope_theta"] ** exponents)
        angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)  # [T, d]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)

    @staticmethod
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def attention(self, x, prefix, cos, sin):
        p = self.params
        length = x.shape[0]
        d = self.head_dim

        def project(name, heads):  # [heads, T, d]
            out = x @ p[prefix + name].T
            return out.view(length, heads, d).transpose(0, 1)

        q = project("q_proj.weight", self.heads)
        k = project("k_proj.weight", self.kv_heads)
        v = project("v_proj.weight", self.kv_heads)
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        # Query head j reads kv head j // (heads / kv_heads).
        group = self.heads // self.kv_heads
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(d)
        future = torch.triu(torch.ones(length, length, dtype=torch.bool), 1)
        scores = scores.masked_fill(future, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [H, T, d]
        out = out.transpose(0, 1).reshape(length, self.heads * d)
        return out @ p[prefix + "o_proj.weight"].T

    def mlp(self, x, prefix):
        p = self.params
        prefix += "mlp."
        gate = x @ p[prefix + "gate_proj.weight"].T
        up = x @ p[prefix + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ p[prefix + "down_proj.weight"].T


    def log_probs(self, inputs):
        """log_softmax of the logits, [T, vocab]; positions restart at 0."""
        p = self.params
        x = p["model.embed_tokens.weight"][torch.tensor(inputs)]
        cos, sin = self.rotary(len(inputs))
        for i in range(self.config["num_hidden_layers"]):
            prefix = f"model.layers.{i}."
            h = self.rms_norm(x, p[prefix + "input_layernorm.weight"])
            x = x + self.attention(h, prefix + "self_attn.", cos, sin)
            h = self.rms_norm(x, p[prefix + "post_attention_layernorm.weight"])
            x = x + self.mlp(h, prefix)
        x = self.rms_norm(x, p["model.norm.weight"])
        return torch.log_softmax(x @ self.lm_head().T, dim=-1)


class ReferenceMixtral(ReferenceLlama):
    """HF MixtralForCausalLM: the MLP is MixtralSparseMoeBlock. The router
    softmax runs in the model dtype (HF upcasts to float32, the same for a
    float32 model). `aux` holds tally's per-token load-balancing term of the
    last log_probs: the mean over layers of E * (sum of the token's top-k
    router probabilities)."""

    def log_probs(self, inputs):
        self.aux = 0
        return super().log_probs(inputs)

    def mlp(self, x, prefix):
        p = self.params
        prefix += "block_sparse_moe."
        experts = self.config["num_local_experts"]
        top_k = self.config["num_experts_per_tok"]
        router_logits = x @ p[prefix + "gate.weight"].T  # [T, E]
        routing = torch.softmax(router_logits, dim=1)
        routing, selected = torch.topk(routing, top_k, dim=-1)
        layers = self.config["num_hidden_layers"]
        self.aux = self.aux + experts * routing.sum(dim=-1) / layers
        routing = routing / routing.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        # expert_mask[e, k, t]: token t's k-th choice is expert e.
        expert_mask = torch.nn.functional.one_hot(selected, experts).permute(2, 1, 0)
        for e in range(experts):
            choice, tokens = torch.where(expert_mask[e])
            if tokens.numel() == 0:
                continue
            w = lambda n: p[prefix + f"experts.{e}.{n}.weight"]
            h = x[tokens]
            y = (torch.nn.functional.silu(h @ w("w1").T) * (h @ w("w3").T)) @ w("w2").T
            out = out.index_add(0, tokens, y * routing[tokens, choice, None])
        return out


class SampleTerms:
    """One sample's reference quantities."""

    def __init__(self, model, sample):
        inputs, targets, weights = sample
        weights = weights if weights is not None else [1.0] * len(inputs)
        logp = model.log_probs(inputs)
        safe_targets = torch.tensor([max(t, 0) for t in targets])
        target_logp = logp.gather(1, safe_targets[:, None])[:, 0]
        ignored = torch.tensor([t == IGNORE for t in targets])
        self.logprobs = target_logp.masked_fill(ignored, 0.0)
        valid = [t != IGNORE and w > 0 for t, w in zip(targets, weights)]
        w = torch.tensor(weights, dtype=model.dtype) * torch.tensor(valid)
        token_loss = -self.logprobs
        aux_coef = model.config.get("router_aux_loss_coef", 0.0)
        if aux_coef > 0:  # tally adds the load-balancing term per token
            token_loss = token_loss + aux_coef * model.aux
        self.loss_sum = (w * token_loss).sum()  # sum of w * token loss
        self.valid_tokens = sum(valid)


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
        per-expert checkpoint names; then with tally's load-balancing loss.
        One call holds a single token, so in that call two experts of every
        layer receive none."""
        self.start_server()
        calls = [[SAMPLES[4]], SAMPLES[:4]]
        lr = 0.5
        for reduction, aux_coef in ((pb.LOSS_REDUCTION_TOKEN_MEAN, 0.0),
                                    (pb.LOSS_REDUCTION_SAMPLE_MEAN, 0.0),
                                    (pb.LOSS_REDUCTION_SAMPLE_MEAN, 0.25)):
            moe = {"num_local_experts": 4, "num_experts_per_tok": 2,
                   "router_aux_loss_coef": aux_coef}
            model_id = f"mixtral{reduction}_{aux_coef}"
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
