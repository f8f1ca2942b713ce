"""Independent float64 references of the HF causal LM families tally trains,
written here in plain PyTorch from transformers' published definitions, plus
a writer of tiny HF model directories (config.json + bf16, fp16, fp32 or fp64
safetensors).

Nothing here reads tally's C++ code. Every piece names the HF function it
restates; "HF" below means transformers' files:

  models/llama/modeling_llama.py      LlamaAttention, LlamaMLP, LlamaRMSNorm,
                                      rotate_half, apply_rotary_pos_emb,
                                      repeat_kv, eager_attention_forward
  models/qwen2/modeling_qwen2.py      Qwen2Attention (q/k/v bias, no o bias)
  models/qwen2/configuration_qwen2.py Qwen2Config.__post_init__ (layer_types)
  models/qwen3/modeling_qwen3.py      Qwen3Attention (q_norm / k_norm)
  models/qwen3/configuration_qwen3.py Qwen3Config.__post_init__ (layer_types)
  models/mistral/modeling_mistral.py  MistralModel (sliding window mask)
  models/mixtral/modeling_mixtral.py  MixtralSparseMoeBlock,
                                      load_balancing_loss_func,
                                      MixtralForCausalLM.forward (aux loss)
  modeling_rope_utils.py              _compute_default_rope_parameters,
                                      _compute_linear_scaling_rope_parameters,
                                      _compute_llama3_parameters
  masking_utils.py                    causal_mask_function,
                                      sliding_window_overlay

greedy_decode is HF's generate(do_sample=False) on such a model, and running
this file decodes prompts greedily from an HF directory (one JSON line per
prompt), the independent side of tally's decoding tests:

  python3 hf_reference.py greedy --model DIR --prompt 1,5,9 --prompt 4,2 \
      --max-tokens 12 [--dtype float32]

A reference runs one unpadded sequence at a time (batch 1, attention_mask
None, position_ids 0..T-1), in the dtype it is given (float64 for the exact
tests). Where HF computes in float32 inside a float64 model (the rotary
tables, the attention and router softmaxes, RMSNorm's upcast), the reference
stays in float64: tally's contract is HF's math carried out in the model
dtype, not HF's float32 round-offs.
"""

import argparse
import json
import math
import os
import struct

import numpy as np
import torch

IGNORE = -100

FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


# ---------------------------------------------------------------------------
# Config interpretation (HF configuration_*.py defaults and derived fields)
# ---------------------------------------------------------------------------

def model_type(config):
    """config.json's model_type; a config without one (tally's older
    checkpoints) is "mixtral" with experts, else "llama"."""
    if config.get("model_type"):
        return config["model_type"]
    return "mixtral" if config.get("num_local_experts", 0) > 0 else "llama"


def num_experts(config):
    return config.get("num_local_experts", 0) if model_type(config) == "mixtral" else 0


def head_dim(config):
    """LlamaConfig/Qwen3Config/MistralConfig: head_dim, None meaning
    hidden_size // num_attention_heads (HF's
    `getattr(config, "head_dim", None) or hidden_size // num_attention_heads`)."""
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def num_kv_heads(config):
    # Every family: num_key_value_heads None -> num_attention_heads.
    return config.get("num_key_value_heads") or config["num_attention_heads"]


def tie_word_embeddings(config):
    return bool(config.get("tie_word_embeddings", False))


def attention_biases(config):
    """(q/k/v have a bias, o_proj has a bias), per family.

    LlamaAttention, Qwen3Attention: every projection bias=config.attention_bias.
    Qwen2Attention: q, k, v bias=True, o_proj bias=False (no config field).
    MistralAttention, MixtralAttention: no bias."""
    family = model_type(config)
    if family in ("llama", "qwen3"):
        bias = bool(config.get("attention_bias", False))
        return bias, bias
    if family == "qwen2":
        return True, False
    return False, False


def mlp_bias(config):
    # LlamaMLP: gate/up/down bias=config.mlp_bias; Qwen2MLP, Qwen3MLP,
    # MistralMLP and Mixtral's experts have none.
    return model_type(config) == "llama" and bool(config.get("mlp_bias", False))


