"""The OptimStep workload of bench_optim_step in PyTorch, the peer a user
would otherwise pick: grad.mul_(1 / N), clip_grad_norm_, AdamW(foreach=True).

bench_optim_step runs it with the shapes of its model and puts the median in
its table; run it by hand with Debian's interpreter (python3-torch):

    /usr/bin/python3 bench/pytorch_reference.py --threads 2 --repeats 5 \
        --normalizer 256 --max-grad-norm 1 --shapes 8192x512,512,1376x512

The last line printed is one JSON object: {"params", "threads", "seconds"}.
"""

import argparse
import json
import statistics
import time

import torch


def parse_shapes(text):
    return [tuple(int(d) for d in shape.split("x")) for shape in text.split(",")]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", required=True,
                        help="comma-separated parameter shapes, dims joined by x")
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--normalizer", type=float, default=256.0)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    params = [torch.randn(shape).requires_grad_() for shape in parse_shapes(args.shapes)]
    raw_grads = [torch.randn_like(p) for p in params]
    for p, g in zip(params, raw_grads):
        p.grad = g.clone()
    # tally's AdamParams defaults.
    optimizer = torch.optim.AdamW(params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=0.01, foreach=True)
    scale = 1.0 / args.normalizer
    seconds = []
    for repeat in range(args.repeats + 1):  # the first is the warm-up
        with torch.no_grad():
            for p, g in zip(params, raw_grads):
                p.grad.copy_(g)  # mul_ rewrote them; untimed
        start = time.perf_counter()
        with torch.no_grad():
            torch._foreach_mul_([p.grad for p in params], scale)
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm)
        optimizer.step()
        if repeat > 0:
            seconds.append(time.perf_counter() - start)
    print(json.dumps({"params": sum(p.numel() for p in params),
                      "threads": torch.get_num_threads(),
                      "seconds": statistics.median(seconds)}))


if __name__ == "__main__":
    main()
