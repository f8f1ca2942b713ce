#!/usr/bin/env python3
"""A training loop on a tally server with the Python client (tally_client).

Fine-tunes a model on byte-level text: every step sends CALLS
ForwardBackward calls without waiting (they are pipelined), then an
OptimStep, and prints the loss, tokens, grad norm and clip coefficient.
Transient failures are retried by the client with the same seq_id, so a
retry is never applied twice.

    build/server/tally-server --demo-model &
    PYTHONPATH=build/python_stubs:client/python \\
        /usr/bin/python3 examples/python_train_loop.py --steps 20

Options: --target, --model-id (default "demo", created by --demo-model), --create
(create the model with the embedded default config first), --token, --tls-ca,
--text, --steps, --calls, --samples, --bytes, --lr, --max-grad-norm.
"""

import argparse
import os
import random
import time

from tally_client import Tls, TrainingClient, sample

BOS = 256  # the demo model's byte-level vocabulary: 256 bytes + specials
HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TEXT = os.path.join(HERE, "..", "data", "pride_and_prejudice.txt")


def byte_samples(text, rng, count, length):
    """`count` next-byte samples of `length` bytes from random offsets."""
    samples = []
    for _ in range(count):
        start = rng.randrange(0, len(text) - length)
        chunk = list(text[start:start + length])
        samples.append(sample([BOS] + chunk[:-1], chunk))
    return samples


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--target", default="localhost:50051")
    parser.add_argument("--model-id", default="demo")
    parser.add_argument("--create", action="store_true",
                        help="create the model (embedded default config)")
    parser.add_argument("--token", default=os.environ.get("TALLY_TOKEN"))
    parser.add_argument("--tls-ca", help="CA certificate (PEM) to use TLS")
    parser.add_argument("--text", default=DEFAULT_TEXT)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--calls", type=int, default=4,
                        help="ForwardBackward calls per step")
    parser.add_argument("--samples", type=int, default=4,
                        help="samples per call")
    parser.add_argument("--bytes", type=int, default=64, help="bytes per sample")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    args = parser.parse_args()

    with open(args.text, "rb") as f:
        text = f.read()
    rng = random.Random(0)
    tls = Tls(ca_cert=args.tls_ca) if args.tls_ca else None
    with TrainingClient(args.target, args.model_id, token=args.token,
                        tls=tls) as client:
        if args.create:
            client.create_model(default_max_grad_norm=args.max_grad_norm)
        for _ in range(args.steps):
            start = time.monotonic()
            calls = [client.forward_backward(
                byte_samples(text, rng, args.samples, args.bytes))
                for _ in range(args.calls)]
            step = client.optim_step(adam={"learning_rate": args.lr},
                                     max_grad_norm=args.max_grad_norm).result()
            results = [c.result() for c in calls]
            tokens = sum(r.valid_tokens for r in results)
            loss = sum(r.loss_sum for r in results) / tokens
            print(f"step {step.step:4d}  loss {loss:.4f}  tokens {tokens}  "
                  f"grad_norm {step.grad_norm:.4f}  clip {step.clip_coef:.3f}  "
                  f"{time.monotonic() - start:.2f}s", flush=True)


if __name__ == "__main__":
    main()