def has_qk_norm(config):
    # Qwen3Attention: q_norm / k_norm = Qwen3RMSNorm(head_dim, rms_norm_eps).
    return model_type(config) == "qwen3"


def rms_norm_eps(config):
    default = 1e-5 if model_type(config) == "mixtral" else 1e-6
    return config.get("rms_norm_eps", default)


def layer_windows(config):
    """The sliding window of each decoder layer, None for full causal
    attention.

    llama: no sliding window (LlamaConfig has none).
    mistral, mixtral: MistralModel/MixtralModel use
      create_sliding_window_causal_mask for every layer when
      config.sliding_window is not None, else create_causal_mask.
    qwen2, qwen3: Qwen2Config/Qwen3Config.__post_init__:
      sliding_window = sliding_window if use_sliding_window else None
      layer_types (when not given) = ["sliding_attention" if sliding_window
        is not None and i >= max_window_layers else "full_attention"]
      so the layers with index >= max_window_layers slide (the first
      max_window_layers layers attend fully); Qwen2DecoderLayer/
      Qwen3DecoderLayer pick the mask by config.layer_types[layer_idx]. An
      explicit layer_types list in config.json wins over max_window_layers.
    """
    layers = config["num_hidden_layers"]
    family = model_type(config)
    if family in ("mistral", "mixtral"):
        return [config.get("sliding_window")] * layers
    if family in ("qwen2", "qwen3"):
        window = config.get("sliding_window") if config.get("use_sliding_window") else None
        types = config.get("layer_types")
        if types is None:
            max_window_layers = config.get("max_window_layers", 28)
            types = ["sliding_attention" if window is not None and i >= max_window_layers
                     else "full_attention" for i in range(layers)]
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        windows = []
        for kind in types:
            if kind == "sliding_attention":
                if window is None:
                    raise ValueError("a sliding_attention layer without a sliding window")
                windows.append(window)
            elif kind == "full_attention":
                windows.append(None)
            else:
                raise ValueError(f"layer type {kind!r}")
        return windows
    return [None] * layers


def attention_allowed(length, window):
    """[T, T] bool: query q may read key k.

    masking_utils.causal_mask_function: kv_idx <= q_idx; and_masks with
    sliding_window_overlay(sliding_window): kv_idx > q_idx - sliding_window.
    So with a window W, key j is visible to query i iff 0 <= i - j < W: the W
    latest positions, the query's own included (W = 1: only itself)."""
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (k > q - window)
    return allowed


# ---------------------------------------------------------------------------
# RoPE (modeling_rope_utils.py), in float64
# ---------------------------------------------------------------------------

def rope_settings(config):
    """(rope_theta, rope scaling dict with "rope_type") from a config.json of
    transformers 4.x (rope_theta + rope_scaling, whose "type" key is the old
    spelling of "rope_type") or 5.x (rope_parameters holding rope_theta)."""
    scaling = config.get("rope_parameters") or config.get("rope_scaling") or {}
    scaling = dict(scaling)
    if "rope_type" not in scaling and "type" in scaling:
        scaling["rope_type"] = scaling.pop("type")
    scaling.setdefault("rope_type", "default")
    default_theta = 1e6 if model_type(config) == "mixtral" else 10000.0
    theta = scaling.get("rope_theta", config.get("rope_theta", default_theta))
    return float(theta), scaling


def default_inv_freq(config):
    """_compute_default_rope_parameters: 1 / base ** (arange(0, dim, 2) / dim),
    dim = head_dim (partial_rotary_factor 1 for these families)."""
    theta, _ = rope_settings(config)
    dim = head_dim(config)
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float64) / dim
    return 1.0 / (theta ** exponents)


def llama3_bands(config):
    """Which branch of _compute_llama3_parameters each inverse frequency
    takes: "high" (wavelen < high_freq_wavelen: kept), "low" (wavelen >
    low_freq_wavelen: divided by factor) or "medium" (smoothly interpolated)."""
    _, scaling = rope_settings(config)
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / scaling["low_freq_factor"]
    high_freq_wavelen = old_context_len / scaling["high_freq_factor"]
    wavelen = 2 * math.pi / default_inv_freq(config)
    return ["high" if w < high_freq_wavelen else "low" if w > low_freq_wavelen else "medium"
            for w in wavelen.tolist()]


