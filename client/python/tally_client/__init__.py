"""tally_client: the Python client of the tally training server.

    from tally_client import TrainingClient, sample
    client = TrainingClient("localhost:50051", "demo")
    fb = client.forward_backward([sample([1, 2, 3], [2, 3, 4])])
    step = client.optim_step(max_grad_norm=1.0)
    print(fb.result().loss_mean, step.result().grad_norm)

Tinker's Python SDK on tally: tally_client.tinker.
"""

from tally_client.client import (PendingWindowError, RetryPolicy, TallyError,
                                 Tls, TrainingClient, WindowAbortedError,
                                 lora_config, make_channel, wait_for_serving)
from tally_client.errors import TRANSIENT_CODES, error_details, is_retryable
from tally_client.samples import sample, samples_from_batch, to_samples

__all__ = ["PendingWindowError", "RetryPolicy", "TRANSIENT_CODES", "TallyError",
           "Tls", "TrainingClient", "WindowAbortedError", "error_details",
           "is_retryable", "lora_config", "make_channel", "sample",
           "samples_from_batch", "to_samples", "wait_for_serving"]
