"""A multi-rank tally-server gives the single-rank server's results.

Each test starts a 1-rank server and a 4-rank one (`--nproc-per-node 4` with
dp_shard 2 x tp 2 (also under --zero-stage 1), dp_replicate 2 x dp_shard 2,
cp 2 x tp 2 or ep 2 x tp 2),
creates the same tiny Llama (or Mixtral) on both and sends both the same requests: ForwardBackward calls of very
uneven size (a call whose only valid token is one, samples whose targets are
all ignored, weighted positions, a sample of one token) and OptimSteps with
clipping. Every loss, token count, gradient norm and clip coefficient, and
every tensor of the saved checkpoints, must agree (FLOAT32 to 1e-5, FLOAT64 to
1e-10, relative); a checkpoint saved on one mesh and loaded on the other must
continue the same trajectory. tearDown checks that both servers exit 0 on
SIGTERM.
"""

import os
import unittest

import numpy as np

from tally_testing import (TINY_LLAMA, ServerTestCase, pb, read_json,
                           read_safetensors)

IGNORE = -100
MODEL_ID = "tiny"
SEED = 7
MAX_GRAD_NORM = 1.0
# AdamW's update lr * g / (|g| + eps) is ill-conditioned where |g| is near
# eps: with the default eps 1e-8, float32 rounding of one gradient element
# (2e-11 apart, as the meshes sum in different orders) moved a weight by
# 5.7e-6, 7.5e-5 of its tensor's largest magnitude, in one step. With eps
# 1e-6 that amplification is at most lr * 2e-11 / eps = 2e-8.
ADAM_EPS = 1e-6
FLOAT32_RTOL = 1e-5
FLOAT64_RTOL = 1e-10

DP_SHARD_TP = ["--nproc-per-node", "4", "--dp-shard", "2", "--tp", "2"]
DP_REPLICATE_SHARD = ["--nproc-per-node", "4", "--dp-replicate", "2",
                      "--dp-shard", "2"]
CP_TP = ["--nproc-per-node", "4", "--cp", "2", "--tp", "2"]
EP_TP = ["--nproc-per-node", "4", "--dp-shard", "2", "--ep", "2", "--tp", "2"]
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2,
           "router_aux_loss_coef": 0.01}

TOKEN_MEAN = pb.LOSS_REDUCTION_TOKEN_MEAN
SAMPLE_MEAN = pb.LOSS_REDUCTION_SAMPLE_MEAN


def make_sample(rng, length, ignored_prefix=0, weighted=False):
    """Next-token sample of `length` random tokens. The first
    `ignored_prefix` targets are -100; weighted samples get weights that are
    exact in float32, some of them 0."""
    text = [int(t) for t in rng.integers(0, TINY_LLAMA["vocab_size"], length + 1)]
    targets = [IGNORE if i < ignored_prefix else text[i + 1] for i in range(length)]
    weights = ([float(w) for w in rng.choice([0.0, 0.25, 0.5, 1.0, 1.75], length)]
               if weighted else [])
    return pb.Sample(input_tokens=text[:length], target_tokens=targets,
                     weights=weights)


def single_valid_token_sample(rng, length):
    """A sample whose only valid position is its last one."""
    sample = make_sample(rng, length)
    for i in range(length - 1):
        sample.target_tokens[i] = IGNORE
    return sample


def step_calls(step):
    """The three ForwardBackward calls of training step `step`, of very
    different sizes: six samples of 1 to 60 tokens (one with every target
    ignored); one sample with a single valid token; a 1-token sample beside a
    long weighted one."""
    rng = np.random.default_rng(1000 + step)
    many = [make_sample(rng, 60, ignored_prefix=5),
            make_sample(rng, 17, weighted=True),
            make_sample(rng, 6, ignored_prefix=6),  # nothing valid
            make_sample(rng, 2, weighted=True),
            make_sample(rng, 33, ignored_prefix=20, weighted=True),
            make_sample(rng, 1)]
    single_token = [single_valid_token_sample(rng, 9)]
    lopsided = [make_sample(rng, 1), make_sample(rng, 48, weighted=True)]
    return [many, single_token, lopsided]


def probe_samples():
    """Two fixed samples whose forward-only log-probabilities fingerprint
    the weights."""
    rng = np.random.default_rng(99)
    return [make_sample(rng, 40, ignored_prefix=3), make_sample(rng, 25)]