def rope_inv_freq(config):
    """The inverse frequencies [head_dim / 2] of ROPE_INIT_FUNCTIONS[rope_type]
    (attention_scaling is 1 for every type handled here)."""
    _, scaling = rope_settings(config)
    rope_type = scaling["rope_type"]
    inv_freq = default_inv_freq(config)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # _compute_linear_scaling_rope_parameters: inv_freq /= factor.
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # _compute_llama3_parameters, line by line.
        factor = scaling["factor"]
        low_freq_factor = scaling["low_freq_factor"]
        high_freq_factor = scaling["high_freq_factor"]
        old_context_len = scaling["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # wavelen < high_freq_wavelen: do nothing; > low_freq_wavelen: / factor
        inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        # otherwise: interpolate between the two, using a smooth factor
        smooth_factor = ((old_context_len / wavelen - low_freq_factor)
                         / (high_freq_factor - low_freq_factor))
        smoothed_inv_freq = ((1 - smooth_factor) * inv_freq_llama / factor
                             + smooth_factor * inv_freq_llama)
        is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)
    raise NotImplementedError(f"rope_type {rope_type!r} has no reference here")


def rope_tables(config, length):
    """LlamaRotaryEmbedding.forward: freqs = positions x inv_freq,
    emb = cat(freqs, freqs); (cos, sin) of [T, head_dim], float64."""
    angles = torch.outer(torch.arange(length, dtype=torch.float64), rope_inv_freq(config))
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


# ---------------------------------------------------------------------------
# Parameter names and shapes (HF state_dict names)
# ---------------------------------------------------------------------------

def parameter_shapes(config):
    """{HF parameter name: shape} of the family's *ForCausalLM. A tied model
    has no lm_head.weight (HF saves the embedding only)."""
    hidden = config["hidden_size"]
    inter = config["intermediate_size"]
    vocab = config["vocab_size"]
    heads = config["num_attention_heads"]
    kv = num_kv_heads(config)
    d = head_dim(config)
    qkv_bias, o_bias = attention_biases(config)
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tie_word_embeddings(config):
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        a = p + "self_attn."
        for name, out in (("q", heads * d), ("k", kv * d), ("v", kv * d)):
            shapes[a + f"{name}_proj.weight"] = (out, hidden)
            if qkv_bias:
                shapes[a + f"{name}_proj.bias"] = (out,)
        shapes[a + "o_proj.weight"] = (hidden, heads * d)
        if o_bias:
            shapes[a + "o_proj.bias"] = (hidden,)
        if has_qk_norm(config):
            shapes[a + "q_norm.weight"] = (d,)
            shapes[a + "k_norm.weight"] = (d,)
        experts = num_experts(config)
        if experts:
            moe = p + "block_sparse_moe."
            shapes[moe + "gate.weight"] = (experts, hidden)
            for e in range(experts):
                shapes[moe + f"experts.{e}.w1.weight"] = (inter, hidden)
                shapes[moe + f"experts.{e}.w3.weight"] = (inter, hidden)
                shapes[moe + f"experts.{e}.w2.weight"] = (hidden, inter)
        else:
            m = p + "mlp."
            shapes[m + "gate_proj.weight"] = (inter, hidden)
            shapes[m + "up_proj.weight"] = (inter, hidden)
            shapes[m + "down_proj.weight"] = (hidden, inter)
            if mlp_bias(config):
                shapes[m + "gate_proj.bias"] = (inter,)
                shapes[m + "up_proj.bias"] = (inter,)
                shapes[m + "down_proj.bias"] = (hidden,)
    return shapes


def parameter_names(config):
    return sorted(parameter_shapes(config))


# ---------------------------------------------------------------------------
# The reference model
# ---------------------------------------------------------------------------

