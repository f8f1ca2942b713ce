"""The sampling workload of bench_sample in PyTorch eager, the decode loop a
user would otherwise run: HF's generate() over a Llama model with a KV cache,
restated in plain PyTorch from transformers' published definitions
(models/llama/modeling_llama.py: LlamaRMSNorm, LlamaRotaryEmbedding,
rotate_half, apply_rotary_pos_emb, repeat_kv, eager_attention_forward,
LlamaMLP; cache_utils.py: DynamicCache.update, which concatenates each new
key and value onto the layer's past along the sequence; generation/utils.py:
_sample, which prefills the prompts, keeps only the last position's logits
(logits_to_keep=1), picks a token by argmax (greedy) or by
torch.multinomial over softmax(logits / temperature) (sampling), and feeds
it back one token per step).

The weights are those bench_sample wrote (an HF directory of float32
safetensors); a bfloat16 row casts the whole model to bfloat16, as
from_pretrained(torch_dtype=torch.bfloat16) does. Every step also takes the
chosen token's log-probability (log_softmax of the float32 logits), which
tally's Decode returns with each token.

bench_sample runs it once per row with the row's thread environment; by hand:

    BLIS_NUM_THREADS=1 /usr/bin/python3 bench/pytorch_sample_reference.py \
        --weights=DIR --prompts=prompts.json --dtype=float32 --threads=1 \
        --new-tokens=16 --rounds=2 --mode=greedy

--prompts names a JSON file {"prompts": [[token, ...], ...]} (every prompt
the same length). With --check=FILE (JSON {"tokens": [[...], ...]}, another
implementation's greedy completions of the same prompts) the script also
runs prompts + those tokens through one full causal forward, untimed, and
reports check_margin: the largest gap, over every completed position,
between the best logit and the logit of the given token (0 when each given
token is this model's argmax).

The last line printed is one JSON object: {"prefill_tokens_per_s",
"decode_tokens_per_s", "prefill_s", "full_s", "tokens", "peak_rss_bytes",
"dtype", "batch", "prompt", "new_tokens", "mode"} and "check_margin" with
--check.
"""

import argparse
import glob
import json
import os
import resource
import statistics
import struct
import time

import torch
import torch.nn.functional as F

SAFETENSORS_DTYPES = {"F32": torch.float32, "F64": torch.float64,
                      "BF16": torch.bfloat16, "F16": torch.float16}


