"""The ForwardBackward workload of bench_train in PyTorch eager, the peer a
user would otherwise write: the same Llama-family model (HF's definition:
RMSNorm, rotate-half RoPE, grouped-query attention with a causal mask,
SwiGLU MLP, untied or tied LM head) with random weights, forward and
backward of the summed token cross-entropy on the same batch shape, in
micro-batches of at most --max-batch-tokens tokens as tally plans them.

bench_train runs it once per row with the row's thread environment; run it
by hand with Debian's interpreter (python3-torch):

    BLIS_NUM_THREADS=1 /usr/bin/python3 bench/pytorch_train_reference.py \
        --config=small --threads=1 --steps=3 --samples=2 --tokens=512

With --device=cuda (a torch with CUDA, e.g. /opt/torch/.venv/bin/python3)
everything lives on GPU 0, attention is torch's scaled_dot_product_attention
(what HF Llama runs by default; the materialized T x T scores of the CPU
path do not fit a GPU at 16 x 2048 tokens) and every timing waits for the
GPU (torch.cuda.synchronize).

The last line printed is one JSON object: {"tokens_per_s", "peak_rss_bytes",
"device", "dtype", "config", "samples", "tokens"} and on cuda "gpu" (its
name) and "device_peak_bytes" (torch.cuda.max_memory_allocated); bench_train
checks the shape fields against its own row.
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
        if mask is None:  # fused attention (cuda)
            # Rotated in float32 (cos, sin), q and k come back to v's dtype,
            # as HF Llama casts them: the fused kernels take one dtype.
            out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v,
                                                 is_causal=True)
        else:
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
        t, device = tokens.shape[1], tokens.device
        d = self.c["hidden"] // self.c["heads"]
        inv_freq = 1.0 / self.c["rope_theta"] ** (
            torch.arange(0, d, 2, device=device).double() / d)
        angles = torch.outer(torch.arange(t, device=device).double(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        cos, sin = angles.cos().float(), angles.sin().float()
        mask = (None if device.type == "cuda" else
                torch.ones(t, t, dtype=torch.bool, device=device).triu(1))
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
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--max-batch-tokens", type=int, default=0,
                        help="tokens per micro-batch (0: the whole call)")
    parser.add_argument("--allow-tf32", choices=("false", "true"), default="false",
                        help="cuda: TF32 matmuls for float32")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32 == "true"
    config = CONFIGS[args.config]
    master = torch.float32 if args.dtype == "bfloat16" else getattr(torch, args.dtype)
    model = CausalLm(config, args.act_ckpt == "on").to(device=device, dtype=master)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=args.dtype == "bfloat16")
    data = torch.randint(0, config["vocab"], (args.samples, args.tokens + 1))
    data = data.to(device)
    # Whole samples per micro-batch, as tally's PlanBatches packs them.
    per_batch = max(1, (args.max_batch_tokens or args.samples * args.tokens)
                    // args.tokens)
    batches = [(b[:, :-1], b[:, 1:]) for b in data.split(per_batch)]

    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    seconds = []
    for step in range(args.steps + 1):  # the first is the warm-up
        synchronize()
        start = time.perf_counter()
        for tokens, targets in batches:
            with autocast:
                loss = model(tokens, targets)
            loss.backward()
        synchronize()
        if step > 0:
            seconds.append(time.perf_counter() - start)
    result = {
        "tokens_per_s": args.samples * args.tokens / statistics.median(seconds),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "device": device.type,
        "dtype": args.dtype,
        "config": args.config,
        "samples": args.samples,
        "tokens": args.tokens,
    }
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
        result["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