class ReferenceCausalLM:
    """HF <Family>ForCausalLM's forward pass for llama, mistral, mixtral,
    qwen2 and qwen3, one unpadded sequence at a time. `tensors` maps HF names
    to arrays; they become leaf tensors of `dtype` with requires_grad."""

    def __init__(self, config, tensors, dtype=torch.float64):
        self.config = config
        self.dtype = dtype
        self.family = model_type(config)
        if self.family not in FAMILIES:
            raise NotImplementedError(f"model_type {self.family!r}")
        expected = set(parameter_shapes(config))
        if set(tensors) != expected:
            raise ValueError(f"tensors do not match the config: missing "
                             f"{sorted(expected - set(tensors))}, extra "
                             f"{sorted(set(tensors) - expected)}")
        self.params = {name: torch.tensor(np.asarray(value), dtype=dtype, requires_grad=True)
                       for name, value in tensors.items()}
        self.heads = config["num_attention_heads"]
        self.kv_heads = num_kv_heads(config)
        self.head_dim = head_dim(config)
        self.eps = rms_norm_eps(config)
        self.windows = layer_windows(config)
        self.experts = num_experts(config)
        self.router_logits = []

    def lm_head(self):
        # *ForCausalLM._tied_weights_keys = ["lm_head.weight"].
        if tie_word_embeddings(self.config):
            return self.params["model.embed_tokens.weight"]
        return self.params["lm_head.weight"]

    def rms_norm(self, x, weight):
        # LlamaRMSNorm (= Qwen2/Qwen3/Mistral/MixtralRMSNorm):
        # weight * x * rsqrt(mean(x^2, -1) + eps).
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def linear(self, x, name):
        # nn.Linear: x @ W^T + b, the bias when the model has one.
        out = x @ self.params[name + ".weight"].T
        bias = self.params.get(name + ".bias")
        return out if bias is None else out + bias

    def rotary(self, length):
        cos, sin = rope_tables(self.config, length)
        return cos.to(self.dtype), sin.to(self.dtype)

    @staticmethod
    def rotate_half(x):
        # rotate_half: cat(-x2, x1).
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def attention(self, x, prefix, cos, sin, window):
        """LlamaAttention.forward + eager_attention_forward; Qwen3Attention's
        q_norm/k_norm on each head's head_dim vector after the projection and
        before RoPE."""
        length = x.shape[0]
        d = self.head_dim

        def project(name, heads):  # [T, heads, d]
            return self.linear(x, prefix + name).view(length, heads, d)

        q = project("q_proj", self.heads)
        k = project("k_proj", self.kv_heads)
        v = project("v_proj", self.kv_heads)
        if has_qk_norm(self.config):
            q = self.rms_norm(q, self.params[prefix + "q_norm.weight"])
            k = self.rms_norm(k, self.params[prefix + "k_norm.weight"])
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, T, d]
        # apply_rotary_pos_emb: x * cos + rotate_half(x) * sin.
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        # repeat_kv: query head h reads kv head h // (heads / kv_heads).
        group = self.heads // self.kv_heads
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        # scaling = head_dim ** -0.5.
        scores = (q @ k.transpose(1, 2)) * d ** -0.5
        allowed = attention_allowed(length, window)
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v  # [H, T, d]
        out = out.transpose(0, 1).reshape(length, self.heads * d)
        return self.linear(out, prefix + "o_proj")

    def mlp(self, x, prefix):
        if self.experts:
            return self.sparse_moe(x, prefix + "block_sparse_moe.")
        # LlamaMLP: down(silu(gate(x)) * up(x)).
        prefix += "mlp."
        gate = self.linear(x, prefix + "gate_proj")
        up = self.linear(x, prefix + "up_proj")
        return self.linear(torch.nn.functional.silu(gate) * up, prefix + "down_proj")

    def sparse_moe(self, x, prefix):
        """MixtralSparseMoeBlock.forward (no jitter: router_jitter_noise 0).
        The router softmax runs in the model dtype (HF: float32)."""
        p = self.params
        top_k = self.config.get("num_experts_per_tok", 2)
        router_logits = x @ p[prefix + "gate.weight"].T  # [T, E]
        self.router_logits.append(router_logits)
        routing = torch.softmax(router_logits, dim=1)
        routing, selected = torch.topk(routing, top_k, dim=-1)
        routing = routing / routing.sum(dim=-1, keepdim=True)
        out = torch.zeros_like(x)
        # expert_mask[e, k, t]: token t's k-th choice is expert e.
        expert_mask = torch.nn.functional.one_hot(selected, self.experts).permute(2, 1, 0)
        for e in range(self.experts):
            choice, tokens = torch.where(expert_mask[e])
            if tokens.numel() == 0:
                continue
            w = lambda n: p[prefix + f"experts.{e}.{n}.weight"]  # noqa: E731
            h = x[tokens]
            # MixtralBlockSparseTop2MLP: w2(silu(w1(h)) * w3(h)).
            y = (torch.nn.functional.silu(h @ w("w1").T) * (h @ w("w3").T)) @ w("w2").T
            out = out.index_add(0, tokens, y * routing[tokens, choice, None])
        return out

    def log_probs(self, inputs):
        """log_softmax of the logits, [T, vocab]; positions restart at 0.
        Records every layer's router logits (mixtral) in self.router_logits."""
        p = self.params
        self.router_logits = []
        x = p["model.embed_tokens.weight"][torch.tensor(inputs)]
        cos, sin = self.rotary(len(inputs))
        for i in range(self.config["num_hidden_layers"]):
            prefix = f"model.layers.{i}."
            h = self.rms_norm(x, p[prefix + "input_layernorm.weight"])
            x = x + self.attention(h, prefix + "self_attn.", cos, sin, self.windows[i])
            h = self.rms_norm(x, p[prefix + "post_attention_layernorm.weight"])
            x = x + self.mlp(h, prefix)
        x = self.rms_norm(x, p["model.norm.weight"])
        return torch.log_softmax(x @ self.lm_head().T, dim=-1)

    def greedy_decode(self, prompt, max_tokens):
        """GenerationMixin's greedy search (do_sample=False) without a cache:
        every step runs the whole sequence again and appends the argmax of
        the last position's logits (torch.argmax: the lowest id among equal
        maxima). Returns the new tokens and each one's log-probability."""
        tokens, logprobs = list(prompt), []
        with torch.no_grad():
            for _ in range(max_tokens):
                last = self.log_probs(tokens)[-1]
                token = int(torch.argmax(last))
                tokens.append(token)
                logprobs.append(float(last[token]))
        return tokens[len(prompt):], logprobs

    def aux_enabled(self):
        # MixtralForCausalLM.forward adds the aux loss only when
        # output_router_logits (config default False).
        return self.experts > 0 and bool(self.config.get("output_router_logits", False))

    def aux_coef(self):
        # MixtralConfig default router_aux_loss_coef = 0.001.
        return self.config.get("router_aux_loss_coef", 0.001)

    def load_balancing_loss(self):
        """load_balancing_loss_func(router_logits of every layer of the last
        log_probs, num_experts, top_k, attention_mask=None): the router
        logits of all layers pooled ([layers * T, E]), softmax, top-k one-hot
        expert_mask [N, k, E]; tokens_per_expert = mean over N of the mask
        ([k, E]), router_prob_per_expert = mean over N of the probabilities
        ([E]); sum(tokens_per_expert * router_prob_per_expert) * E, i.e.
        summed over experts and top-k slots. HF takes the mask mean in
        float32 (expert_mask.float()); here it is in the model dtype. Only
        router_prob_per_expert carries a gradient."""
        top_k = self.config.get("num_experts_per_tok", 2)
        concatenated = torch.cat(self.router_logits, dim=0)  # [layers * T, E]
        routing_weights = torch.softmax(concatenated, dim=-1)
        _, selected = torch.topk(routing_weights, top_k, dim=-1)
        expert_mask = torch.nn.functional.one_hot(selected, self.experts)  # [N, k, E]
        # the fraction of tokens routed to each expert, per top-k slot: [k, E]
        tokens_per_expert = torch.mean(expert_mask.to(routing_weights.dtype), dim=0)
        # the mean router probability of each expert: [E]
        router_prob_per_expert = torch.mean(routing_weights, dim=0)
        overall = torch.sum(tokens_per_expert * router_prob_per_expert.unsqueeze(0))
        return overall * self.experts