def valid_tokens(sample):
    """Positions with a real target and a positive weight (the proto's
    definition), counted here rather than asked of a server."""
    weights = list(sample.weights) or [1.0] * len(sample.target_tokens)
    return sum(1 for t, w in zip(sample.target_tokens, weights)
               if t != IGNORE and w > 0)


def expected_shapes(moe=None, stacked=False):
    """The unsharded HF shape of every weight of TINY_LLAMA (with `moe`, its
    Mixtral variant: per-expert weights, or the stacked [E, ...] tensors the
    optimizer state is kept under when `stacked`)."""
    c = TINY_LLAMA
    hidden, inter = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * hidden // c["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": [c["vocab_size"], hidden],
              "model.norm.weight": [hidden],
              "lm_head.weight": [c["vocab_size"], hidden]}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": [hidden],
                       p + "post_attention_layernorm.weight": [hidden],
                       p + "self_attn.q_proj.weight": [hidden, hidden],
                       p + "self_attn.k_proj.weight": [kv, hidden],
                       p + "self_attn.v_proj.weight": [kv, hidden],
                       p + "self_attn.o_proj.weight": [hidden, hidden]})
        if not moe:
            shapes.update({p + "mlp.gate_proj.weight": [inter, hidden],
                           p + "mlp.up_proj.weight": [inter, hidden],
                           p + "mlp.down_proj.weight": [hidden, inter]})
            continue
        experts = moe["num_local_experts"]
        p += "block_sparse_moe."
        shapes[p + "gate.weight"] = [experts, hidden]
        for w, shape in (("w1", [inter, hidden]), ("w2", [hidden, inter]),
                         ("w3", [inter, hidden])):
            if stacked:
                shapes[p + f"experts.{w}.weight"] = [experts] + shape
            else:
                shapes.update({p + f"experts.{e}.{w}.weight": shape
                               for e in range(experts)})
    return shapes