def read_safetensors(path):
    """{name: tensor} of one .safetensors file: an 8-byte little-endian header
    size, a JSON header {name: {dtype, shape, data_offsets}}, then the data."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        flat = torch.frombuffer(bytearray(data[begin:end]),
                                dtype=SAFETENSORS_DTYPES[info["dtype"]])
        tensors[name] = flat.reshape(info["shape"])
    return tensors


class Llama:
    """HF's LlamaForCausalLM forward with a DynamicCache, in eval mode."""

    def __init__(self, directory, dtype):
        with open(os.path.join(directory, "config.json")) as f:
            self.config = json.load(f)
        tensors = {}
        for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
            tensors.update(read_safetensors(path))
        self.w = {name: t.to(dtype) for name, t in tensors.items()}
        if "lm_head.weight" not in self.w:  # tied embeddings
            self.w["lm_head.weight"] = self.w["model.embed_tokens.weight"]
        c = self.config
        self.heads = c["num_attention_heads"]
        self.kv_heads = c.get("num_key_value_heads", self.heads)
        self.d = c.get("head_dim") or c["hidden_size"] // self.heads
        self.layers = c["num_hidden_layers"]
        self.eps = c.get("rms_norm_eps", 1e-6)
        theta = c.get("rope_theta", 10000.0)
        # LlamaRotaryEmbedding's default inv_freq, in float32.
        self.inv_freq = 1.0 / (theta ** (
            torch.arange(0, self.d, 2, dtype=torch.int64).float() / self.d))

    def rms_norm(self, x, name):
        wide = x.to(torch.float32)
        variance = wide.pow(2).mean(-1, keepdim=True)
        return self.w[name] * (wide * torch.rsqrt(variance + self.eps)).to(x.dtype)

    def linear(self, x, name):
        bias = self.w.get(name + ".bias")
        return F.linear(x, self.w[name + ".weight"], bias)

    def rotary(self, positions, dtype):
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @staticmethod
    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def repeat_kv(self, x):
        groups = self.heads // self.kv_heads
        if groups == 1:
            return x
        b, h, t, d = x.shape
        return x[:, :, None, :, :].expand(b, h, groups, t, d).reshape(b, h * groups, t, d)

    def attention(self, x, layer, cos, sin, past):
        b, t, _ = x.shape
        p = f"model.layers.{layer}.self_attn."
        q = self.linear(x, p + "q_proj").view(b, t, self.heads, self.d).transpose(1, 2)
        k = self.linear(x, p + "k_proj").view(b, t, self.kv_heads, self.d).transpose(1, 2)
        v = self.linear(x, p + "v_proj").view(b, t, self.kv_heads, self.d).transpose(1, 2)
        q = q * cos + self.rotate_half(q) * sin
        k = k * cos + self.rotate_half(k) * sin
        if past[layer] is not None:  # DynamicCache.update
            k = torch.cat((past[layer][0], k), dim=-2)
            v = torch.cat((past[layer][1], v), dim=-2)
        past[layer] = (k, v)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        scores = (q @ k.transpose(2, 3)) * self.d ** -0.5
        if t > 1:  # the causal mask of the new queries over every key
            keys = k.shape[-2]
            mask = torch.ones(t, keys, dtype=torch.bool).triu(keys - t + 1)
            scores = scores.masked_fill(mask, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out = (probs @ v).transpose(1, 2).reshape(b, t, self.heads * self.d)
        return self.linear(out, p + "o_proj")

    def forward(self, tokens, past, start, last_only=True):
        """Logits (float32) of the new tokens [B, T] at positions start.., only
        the last position's unless last_only is False; `past` (one entry per
        layer) is extended in place."""
        x = F.embedding(tokens, self.w["model.embed_tokens.weight"])
        cos, sin = self.rotary(torch.arange(start, start + tokens.shape[1]), x.dtype)
        for layer in range(self.layers):
            p = f"model.layers.{layer}."
            x = x + self.attention(self.rms_norm(x, p + "input_layernorm.weight"),
                                   layer, cos, sin, past)
            h = self.rms_norm(x, p + "post_attention_layernorm.weight")
            x = x + self.linear(F.silu(self.linear(h, p + "mlp.gate_proj")) *
                                self.linear(h, p + "mlp.up_proj"), p + "mlp.down_proj")
        if last_only:
            x = x[:, -1:, :]
        return F.linear(self.rms_norm(x, "model.norm.weight"),
                        self.w["lm_head.weight"]).float()


def generate(model, prompts, max_tokens, mode, generator):
    """generate(max_new_tokens=max_tokens): the tokens [B, max_tokens] and
    their log-probabilities."""
    past = [None] * model.layers
    logits = model.forward(prompts, past, 0)[:, -1, :]
    position = prompts.shape[1]
    tokens, logprobs = [], []
    while True:
        if mode == "greedy":
            token = logits.argmax(-1)
        else:  # temperature 1, no top-k / top-p
            probs = torch.softmax(logits, dim=-1)
            token = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        logprobs.append(torch.log_softmax(logits, -1).gather(-1, token[:, None]))
        tokens.append(token)
        if len(tokens) == max_tokens:
            return torch.stack(tokens, 1), torch.cat(logprobs, 1)
        logits = model.forward(token[:, None], past, position)[:, -1, :]
        position += 1


def check_margin(model, prompts, completions):
    """The largest best-logit-minus-given-token-logit over every completed
    position of one full forward (no cache) of prompts + completions."""
    sequences = torch.cat((prompts, completions), 1)
    logits = model.forward(sequences[:, :-1], [None] * model.layers, 0,
                           last_only=False)
    logits = logits[:, prompts.shape[1] - 1:, :]
    given = logits.gather(-1, completions[:, :, None]).squeeze(-1)
    return (logits.max(-1).values - given).max().item()


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--weights", required=True, help="HF model directory")
    parser.add_argument("--prompts", required=True, help="JSON file of prompts")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--mode", choices=("greedy", "sample"), default="greedy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check", help="JSON file of completions to check")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    with open(args.prompts) as f:
        prompts = torch.tensor(json.load(f)["prompts"], dtype=torch.int64)
    model = Llama(args.weights, getattr(torch, args.dtype))
    generator = torch.Generator().manual_seed(args.seed)

    def timed(max_tokens):
        start = time.perf_counter()
        with torch.no_grad():
            out = generate(model, prompts, max_tokens, args.mode, generator)
        return time.perf_counter() - start, out

    timed(1)  # warm-up
    timed(1 + args.new_tokens)
    prefill, full = [], []
    for _ in range(args.rounds):
        prefill.append(timed(1)[0])
        seconds, (tokens, _) = timed(1 + args.new_tokens)
        full.append(seconds)
    batch, length = prompts.shape
    prefill_s, full_s = statistics.median(prefill), statistics.median(full)
    result = {
        "prefill_tokens_per_s": batch * length / prefill_s,
        "decode_tokens_per_s": batch * args.new_tokens / (full_s - prefill_s),
        "prefill_s": prefill_s,
        "full_s": full_s,
        "tokens": tokens.tolist(),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "dtype": args.dtype,
        "batch": batch,
        "prompt": length,
        "new_tokens": args.new_tokens,
        "mode": args.mode,
    }
    if args.check:
        with open(args.check) as f:
            given = torch.tensor(json.load(f)["tokens"], dtype=torch.int64)
        with torch.no_grad():
            result["check_margin"] = check_margin(model, prompts, given)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