# The names test_llama_reference.py has always used.
ReferenceLlama = ReferenceCausalLM
ReferenceMixtral = ReferenceCausalLM


class SampleTerms:
    """One sample's reference quantities: per-position target logprobs (0
    where ignored), loss_sum = sum over valid positions of
    w * (-logprob + router_aux_loss_coef * aux_sample) (the aux term only
    for a mixtral with output_router_logits; aux_sample is
    load_balancing_loss_func over this sample's own tokens), valid_tokens
    (target not -100 and weight > 0)."""

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
        self.aux = None
        if model.aux_enabled():
            self.aux = model.load_balancing_loss()
            token_loss = token_loss + model.aux_coef() * self.aux
        self.loss_sum = (w * token_loss).sum()
        self.valid_tokens = sum(valid)


def window_loss(terms, sample_mean):
    """The window's loss from SampleTerms: TOKEN_MEAN = sum of loss_sum /
    valid tokens; SAMPLE_MEAN = mean over samples with a valid token of
    loss_sum / valid_tokens."""
    counted = [t for t in terms if t.valid_tokens > 0]
    if sample_mean:
        return sum(t.loss_sum / t.valid_tokens for t in counted) / len(counted)
    return sum(t.loss_sum for t in counted) / sum(t.valid_tokens for t in counted)