def child_pids(parent_pid):
    """Pids of the live processes whose parent is `parent_pid`."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                stat = f.read()
        except OSError:  # exited meanwhile
            continue
        # pid (comm) state ppid ...; comm may hold spaces and parentheses.
        state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
        if int(ppid) == parent_pid and state != "Z":
            children.append(int(entry))
    return sorted(children)


def relative_difference(a, b):
    return abs(a - b) / max(abs(a), abs(b), 1e-300)


class MultiRankServerTest(ServerTestCase):

    def start_pair(self, mesh_args):
        """(1-rank server, 4-rank server with `mesh_args`) connections."""
        single = self.start_server(name="single")
        multi = self.start_server(name="multi", extra_args=mesh_args)
        self.assertEqual(child_pids(single.server.process.pid), [])
        self.assertEqual(len(child_pids(multi.server.process.pid)), 4,
                         "the launcher should run 4 rank processes")
        return single, multi

    def assert_close(self, a, b, rtol, what):
        self.assertLessEqual(relative_difference(a, b), rtol,
                             f"{what}: 1-rank {a!r} vs 4-rank {b!r}")

    def create(self, connections, dtype, model_id=MODEL_ID,
               grad_sync=pb.GRAD_SYNC_UNSPECIFIED, moe=None):
        config = pb.ModelConfig(**TINY_LLAMA, **(moe or {}))
        for connection in connections:
            info = connection.stub.CreateModel(pb.CreateModelRequest(
                model_id=model_id, config=config, seed=SEED,
                dtype=dtype, optimizer=pb.OPTIMIZER_ADAMW,
                default_adam=pb.AdamParams(eps=ADAM_EPS),
                default_max_grad_norm=MAX_GRAD_NORM, grad_sync=grad_sync))
            self.assertEqual(info.model_id, model_id)
            if grad_sync != pb.GRAD_SYNC_UNSPECIFIED:
                self.assertEqual(info.grad_sync, grad_sync)

    def forward_backward(self, connection, samples, reduction, model_id=MODEL_ID,
                         forward_only=False):
        return connection.stub.ForwardBackward(pb.ForwardBackwardRequest(
            model_id=model_id, samples=samples, reduction=reduction,
            forward_only=forward_only, return_logprobs=True))

    def check_call(self, reference, other, samples, rtol, what):
        """`other`'s response equals `reference`'s, and both count what the
        samples hold."""
        counts = [valid_tokens(s) for s in samples]
        for response in (reference, other):
            self.assertEqual(response.valid_tokens, sum(counts), what)
            self.assertEqual(response.num_samples, sum(1 for c in counts if c),
                             what)
            self.assertEqual([r.valid_tokens for r in response.samples], counts,
                             what)
        for counter in ("accumulated_calls", "accumulated_tokens",
                        "accumulated_samples"):
            self.assertEqual(getattr(other, counter), getattr(reference, counter),
                             f"{what} {counter}")
        self.assert_close(reference.loss_sum, other.loss_sum, rtol,
                          f"{what} loss_sum")
        self.assert_close(reference.loss_mean, other.loss_mean, rtol,
                          f"{what} loss_mean")
        for j, (a, b) in enumerate(zip(reference.samples, other.samples)):
            self.assert_close(a.loss_sum, b.loss_sum, rtol,
                              f"{what} sample {j} loss_sum")
            self.assertEqual(len(a.logprobs), len(samples[j].input_tokens))
            self.assertEqual(len(b.logprobs), len(samples[j].input_tokens))
            for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
                self.assert_close(x, y, rtol, f"{what} sample {j} logprob {i}")

    def train_step(self, connections, calls, reduction, rtol, what,
                   model_ids=(MODEL_ID, MODEL_ID)):
        """Sends `calls` and an OptimStep to each connection's model, checks
        that every answer matches the first connection's, and returns the
        OptimStepResponses."""
        for index, samples in enumerate(calls):
            responses = [self.forward_backward(c, samples, reduction, model_id)
                         for c, model_id in zip(connections, model_ids)]
            for other in responses[1:]:
                self.check_call(responses[0], other, samples, rtol,
                                f"{what} call {index}")
        steps = [c.stub.OptimStep(pb.OptimStepRequest(model_id=model_id))
                 for c, model_id in zip(connections, model_ids)]
        flat = [s for samples in calls for s in samples]
        if reduction == SAMPLE_MEAN:
            normalizer = sum(1 for s in flat if valid_tokens(s) > 0)
        else:
            normalizer = sum(valid_tokens(s) for s in flat)
        for step in steps:
            self.assertFalse(step.skipped, f"{what}: {step.skip_reason}")
            self.assertEqual(step.step, steps[0].step, what)
            self.assertEqual(step.normalizer, normalizer, f"{what} normalizer")
            # torch.nn.utils.clip_grad_norm_'s coefficient.
            self.assertAlmostEqual(
                step.clip_coef, min(1.0, MAX_GRAD_NORM / (step.grad_norm + 1e-6)),
                delta=1e-12, msg=f"{what} clip_coef")
        for other in steps[1:]:
            self.assert_close(steps[0].grad_norm, other.grad_norm, rtol,
                              f"{what} grad_norm")
            self.assert_close(steps[0].clip_coef, other.clip_coef, rtol,
                              f"{what} clip_coef")
        return steps

    def probe(self, connection, model_id=MODEL_ID):
        """Forward-only per-position log-probabilities of probe_samples()."""
        response = self.forward_backward(connection, probe_samples(), TOKEN_MEAN,
                                         model_id, forward_only=True)
        self.assertEqual(response.accumulated_calls, 0)
        return np.concatenate([np.array(r.logprobs) for r in response.samples])

    def assert_probes_close(self, a, b, rtol, what):
        scale = max(float(np.max(np.abs(a))), 1e-300)
        difference = float(np.max(np.abs(a - b))) / scale
        self.assertLessEqual(difference, rtol, f"{what}: probe log-probs differ "
                             f"by {difference:.3g} of their max")

    def save(self, connection, name, model_id=MODEL_ID):
        path = os.path.join(self.temp_dir, name)
        saved = connection.stub.SaveCheckpoint(pb.SaveCheckpointRequest(
            model_id=model_id, path=path))
        self.assertEqual(saved.path, path)
        return path

    def assert_tensors_close(self, a, b, rtol, what):
        """Same names, shapes and dtypes; every tensor equal within `rtol`
        of its largest magnitude."""
        self.assertEqual(sorted(a), sorted(b), what)
        for name in a:
            self.assertEqual(a[name].dtype, b[name].dtype, f"{what} {name}")
            self.assertEqual(a[name].shape, b[name].shape, f"{what} {name}")
            scale = max(float(np.max(np.abs(a[name]))), 1e-300)
            difference = float(np.max(np.abs(a[name] - b[name]))) / scale
            self.assertLessEqual(difference, rtol, f"{what} {name}: differs by "
                                 f"{difference:.3g} of its max {scale:.3g}")

    def assert_checkpoints_close(self, single_dir, multi_dir, rtol, numpy_dtype,
                                 moe=None):
        """Both checkpoints hold the full, unsharded model and agree."""
        single_config = read_json(os.path.join(single_dir, "config.json"))
        self.assertEqual(single_config,
                         read_json(os.path.join(multi_dir, "config.json")))
        for field, value in TINY_LLAMA.items():
            self.assertEqual(single_config[field], value, f"config.json {field}")
        single_model = read_safetensors(os.path.join(single_dir, "model.safetensors"))
        multi_model = read_safetensors(os.path.join(multi_dir, "model.safetensors"))
        shapes = expected_shapes(moe)
        self.assertEqual(sorted(multi_model), sorted(shapes))
        for name, tensor in multi_model.items():
            self.assertEqual(list(tensor.shape), shapes[name], name)
            self.assertEqual(tensor.dtype, np.dtype(numpy_dtype), name)
        self.assert_tensors_close(single_model, multi_model, rtol, "model")
        single_optimizer = read_safetensors(
            os.path.join(single_dir, "optimizer.safetensors"))
        multi_optimizer = read_safetensors(
            os.path.join(multi_dir, "optimizer.safetensors"))
        self.assertEqual(sorted(multi_optimizer),
                         sorted(f"{n}.{m}" for n in expected_shapes(moe, True)
                                for m in ("exp_avg", "exp_avg_sq")))
        self.assert_tensors_close(single_optimizer, multi_optimizer, rtol,
                                  "optimizer")
        # The same state; only how replicas sum gradients may differ.
        single_manifest = read_json(os.path.join(single_dir, "tally.json"))
        multi_manifest = read_json(os.path.join(multi_dir, "tally.json"))
        single_manifest.pop("grad_sync")
        multi_manifest.pop("grad_sync")
        self.assertEqual(single_manifest, multi_manifest)

    def test_dp_shard_tp_float32_training_and_checkpoints_cross_load(self):
        single, multi = self.start_pair(DP_SHARD_TP)
        both = [single, multi]
        self.create(both, pb.DTYPE_FLOAT32)
        reductions = [TOKEN_MEAN, SAMPLE_MEAN, TOKEN_MEAN]
        clipped = 0
        for step, reduction in enumerate(reductions):
            responses = self.train_step(both, step_calls(step), reduction,
                                        FLOAT32_RTOL, f"step {step}")
            self.assertEqual(responses[0].step, step + 1)
            clipped += responses[0].clip_coef < 1.0
        self.assertGreater(clipped, 0, "clipping was never active")
        probe_single = self.probe(single)
        probe_multi = self.probe(multi)
        self.assert_probes_close(probe_single, probe_multi, FLOAT32_RTOL,
                                 "after 3 steps")
        single_dir = self.save(single, "single-3")
        multi_dir = self.save(multi, "multi-3")
        self.assert_checkpoints_close(single_dir, multi_dir, FLOAT32_RTOL, "<f4")

        # Different steps on the two servers, so that a load that did nothing
        # would leave them apart.
        self.train_step([single], step_calls(10), TOKEN_MEAN, FLOAT32_RTOL,
                        "diverging step (1 rank)")
        self.train_step([multi], step_calls(11), TOKEN_MEAN, FLOAT32_RTOL,
                        "diverging step (4 ranks)")
        diverged = np.max(np.abs(self.probe(single) - self.probe(multi)))
        self.assertGreater(diverged, 1e-4)

        for connection, path in ((single, multi_dir), (multi, single_dir)):
            loaded = connection.stub.LoadCheckpoint(pb.LoadCheckpointRequest(
                model_id=MODEL_ID, path=path, load_optimizer=True))
            self.assertEqual(loaded.model.step, 3)
        # Each server now holds the other's weights.
        self.assert_probes_close(self.probe(single), probe_multi, FLOAT32_RTOL,
                                 "1 rank loaded the 4-rank checkpoint")
        self.assert_probes_close(self.probe(multi), probe_single, FLOAT32_RTOL,
                                 "4 ranks loaded the 1-rank checkpoint")
        responses = self.train_step(both, step_calls(3), TOKEN_MEAN, FLOAT32_RTOL,
                                    "step 3 after the cross-load")
        self.assertEqual(responses[0].step, 4)
        self.assert_checkpoints_close(self.save(single, "single-4"),
                                      self.save(multi, "multi-4"),
                                      FLOAT32_RTOL, "<f4")

    def check_float64_steps(self, mesh, moe=None):
        single, multi = self.start_pair(mesh)
        both = [single, multi]
        self.create(both, pb.DTYPE_FLOAT64, moe=moe)
        for step, reduction in enumerate([TOKEN_MEAN, SAMPLE_MEAN]):
            responses = self.train_step(both, step_calls(step), reduction,
                                        FLOAT64_RTOL, f"float64 step {step}")
        self.assertLess(responses[0].clip_coef, 1.0, "clipping must be active")
        self.assert_probes_close(self.probe(single), self.probe(multi),
                                 FLOAT64_RTOL, "logprobs after 2 steps")
        self.assert_samples_equal(single, multi)
        self.assert_checkpoints_close(self.save(single, "single-2"),
                                      self.save(multi, "multi-2"),
                                      FLOAT64_RTOL, "<f8", moe)

    def assert_all_close(self, a, b, what):
        self.assertEqual(len(a), len(b), what)
        for j, (x, y) in enumerate(zip(a, b)):
            self.assert_close(x, y, FLOAT64_RTOL, f"{what} [{j}]")

    def assert_samples_equal(self, single, multi):
        """A seeded Sample of the trained weights, with prompt
        log-probabilities: the same tokens and stop reasons on the mesh,
        log-probabilities within FLOAT64_RTOL."""
        request = pb.SampleRequest(
            model_id=MODEL_ID, num_samples=2,
            prompts=[pb.TokenSequence(tokens=[3, 17, 9, 40, 1]),
                     pb.TokenSequence(tokens=[22, 5])],
            params=pb.SamplingParams(max_tokens=5, temperature=0.9, top_k=20,
                                     seed=1234),
            include_prompt_logprobs=True, topk_prompt_logprobs=2)
        a, b = (c.stub.Sample(request) for c in (single, multi))
        self.assertEqual(len(a.sequences), 4)
        self.assertEqual((a.seed, a.step), (b.seed, b.step))
        for i, (x, y) in enumerate(zip(a.sequences, b.sequences)):
            self.assertEqual(list(x.tokens), list(y.tokens), f"sequence {i}")
            self.assertEqual(x.stop_reason, y.stop_reason, f"sequence {i}")
            self.assert_all_close(x.logprobs, y.logprobs,
                                  f"sequence {i} logprobs")
        for i, (x, y) in enumerate(zip(a.prompt_logprobs, b.prompt_logprobs)):
            self.assert_all_close(x.logprobs, y.logprobs,
                                  f"prompt {i} logprobs")
            self.assertEqual([list(t.tokens) for t in x.topk],
                             [list(t.tokens) for t in y.topk], f"prompt {i}")

    def test_dp_shard_tp_float64_steps(self):
        self.check_float64_steps(DP_SHARD_TP)

    def test_zero_stage_1_dp_shard_tp_float64_steps(self):
        """ZeRO-1 through the server: parameters kept gathered between
        steps, whole gradients reduce-scattered at each call's sync."""
        self.check_float64_steps(DP_SHARD_TP + ["--zero-stage", "1"])

    def test_cp_tp_float64_steps(self):
        """Context parallelism through the server: every sample's tokens
        split over two ranks, each with two tensor-parallel halves."""
        self.check_float64_steps(CP_TP)

    def test_ep_tp_float64_steps(self):
        """A Mixtral-style model with its experts split over two
        expert-parallel ranks, each with two tensor-parallel halves."""
        self.check_float64_steps(EP_TP, MIXTRAL)

    def test_dp_replicate_shard_deferred_and_eager_grad_sync(self):
        single, multi = self.start_pair(DP_REPLICATE_SHARD)
        self.create([single], pb.DTYPE_FLOAT32)
        self.create([multi], pb.DTYPE_FLOAT32, model_id="deferred",
                    grad_sync=pb.GRAD_SYNC_DEFERRED)
        self.create([multi], pb.DTYPE_FLOAT32, model_id="eager",
                    grad_sync=pb.GRAD_SYNC_EAGER)
        connections = [single, multi, multi]
        model_ids = (MODEL_ID, "deferred", "eager")
        for step, reduction in enumerate([TOKEN_MEAN, SAMPLE_MEAN]):
            self.train_step(connections, step_calls(step), reduction,
                            FLOAT32_RTOL, f"step {step}", model_ids)
        single_dir = self.save(single, "single-checkpoint")
        for model_id in model_ids[1:]:
            self.assert_checkpoints_close(single_dir,
                                          self.save(multi, model_id, model_id),
                                          FLOAT32_RTOL, "<f4")


if __name__ == "__main__":
    unittest.main()
