"""The ForwardBackward workload of bench_train in PyTorch eager, the peer a
user would otherwise write: the same Llama-family model (HF's definition:
RMSNorm, rotate-half RoPE, grouped-query attention with a causal mask,
SwiGLU MLP, untied or tied LM head) with random weights, forward and
backward of the summed token cross-entropy on the same batch shape.

bench_train runs it once per row with the row's thread environment; run it
by hand with Debian's interpreter (python3-torch):

    BLIS_NUM_THREADS=1 /usr/bin/python3 bench/pytorch_train_reference.py \
        --config=small --threads=1 --steps=3 --samples=2 --tokens=512

The last line printed is one JSON object: {"tokens_per_s", "peak_rss_bytes"}.
"""

import argparse
import json
import resource
import statistics
import time

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

# The shapes of bench_train's --config values (bench_train.cc BenchConfig).
CONFIGS = {
    "small": dict(vocab=32000, hidden=512, intermediate=1408, layers=8,
                  heads=8, kv_heads=4, tied=False, qkv_bias=False,
                  rope_theta=10000.0, eps=1e-6),
    "qwen2.5-0.5b": dict(vocab=151936, hidden=896, intermediate=4864, layers=24,
                         heads=14, kv_heads=2, tied=True, qkv_bias=True,
                         rope_theta=1000000.0, eps=1e-6),
}


class RmsNorm(torch.nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Layer(torch.nn.Module):
    def __init__(self, c):
        super().__init__()
        h, d = c["hidden"], c["hidden"] // c["heads"]
        self.heads, self.kv_heads, self.d = c["heads"], c["kv_heads"], d
        self.input_norm = RmsNorm(h, c["eps"])
        self.post_norm = RmsNorm(h, c["eps"])
        self.q = torch.nn.Linear(h, c["heads"] * d, bias=c["qkv_bias"])
        self.k = torch.nn.Linear(h, c["kv_heads"] * d, bias=c["qkv_bias"])
        self.v = torch.nn.Linear(h, c["kv_heads"] * d, bias=c["qkv_bias"])
        self.o = torch.nn.Linear(c["heads"] * d, h, bias=False)
        self.gate = torch.nn.Linear(h, c["intermediate"], bias=False)
        self.up = torch.nn.Linear(h, c["intermediate"], bias=False)
        self.down = torch.nn.Linear(c["intermediate"], h, bias=False)

    def attention(self, x, cos, sin, mask):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.heads, self.d).transpose(1, 2)
        k = self.k(x).view(b, t, self.kv_heads, self.d).transpose(1, 2)
        v = self.v(x).view(b, t, self.kv_heads, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        scores = (q @ k.transpose(-2, -1)) / self.d ** 0.5
        scores = scores.masked_fill(mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        return self.o(out.transpose(1, 2).reshape(b, t, self.heads * self.d))

    def forward(self, x, cos, sin, mask):
        x = x + self.attention(self.input_norm(x), cos, sin, mask)
        h = self.post_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class CausalLm(torch.nn.Module):
    def __init__(self, c, act_ckpt):
        super().__init__()
        self.c = c
        self.act_ckpt = act_ckpt
        self.embed = torch.nn.Embedding(c["vocab"], c["hidden"])
        self.layers = torch.nn.ModuleList(Layer(c) for _ in range(c["layers"]))
        self.norm = RmsNorm(c["hidden"], c["eps"])
        self.lm_head = torch.nn.Linear(c["hidden"], c["vocab"], bias=False)
        if c["tied"]:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens, targets):
        t = tokens.shape[1]
        d = self.c["hidden"] // self.c["heads"]
        inv_freq = 1.0 / self.c["rope_theta"] ** (torch.arange(0, d, 2).double() / d)
        angles = torch.outer(torch.arange(t).double(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().float(), angles.sin().float()
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = self.embed(tokens)
        for layer in self.layers:
            if self.act_ckpt:
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, mask)
            else:
                x = layer(x, cos, sin, mask)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1),
                               reduction="sum")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", choices=sorted(CONFIGS), default="small")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float64"),
                        default="float32",
                        help="bfloat16: float32 parameters under CPU autocast")
    parser.add_argument("--act-ckpt", choices=("off", "on"), default="off",
                        help="torch.utils.checkpoint around every layer")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = CONFIGS[args.config]
    master = torch.float32 if args.dtype == "bfloat16" else getattr(torch, args.dtype)
    model = CausalLm(config, args.act_ckpt == "on").to(master)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16,
                              enabled=args.dtype == "bfloat16")
    data = torch.randint(0, config["vocab"], (args.samples, args.tokens + 1))
    tokens, targets = data[:, :-1], data[:, 1:]
    seconds = []
    for step in range(args.steps + 1):  # the first is the warm-up
        start = time.perf_counter()
        with autocast:
            loss = model(tokens, targets)
        loss.backward()
        if step > 0:
            seconds.append(time.perf_counter() - start)
    print(json.dumps({
        "tokens_per_s": args.samples * args.tokens / statistics.median(seconds),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }))


if __name__ == "__main__":
    main()