# ---------------------------------------------------------------------------
# bf16 and safetensors, numpy only
# ---------------------------------------------------------------------------

def float32_to_bf16_bits(values):
    """Round-to-nearest-even of float32 to its top 16 bits (finite values)."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if not np.all(np.isfinite(values)):
        raise ValueError("bf16 encoding of a non-finite value")
    bits = values.view(np.uint32).astype(np.uint64)
    rounding = ((bits >> 16) & 1) + 0x7FFF
    return ((bits + rounding) >> 16).astype(np.uint16)


def bf16_bits_to_float64(bits):
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(
        np.float32).astype(np.float64)


def bf16_round(values):
    """The float64 value of each element stored as bf16."""
    return bf16_bits_to_float64(float32_to_bf16_bits(values))


# storage: (safetensors dtype, numpy dtype). The safetensors format stores
# every dtype little-endian; F16, F32 and F64 are IEEE 754 binary16, binary32
# and binary64, which numpy's "<f2", "<f4" and "<f8" are.
_STORAGE = {"bf16": ("BF16", None), "f16": ("F16", "<f2"), "f32": ("F32", "<f4"),
            "f64": ("F64", "<f8")}
_NUMPY_OF = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4"}


def encode_tensor(values, storage):
    """(safetensors dtype, raw bytes, float64 of the stored values). numpy's
    casts to "<f2" and "<f4" round to nearest even, as torch's do; a value
    that overflows the storage dtype is an error, not an inf."""
    dtype, numpy_dtype = _STORAGE[storage]
    if storage == "bf16":
        bits = float32_to_bf16_bits(values)
        return dtype, bits.astype("<u2").tobytes(), bf16_bits_to_float64(bits).reshape(
            np.shape(values))
    values = np.asarray(values)
    with np.errstate(over="ignore"):
        stored = values.astype(numpy_dtype)
    if not np.all(np.isfinite(stored)) and np.all(np.isfinite(values)):
        raise ValueError(f"{storage} encoding overflows: max |value| "
                         f"{float(np.max(np.abs(values)))}")
    return dtype, stored.tobytes(), stored.astype(np.float64)


def write_safetensors(path, entries, metadata=None):
    """entries: [(name, dtype, shape, raw bytes)] in file order. The header is
    padded with spaces to a multiple of 8 bytes, as the safetensors library
    does. Returns the number of tensor data bytes."""
    header = {}
    if metadata is not None:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape, raw in entries:
        header[name] = {"dtype": dtype, "shape": list(shape),
                        "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for _, _, _, raw in entries:
            f.write(raw)
    return offset


def read_safetensors_any(path):
    """{name: float64 or integer numpy array}; understands BF16 too."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    header.pop("__metadata__", None)
    buffer = data[8 + size:]
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = buffer[begin:end]
        if info["dtype"] == "BF16":
            values = bf16_bits_to_float64(np.frombuffer(raw, dtype="<u2"))
        else:
            values = np.frombuffer(raw, dtype=_NUMPY_OF[info["dtype"]]).copy()
        out[name] = values.reshape(info["shape"])
    return out


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}


def read_safetensors_raw(path):
    """(metadata, {name: (dtype, shape, raw bytes)}) of a safetensors file,
    the tensor bytes exactly as stored. Checks the layout the format
    requires: each tensor's byte count matches its shape and dtype, and the
    tensors tile the data buffer without gaps or overlaps."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + size])
    metadata = header.pop("__metadata__", None)
    buffer = data[8 + size:]
    tensors = {}
    spans = []
    for name, info in header.items():
        begin, end = info["data_offsets"]
        count = int(np.prod(info["shape"], dtype=np.int64))
        if end - begin != count * _ITEMSIZE[info["dtype"]]:
            raise ValueError(f"{path}: tensor {name} has {end - begin} bytes for "
                             f"shape {info['shape']} of {info['dtype']}")
        tensors[name] = (info["dtype"], tuple(info["shape"]), buffer[begin:end])
        spans.append((begin, end))
    position = 0
    for begin, end in sorted(spans):
        if begin != position:
            raise ValueError(f"{path}: tensor data has a gap or overlap at byte {begin}")
        position = end
    if position != len(buffer):
        raise ValueError(f"{path}: {len(buffer)} data bytes, tensors cover {position}")
    return metadata, tensors


def hf_weight_files(directory):
    """The safetensors files of an HF directory: the index's shards (sorted)
    when model.safetensors.index.json exists, else ["model.safetensors"]."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return ["model.safetensors"]
    with open(index, encoding="utf-8") as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def read_hf_directory(directory):
    """Every tensor of an HF directory, single-file or sharded with
    model.safetensors.index.json."""
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors_any(os.path.join(directory, "model.safetensors"))
    with open(index, encoding="utf-8") as f:
        weight_map = json.load(f)["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        tensors.update(read_safetensors_any(os.path.join(directory, shard)))
    if set(tensors) != set(weight_map):
        raise ValueError(f"{directory}: index and shards disagree")
    return tensors


# ---------------------------------------------------------------------------
# Tiny HF model directories
# ---------------------------------------------------------------------------

def hf_config(family, **fields):
    """config.json of a tiny model as transformers' to_dict writes it for the
    family (its fields with their HF defaults), updated with `fields`."""
    common = {
        "architectures": [ARCHITECTURES[family]],
        "attention_dropout": 0.0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": 32,
        "initializer_range": 0.02,
        "intermediate_size": 48,
        "max_position_embeddings": 256,
        "model_type": family,
        "num_attention_heads": 4,
        "num_hidden_layers": 2,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.3",
        "use_cache": True,
        "vocab_size": 96,
    }
    specific = {
        # LlamaConfig
        "llama": {"attention_bias": False, "head_dim": None, "mlp_bias": False,
                  "pretraining_tp": 1, "rope_scaling": None},
        # MistralConfig
        "mistral": {"head_dim": None, "sliding_window": 4096},
        # MixtralConfig
        "mixtral": {"num_experts_per_tok": 2, "num_local_experts": 4,
                    "output_router_logits": False, "router_aux_loss_coef": 0.001,
                    "router_jitter_noise": 0.0, "sliding_window": None,
                    "rms_norm_eps": 1e-5, "rope_theta": 1e6},
        # Qwen2Config
        "qwen2": {"max_window_layers": 28, "rope_scaling": None, "sliding_window": 4096,
                  "use_sliding_window": False},
        # Qwen3Config
        "qwen3": {"attention_bias": False, "head_dim": 128, "max_window_layers": 28,
                  "rope_scaling": None, "sliding_window": 4096,
                  "use_sliding_window": False},
    }[family]
    config = dict(common, **specific)
    config.update(fields)
    if family in ("llama", "mistral") and config["head_dim"] is None:
        # LlamaConfig/MistralConfig.__init__: head_dim or hidden // heads.
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if family in ("qwen2", "qwen3") and not config["use_sliding_window"]:
        # Qwen2Config/Qwen3Config: sliding_window if use_sliding_window else None.
        config["sliding_window"] = None
    return config


def with_layer_types(config):
    """config plus the layer_types list transformers >= 4.53 writes for
    qwen2/qwen3 (derived exactly as Qwen2Config.__post_init__ does)."""
    windows = layer_windows(config)
    return dict(config, layer_types=["full_attention" if w is None else "sliding_attention"
                                     for w in windows])


def random_weights(config, seed):
    """float32 weights under HF names: N(0, 0.3^2) embeddings (logits of a
    tied model stay O(1)), N(0, 1/fan_in) projections (so attention and
    routing are far from uniform), norms 1 + N(0, 0.1^2), biases
    N(0, 0.1^2)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in sorted(parameter_shapes(config).items()):
        if name.endswith("norm.weight"):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(".bias"):
            value = 0.1 * rng.standard_normal(shape)
        elif name == "model.embed_tokens.weight":
            value = 0.3 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[1])
        weights[name] = value.astype(np.float32)
    return weights


def write_hf_model(directory, config, weights, storage="bf16", shards=1):
    """Writes config.json and the weights (stored as `storage`) into
    `directory`: model.safetensors, or with shards > 1
    model-0000i-of-0000n.safetensors + model.safetensors.index.json
    ({"metadata": {"total_size": ...}, "weight_map": {...}}). Returns
    {name: float64 array} of the values as stored."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
    names = sorted(weights)
    encoded = {}
    stored = {}
    for name in names:
        dtype, raw, value = encode_tensor(weights[name], storage)
        encoded[name] = (name, dtype, np.shape(weights[name]), raw)
        stored[name] = value
    metadata = {"format": "pt"}
    if shards <= 1:
        write_safetensors(os.path.join(directory, "model.safetensors"),
                          [encoded[n] for n in names], metadata)
        return stored
    # Contiguous groups of names, every shard non-empty.
    groups = [list(g) for g in np.array_split(np.array(names, dtype=object), shards)]
    weight_map = {}
    total = 0
    for i, group in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        total += write_safetensors(os.path.join(directory, file_name),
                                   [encoded[n] for n in group], metadata)
        weight_map.update({n: file_name for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, "model.safetensors.index.json"), "w",
              encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")
    return stored


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

_COMPUTE_DTYPES = {"float64": torch.float64, "float32": torch.float32}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Greedy decoding of an HF model directory with the "
                    "reference model (in float64 unless --dtype says "
                    'otherwise); one JSON line per prompt: '
                    '{"tokens": [...], "logprobs": [...]}')
    parser.add_argument("command", choices=["greedy"])
    parser.add_argument("--model", required=True, help="an HF model directory")
    parser.add_argument("--prompt", action="append", required=True,
                        help="comma-separated token ids; repeat for more prompts")
    parser.add_argument("--max-tokens", type=int, required=True)
    parser.add_argument("--dtype", choices=sorted(_COMPUTE_DTYPES),
                        default="float64",
                        help="the dtype the reference computes in (the "
                             "weights are read as stored, then cast)")
    args = parser.parse_args(argv)
    with open(os.path.join(args.model, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    model = ReferenceCausalLM(config, read_hf_directory(args.model),
                              _COMPUTE_DTYPES[args.dtype])
    for prompt in args.prompt:
        tokens, logprobs = model.greedy_decode([int(t) for t in prompt.split(",")],
                                               args.max_tokens)
        print(json.dumps({"tokens": tokens, "logprobs": logprobs}), flush=True)


if __name__ == "__main__":
    main()
