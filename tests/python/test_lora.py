"""Independent evidence that tally's LoRA adapters are PEFT's.

A LoRA model here starts from a tiny HF Llama directory (hf_reference) and
a PEFT adapter directory written by this file, with random nonzero A and B,
trains two accumulation windows with AdamW, and exports its adapter. The
reference is restated from PEFT's published definition, not from tally's
code:

  peft/tuners/lora/layer.py  LoraLayer.update_layer: scaling = lora_alpha / r
                             (use_rslora False); lora_A = nn.Linear(in, r,
                             bias=False), lora_B = nn.Linear(r, out,
                             bias=False); reset_lora_parameters (init True):
                             kaiming_uniform_(lora_A, a=sqrt(5)), i.e.
                             U(-1/sqrt(in), 1/sqrt(in)), zeros_(lora_B)
                             Linear.forward: result = base_layer(x)
                             + lora_B(lora_A(dropout(x))) * scaling
                             Linear.get_delta_weight: B @ A * scaling (merge:
                             W + delta)
  peft/utils/save_and_load.py get_peft_model_state_dict: the factors under
                             "base_model.model.<module>.lora_A.weight" (the
                             adapter name removed), in
                             adapter_model.safetensors beside
                             adapter_config.json

on the HF Llama of hf_reference.ReferenceCausalLM, in float64, with the base
frozen and torch.optim.AdamW over the factors only; a window's loss is the
sum of its token losses over its valid tokens (TOKEN_MEAN). Every factor
must agree to 1e-10 relative, and so must every call's loss and each step's
gradient norm, on one rank and on four (dp_shard x tp). Then: the merged
export is W + (alpha / r) B A; a tied model's lm_head adapter is PEFT's;
adapters of one base share it (ModelInfo.base) without touching each
other; bad LoRA requests are INVALID_ARGUMENT naming the field and change
nothing; and tally_client.tinker's create_lora_training_client makes a LoRA
model that learns.

"""

import json
import math
import os
import unittest

import grpc
import numpy as np
import torch

from hf_reference import (IGNORE, ReferenceCausalLM, SampleTerms, encode_tensor,
                          hf_config, parameter_shapes, random_weights,
                          read_hf_directory, write_hf_model, write_safetensors)
from tally_client import TrainingClient, lora_config, sample
from tally_client import tinker
from tally_client.tinker import types
from tally_testing import ServerTestCase, pb, read_json, read_safetensors

FLOAT64_RTOL = 1e-10

# A tiny Llama with GQA (q 16 wide, k and v 8) and an MLP of another width,
# so that every adapted projection has its own (in, out).
CONFIG = hf_config("llama", vocab_size=48, hidden_size=16,
                   intermediate_size=24, num_attention_heads=4,
                   num_key_value_heads=2, num_hidden_layers=2,
                   max_position_embeddings=64, rms_norm_eps=1e-5)
VOCAB = CONFIG["vocab_size"]

RANK = 4
ALPHA = 8.0  # scaling alpha / r = 2: a wrong scale cannot hide
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."


def target_modules(train_attn=True, train_mlp=True, train_unembed=True):
    """PEFT's target_modules for Tinker's switches."""
    return ((ATTN if train_attn else ()) + (MLP if train_mlp else ())
            + (("lm_head",) if train_unembed else ()))


def adapted_modules(config, targets):
    """The HF module names (model.layers.<i>.self_attn.q_proj, lm_head) an
    adapter with PEFT target_modules `targets` wraps: every nn.Linear whose
    name ends in a target (PEFT's check_target_module_exists)."""
    modules = []
    for i in range(config["num_hidden_layers"]):
        for name in ATTN:
            if name in targets:
                modules.append(f"model.layers.{i}.self_attn.{name}")
        for name in MLP:
            if name in targets:
                modules.append(f"model.layers.{i}.mlp.{name}")
    if "lm_head" in targets:
        modules.append("lm_head")
    return modules


def module_shape(config, module):
    """(out_features, in_features) of an nn.Linear; a tied model's lm_head
    is the embedding's [vocab, hidden]."""
    if module == "lm_head":
        return config["vocab_size"], config["hidden_size"]
    return parameter_shapes(config)[module + ".weight"]


def lora_parameter_count(config, targets, rank):
    """r * (in + out) per adapted nn.Linear (lora_A [r, in], lora_B
    [out, r])."""
    return sum(rank * sum(module_shape(config, m))
               for m in adapted_modules(config, targets))


def random_adapter(config, targets, rank, seed):
    """{module: (A [r, in], B [out, r])}: A as PEFT draws it (U(+-1/sqrt(in)))
    and B nonzero, N(0, 0.2^2), so that the adapter changes the model from
    the first token and A has a gradient at once."""
    rng = np.random.default_rng(seed)
    factors = {}
    for module in adapted_modules(config, targets):
        out_features, in_features = module_shape(config, module)
        bound = 1.0 / math.sqrt(in_features)
        factors[module] = (rng.uniform(-bound, bound, (rank, in_features)),
                           0.2 * rng.standard_normal((out_features, rank)))
    return factors


def write_peft_adapter(directory, factors, rank, alpha, targets,
                       storage="f64", base_model=""):
    """adapter_config.json and adapter_model.safetensors as PEFT's
    save_pretrained writes a LoRA adapter."""
    os.makedirs(directory, exist_ok=True)
    adapter_config = {
        "alpha_pattern": {}, "auto_mapping": None,
        "base_model_name_or_path": base_model, "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True,
        "init_lora_weights": True, "layers_pattern": None,
        "layers_to_transform": None, "lora_alpha": alpha,
        "lora_dropout": 0.0, "modules_to_save": None, "peft_type": "LORA",
        "r": rank, "rank_pattern": {}, "revision": None,
        "target_modules": list(targets), "task_type": "CAUSAL_LM",
        "use_dora": False, "use_rslora": False}
    with open(os.path.join(directory, "adapter_config.json"), "w",
              encoding="utf-8") as f:
        json.dump(adapter_config, f, indent=2)
    entries = []
    for module in sorted(factors):
        for kind, value in zip(("lora_A", "lora_B"), factors[module]):
            dtype, raw, _ = encode_tensor(value, storage)
            entries.append((f"{PEFT_PREFIX}{module}.{kind}.weight", dtype,
                            value.shape, raw))
    write_safetensors(os.path.join(directory, "adapter_model.safetensors"),
                      entries, {"format": "pt"})


def read_peft_factors(directory):
    """{module: (A, B)} of an exported PEFT adapter, after checking that it
    holds exactly pairs of factors under PEFT's key prefix."""
    tensors = read_safetensors(os.path.join(directory,
                                            "adapter_model.safetensors"))
    factors = {}
    for name in tensors:
        assert name.startswith(PEFT_PREFIX), name
        module, kind = name[len(PEFT_PREFIX):].rsplit(".", 2)[:2]
        assert kind in ("lora_A", "lora_B"), name
        factors.setdefault(module, {})[kind] = tensors[name]
    return {m: (f["lora_A"], f["lora_B"]) for m, f in factors.items()}


class LoraReference(ReferenceCausalLM):
    """HF LlamaForCausalLM with PEFT LoRA layers on `factors`' modules: the
    base parameters are frozen, the factors are float64 leaves with
    requires_grad."""

    def __init__(self, config, base, factors, scaling):
        super().__init__(config, base, torch.float64)
        for parameter in self.params.values():
            parameter.requires_grad_(False)
        self.scaling = scaling
        self.lora = {module: tuple(torch.tensor(f, dtype=torch.float64,
                                                requires_grad=True)
                                   for f in pair)
                     for module, pair in factors.items()}

    def factors(self):
        return [f for pair in self.lora.values() for f in pair]

    def linear(self, x, name):
        # peft Linear.forward: base_layer(x) + lora_B(lora_A(x)) * scaling
        # (lora_dropout 0: the identity). lm_head has no bias; a tied
        # model's is the embedding.
        result = x @ self.lm_head().T if name == "lm_head" else \
            super().linear(x, name)
        if name in self.lora:
            lora_a, lora_b = self.lora[name]
            result = result + ((x @ lora_a.T) @ lora_b.T) * self.scaling
        return result

    def log_probs(self, inputs):
        """ReferenceCausalLM.log_probs (a Llama) with lm_head an nn.Linear
        that PEFT may wrap too."""
        p = self.params
        x = p["model.embed_tokens.weight"][torch.tensor(inputs)]
        cos, sin = self.rotary(len(inputs))
        for i in range(self.config["num_hidden_layers"]):
            prefix = f"model.layers.{i}."
            h = self.rms_norm(x, p[prefix + "input_layernorm.weight"])
            x = x + self.attention(h, prefix + "self_attn.", cos, sin,
                                   self.windows[i])
            h = self.rms_norm(x, p[prefix + "post_attention_layernorm.weight"])
            x = x + self.mlp(h, prefix)
        x = self.rms_norm(x, p["model.norm.weight"])
        return torch.log_softmax(self.linear(x, "lm_head"), dim=-1)


def make_window(seed):
    """Two calls of samples of uneven lengths: unweighted, non-unit and zero
    weights, ignored targets. Weights are exact in float32."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return [int(t) for t in rng.integers(0, VOCAB, n)]

    targets = tokens(9)
    targets[0] = targets[5] = IGNORE
    return [[(tokens(6), tokens(6), None),
             (tokens(4), tokens(4), [1.5, 0.0, 0.25, 2.0])],
            [(tokens(9), targets, [1.0, 1.0, 0.5, 0.5, 3.0, 1.0, 1.0, 0.75,
                                   1.25]),
             (tokens(1), tokens(1), [2.5])]]


WINDOWS = [make_window(1), make_window(2)]


def to_proto(s):
    inputs, targets, weights = s
    return pb.Sample(input_tokens=inputs, target_tokens=targets,
                     weights=weights or [])


def relative_max_diff(got, expected):
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    return float(np.max(np.abs(np.asarray(got) - np.asarray(expected)))) / scale


class LoraTestCase(ServerTestCase):
    """A tiny HF Llama directory (float64 safetensors) in the test's temp
    dir, and helpers."""

    def setUp(self):
        super().setUp()
        self.base_dir = os.path.join(self.temp_dir, "base")
        self.base = write_hf_model(self.base_dir, CONFIG,
                                   random_weights(CONFIG, seed=5),
                                   storage="f64")

    def assertClose(self, got, expected, what, rtol=FLOAT64_RTOL):
        expected = float(expected)
        self.assertLessEqual(abs(got - expected),
                             rtol * max(abs(expected), 1e-30),
                             f"{what}: tally {got!r}, reference {expected!r}")

    def assertRefused(self, code, field, call, *args):
        with self.assertRaises(grpc.RpcError) as raised:
            call(*args)
        self.assertEqual(raised.exception.code(), code,
                         raised.exception.details())
        self.assertIn(field, raised.exception.details())
        return raised.exception.details()

    def adapter(self, name, targets, seed, rank=RANK, alpha=ALPHA):
        """({module: (A, B)}, the PEFT directory holding them)."""
        factors = random_adapter(CONFIG, targets, rank, seed)
        directory = os.path.join(self.temp_dir, name)
        write_peft_adapter(directory, factors, rank, alpha, targets,
                           base_model=self.base_dir)
        return factors, directory

    def export(self, model_id, name, merge=False):
        path = os.path.join(self.temp_dir, name)
        response = self.stub.ExportWeights(pb.ExportWeightsRequest(
            model_id=model_id, path=path, merge=merge))
        self.assertEqual(response.path, path)
        return path


class LoraReferenceTest(LoraTestCase):

    # tally-server's mesh flags (none: one rank).
    MESH = ()

    def check_calls(self, responses, terms, what):
        """Each call's and sample's loss_sum, valid_tokens and loss_mean
        (TOKEN_MEAN) against the reference."""
        for index, (response, call_terms) in enumerate(zip(responses, terms)):
            where = f"{what} call {index}"
            for j, (result, term) in enumerate(zip(response.samples,
                                                   call_terms)):
                self.assertClose(result.loss_sum, term.loss_sum,
                                 f"{where} sample {j} loss_sum")
                self.assertEqual(result.valid_tokens, term.valid_tokens)
            loss_sum = sum(float(t.loss_sum) for t in call_terms)
            tokens = sum(t.valid_tokens for t in call_terms)
            self.assertClose(response.loss_sum, loss_sum, f"{where} loss_sum")
            self.assertEqual(response.valid_tokens, tokens, where)
            self.assertClose(response.loss_mean, loss_sum / tokens,
                             f"{where} loss_mean")

    def test_two_adamw_windows_match_peft(self):
        """A PEFT adapter on every target, two TOKEN_MEAN windows of two
        calls, AdamW with weight decay (clipped in the first step): every
        call's loss, both gradient norms and every exported factor."""
        targets = target_modules()
        factors, adapter_dir = self.adapter("adapter", targets, seed=11)
        self.start_server(extra_args=list(self.MESH))
        info = self.stub.CreateModel(pb.CreateModelRequest(
            model_id="lora", init_checkpoint=self.base_dir,
            dtype=pb.DTYPE_FLOAT64, optimizer=pb.OPTIMIZER_ADAMW,
            lora=pb.LoraConfig(rank=RANK, alpha=ALPHA,
                               init_adapter=adapter_dir)))
        self.assertEqual((info.lora.rank, info.lora.alpha), (RANK, ALPHA))
        self.assertTrue(info.lora.train_attn and info.lora.train_mlp
                        and info.lora.train_unembed)
        self.assertEqual(info.lora.init_adapter, adapter_dir)
        count = lora_parameter_count(CONFIG, targets, RANK)
        self.assertEqual(info.trainable_parameters, count)
        self.assertEqual(info.trainable_bytes, 8 * count)

        model = LoraReference(CONFIG, self.base, factors, ALPHA / RANK)
        lr, betas, eps, weight_decay = 1e-2, (0.9, 0.95), 1e-8, 0.1
        optimizer = torch.optim.AdamW(model.factors(), lr=lr, betas=betas,
                                      eps=eps, weight_decay=weight_decay)
        adam = pb.AdamParams(learning_rate=lr, beta1=betas[0],
                             beta2=betas[1], eps=eps,
                             weight_decay=weight_decay)
        for window_index, window in enumerate(WINDOWS):
            what = f"window {window_index}"
            responses = [self.stub.ForwardBackward(pb.ForwardBackwardRequest(
                model_id="lora", samples=[to_proto(s) for s in call],
                reduction=pb.LOSS_REDUCTION_TOKEN_MEAN)) for call in window]
            optimizer.zero_grad()
            terms = [[SampleTerms(model, s) for s in call] for call in window]
            self.check_calls(responses, terms, what)
            flat = [t for call in terms for t in call]
            tokens = sum(t.valid_tokens for t in flat)
            (sum(t.loss_sum for t in flat) / tokens).backward()
            norm = math.sqrt(sum(float(f.grad.pow(2).sum())
                                 for f in model.factors()))
            # The first step clips (to half the norm), the second does not.
            max_norm = 0.5 * norm if window_index == 0 else 0.0
            step = self.stub.OptimStep(pb.OptimStepRequest(
                model_id="lora", adam=adam, max_grad_norm=max_norm))
            self.assertFalse(step.skipped, step.skip_reason)
            self.assertEqual(step.step, window_index + 1)
            self.assertEqual(step.normalizer, tokens)
            self.assertClose(step.grad_norm, norm, f"{what} grad_norm")
            clip_coef = min(1.0, max_norm / (norm + 1e-6)) if max_norm else 1.0
            self.assertClose(step.clip_coef, clip_coef, f"{what} clip_coef")
            with torch.no_grad():
                for f in model.factors():
                    f.grad.mul_(clip_coef)
            optimizer.step()

        peft_dir = self.export("lora", "peft")
        adapter_config = read_json(os.path.join(peft_dir,
                                                "adapter_config.json"))
        self.assertEqual(adapter_config["peft_type"], "LORA")
        self.assertEqual(adapter_config["r"], RANK)
        self.assertEqual(adapter_config["lora_alpha"], ALPHA)
        self.assertEqual(sorted(adapter_config["target_modules"]),
                         sorted(targets))
        self.assertFalse(adapter_config.get("use_rslora", False))
        exported = read_peft_factors(peft_dir)
        self.assertEqual(sorted(exported), sorted(model.lora))
        for module, (lora_a, lora_b) in model.lora.items():
            for kind, got, want, start in (
                    ("lora_A", exported[module][0], lora_a, factors[module][0]),
                    ("lora_B", exported[module][1], lora_b, factors[module][1])):
                want = want.detach().numpy()
                self.assertEqual(got.dtype, np.float64)
                self.assertEqual(got.shape, want.shape, f"{module} {kind}")
                self.assertLess(relative_max_diff(got, want), FLOAT64_RTOL,
                                f"{module}.{kind}")
                self.assertGreater(float(np.max(np.abs(got - start))), 1e-3,
                                   f"{module}.{kind} did not train")

        # The base stayed frozen (no weight decay either): the merged
        # export is the base plus the trained delta.
        merged = read_hf_directory(self.export("lora", "merged", merge=True))
        self.assertEqual(sorted(merged), sorted(self.base))
        for name, weight in merged.items():
            module = name[:-len(".weight")]
            expected = self.base[name]
            if module in model.lora:
                lora_a, lora_b = (f.detach().numpy() for f in model.lora[module])
                expected = expected + (ALPHA / RANK) * lora_b @ lora_a
            self.assertLess(relative_max_diff(weight, expected), FLOAT64_RTOL,
                            name)


class ShardedLoraReferenceTest(LoraReferenceTest):
    """The same on 4 ranks: parameters and factors sharded over dp_shard,
    the projections split by Megatron tensor parallelism (A whole and B
    split by rows on a column-parallel projection, A split by columns and
    B whole on a row-parallel one)."""

    MESH = ("--nproc-per-node", "4", "--dp-shard", "2", "--tp", "2")


class LoraExportTest(LoraTestCase):

    def test_merged_export_is_w_plus_scaled_ba(self):
        """An adapter on attention and lm_head only: the PEFT export gives
        it back bit for bit, the merged one is W + (alpha / r) B A on those
        and the base elsewhere, and loads as an HF model directory whose
        forward is the adapter model's."""
        targets = target_modules(train_mlp=False)
        factors, adapter_dir = self.adapter("adapter", targets, seed=12)
        self.start_server()
        self.stub.CreateModel(pb.CreateModelRequest(
            model_id="lora", init_checkpoint=self.base_dir,
            dtype=pb.DTYPE_FLOAT64, lora=pb.LoraConfig(
                rank=RANK, alpha=ALPHA, train_mlp=False,
                init_adapter=adapter_dir)))

        peft_dir = self.export("lora", "peft")
        self.assertEqual(
            read_json(os.path.join(peft_dir, "adapter_config.json"))
            ["target_modules"], list(targets))
        exported = read_peft_factors(peft_dir)
        self.assertEqual(sorted(exported), sorted(factors))
        for module, (lora_a, lora_b) in factors.items():
            np.testing.assert_array_equal(exported[module][0], lora_a, module)
            np.testing.assert_array_equal(exported[module][1], lora_b, module)

        merged_dir = self.export("lora", "merged", merge=True)
        merged = read_hf_directory(merged_dir)
        self.assertEqual(sorted(merged), sorted(self.base))
        adapted = 0
        for name, weight in merged.items():
            self.assertEqual(weight.dtype, np.float64, name)
            module = name[:-len(".weight")]
            if module in factors:
                lora_a, lora_b = factors[module]
                expected = self.base[name] + (ALPHA / RANK) * (lora_b @ lora_a)
                self.assertLess(relative_max_diff(weight, expected), 1e-14,
                                name)
                self.assertGreater(relative_max_diff(weight, self.base[name]),
                                   1e-2, f"{name}: no delta merged")
                adapted += 1
            else:
                np.testing.assert_array_equal(weight, self.base[name], name)
        self.assertEqual(adapted, len(factors))

        merged_config = read_json(os.path.join(merged_dir, "config.json"))
        for field in ("vocab_size", "hidden_size", "intermediate_size",
                      "num_hidden_layers", "num_attention_heads",
                      "num_key_value_heads", "rms_norm_eps", "rope_theta"):
            self.assertEqual(merged_config[field], CONFIG[field], field)
        # The merged directory is a plain HF model: the reference built from
        # its config.json and weights, and a full tally model created from
        # it, both give the adapter model's losses.
        window = WINDOWS[0][0]
        lora_reference = LoraReference(CONFIG, self.base, factors,
                                       ALPHA / RANK)
        plain_reference = ReferenceCausalLM(merged_config, merged,
                                            torch.float64)
        self.stub.CreateModel(pb.CreateModelRequest(
            model_id="merged", init_checkpoint=merged_dir,
            dtype=pb.DTYPE_FLOAT64))
        losses = {}
        for model_id in ("lora", "merged"):
            losses[model_id] = self.stub.ForwardBackward(
                pb.ForwardBackwardRequest(
                    model_id=model_id, samples=[to_proto(s) for s in window],
                    forward_only=True)).samples
        with torch.no_grad():
            for j, s in enumerate(window):
                want = float(SampleTerms(lora_reference, s).loss_sum)
                self.assertClose(float(SampleTerms(plain_reference, s)
                                       .loss_sum), want, f"sample {j} merged "
                                 "reference")
                for model_id, results in losses.items():
                    self.assertClose(results[j].loss_sum, want,
                                     f"sample {j} {model_id}")


class TiedLoraTest(LoraTestCase):
    """A model with tie_word_embeddings whose adapter covers lm_head: PEFT
    wraps the lm_head nn.Linear, whose weight is the embedding's, so the
    delta applies to the logits only, never to the embedding lookup."""

    TIED = dict(CONFIG, tie_word_embeddings=True)

    def setUp(self):
        super().setUp()
        self.base_dir = os.path.join(self.temp_dir, "tied-base")
        self.base = write_hf_model(self.base_dir, self.TIED,
                                   random_weights(self.TIED, seed=6),
                                   storage="f64")
        self.factors, adapter_dir = self.adapter("tied-adapter",
                                                 target_modules(), seed=15)
        self.start_server()
        self.stub.CreateModel(pb.CreateModelRequest(
            model_id="tied", init_checkpoint=self.base_dir,
            dtype=pb.DTYPE_FLOAT64, lora=pb.LoraConfig(
                rank=RANK, alpha=ALPHA, init_adapter=adapter_dir)))
        self.window = WINDOWS[0][1]

    def forward(self, model_id):
        return self.stub.ForwardBackward(pb.ForwardBackwardRequest(
            model_id=model_id, samples=[to_proto(s) for s in self.window],
            forward_only=True)).samples

    def test_tied_lm_head_adapter_matches_peft(self):
        model = LoraReference(self.TIED, self.base, self.factors, ALPHA / RANK)
        terms = [SampleTerms(model, s) for s in self.window]
        for j, (result, term) in enumerate(zip(self.forward("tied"), terms)):
            self.assertClose(result.loss_sum, term.loss_sum, f"sample {j}")
        self.stub.ForwardBackward(pb.ForwardBackwardRequest(
            model_id="tied", samples=[to_proto(s) for s in self.window]))
        step = self.stub.OptimStep(pb.OptimStepRequest(model_id="tied",
                                                       max_grad_norm=0.0))
        flat_tokens = sum(t.valid_tokens for t in terms)
        (sum(t.loss_sum for t in terms) / flat_tokens).backward()
        norm = math.sqrt(sum(float(f.grad.pow(2).sum())
                             for f in model.factors()))
        self.assertClose(step.grad_norm, norm, "grad_norm")

    def test_tied_merged_export_reproduces_the_adapter(self):
        """A tied model's merged head is a weight of its own: embed_tokens
        stays W, lm_head.weight = W + (alpha / r) B A, tie_word_embeddings
        false, so the merged model computes the adapter model's losses
        (adding the delta to the shared embedding would change the lookup
        too, PEFT's merge_and_unload pitfall, huggingface/peft#2018)."""
        merged_dir = self.export("tied", "merged", merge=True)
        self.stub.CreateModel(pb.CreateModelRequest(
            model_id="merged", init_checkpoint=merged_dir,
            dtype=pb.DTYPE_FLOAT64))
        merged = read_hf_directory(merged_dir)
        np.testing.assert_array_equal(merged["model.embed_tokens.weight"],
                                      self.base["model.embed_tokens.weight"])
        for j, (got, want) in enumerate(zip(self.forward("merged"),
                                            self.forward("tied"))):
            self.assertClose(got.loss_sum, want.loss_sum, f"sample {j}")


class LoraModelsTest(LoraTestCase):

    def client(self, model_id):
        client = TrainingClient(f"localhost:{self.server.grpc_port}", model_id)
        self.addCleanup(client.close)
        return client

    def test_adapters_share_a_base_and_are_independent(self):
        self.start_server()
        targets = target_modules(train_unembed=False)
        lora = {"rank": 2, "train_unembed": False}
        a, b, c, again, full = (self.client(m) for m in
                                ("a", "b", "c", "a-again", "full"))
        info_a = a.create_model(init_checkpoint=self.base_dir,
                                dtype=pb.DTYPE_FLOAT64, lora=dict(lora, seed=1))
        info_b = b.create_model(init_checkpoint=self.base_dir,
                                dtype=pb.DTYPE_FLOAT64, lora=dict(lora, seed=2))
        info_c = c.create_model(init_checkpoint=self.base_dir,
                                dtype=pb.DTYPE_FLOAT32, lora=dict(lora, seed=1))
        info_full = full.create_model(init_checkpoint=self.base_dir,
                                      dtype=pb.DTYPE_FLOAT64)
        self.assertTrue(info_a.base)
        self.assertEqual(info_a.base, info_b.base)
        self.assertNotEqual(info_a.base, info_c.base)  # another dtype
        self.assertEqual(info_full.base, "")
        self.assertIsNone(info_full.lora)
        self.assertEqual(info_full.trainable_parameters,
                         info_full.num_parameters)
        count = lora_parameter_count(CONFIG, targets, 2)
        for info, itemsize in ((info_a, 8), (info_b, 8), (info_c, 4)):
            self.assertEqual(info.trainable_parameters, count, info.model_id)
            self.assertEqual(info.trainable_bytes, itemsize * count)
            self.assertEqual(info.lora.alpha, 32.0)  # the default
            self.assertEqual((info.lora.rank, info.lora.train_attn,
                              info.lora.train_mlp, info.lora.train_unembed),
                             (2, True, True, False))
        self.assertEqual(info_a.lora.seed, 1)

        # PEFT's initialization: A ~ U(+-1/sqrt(in)) drawn from lora.seed,
        # B = 0.
        initial = {}
        for client in (a, b):
            path = os.path.join(self.temp_dir, f"{client.model_id}-init")
            client.export_weights(path).result()
            initial[client.model_id] = read_peft_factors(path)
        shapes = parameter_shapes(CONFIG)
        self.assertEqual(sorted(initial["a"]),
                         sorted(adapted_modules(CONFIG, targets)))
        for module, (lora_a, lora_b) in initial["a"].items():
            bound = 1 / math.sqrt(shapes[module + ".weight"][1])
            self.assertEqual(lora_a.shape, (2, shapes[module + ".weight"][1]))
            self.assertLessEqual(float(np.max(np.abs(lora_a))), bound, module)
            self.assertGreater(float(np.max(np.abs(lora_a))), 0.5 * bound)
            self.assertFalse(np.any(lora_b), module)
            self.assertFalse(np.array_equal(lora_a, initial["b"][module][0]))

        # Training one adapter leaves the other, and the shared base, alone.
        batch = [sample(x, y) for x, y, _ in WINDOWS[0][0]]

        def loss(client):
            return client.forward_backward(batch, forward_only=True) \
                .result().loss_sum

        before_a, before_b = loss(a), loss(b)
        self.assertEqual(before_a, before_b)  # B = 0: both are the base
        for _ in range(2):
            a.forward_backward(batch)
            a.optim_step(adam={"learning_rate": 0.05}).result()
        self.assertLess(loss(a), before_a)
        self.assertEqual(loss(b), before_b)
        self.assertEqual(loss(full), before_b)

        # merge on a model without an adapter is refused.
        with self.assertRaisesRegex(Exception, "merge"):
            full.export_weights(os.path.join(self.temp_dir, "x"),
                                merge=True).result()

        # Deleting both adapters drops the base; a new adapter rebuilds it.
        for client in (a, b):
            client.delete_model()
            with self.assertRaises(Exception) as raised:
                client.get_model()
            self.assertEqual(raised.exception.code, grpc.StatusCode.NOT_FOUND)
        info = again.create_model(init_checkpoint=self.base_dir,
                                  dtype=pb.DTYPE_FLOAT64, lora=dict(lora, seed=1))
        self.assertEqual(info.base, info_a.base)
        self.assertEqual(loss(again), before_b)
        path = os.path.join(self.temp_dir, "again-init")
        again.export_weights(path).result()
        for module, (lora_a, _) in read_peft_factors(path).items():
            # Same lora.seed, same draw.
            np.testing.assert_array_equal(lora_a, initial["a"][module][0])
        names = sorted(m.model_id for m in self.stub.ListModels(
            pb.ListModelsRequest()).models)
        self.assertEqual(names, ["a-again", "c", "full"])

    def test_bad_lora_is_refused_and_changes_nothing(self):
        self.start_server()
        targets = target_modules()
        _, adapter_dir = self.adapter("adapter", targets, seed=13)
        good = self.client("good")
        good.create_model(init_checkpoint=self.base_dir, dtype=pb.DTYPE_FLOAT64,
                          lora={"rank": RANK, "alpha": ALPHA,
                                "init_adapter": adapter_dir})
        full = self.client("full")
        full.create_model(init_checkpoint=self.base_dir, dtype=pb.DTYPE_FLOAT64)
        batch = [sample(x, y) for x, y, _ in WINDOWS[0][0]]
        good_loss = good.forward_backward(batch, forward_only=True).result() \
            .loss_sum

        def models():
            return [(m.model_id, m.base, m.step) for m in self.stub.ListModels(
                pb.ListModelsRequest()).models]

        before = models()
        _, wrong_shape_dir = self.adapter("wrong-shape", targets, seed=14,
                                          rank=2)
        # The config says r 4, the tensors are of rank 2.
        with open(os.path.join(wrong_shape_dir, "adapter_config.json"),
                  encoding="utf-8") as f:
            wrong_shape_config = json.load(f)
        wrong_shape_config["r"] = RANK
        with open(os.path.join(wrong_shape_dir, "adapter_config.json"), "w",
                  encoding="utf-8") as f:
            json.dump(wrong_shape_config, f)
        invalid = grpc.StatusCode.INVALID_ARGUMENT
        cases = [
            ("rank 0", {}, invalid, "lora.rank"),
            ("rank too large", {"rank": 1025}, invalid, "lora.rank"),
            ("negative alpha", {"rank": RANK, "alpha": -1.0}, invalid,
             "lora.alpha"),
            ("nothing to train", {"rank": RANK, "train_attn": False,
                                  "train_mlp": False, "train_unembed": False},
             invalid, "lora.train_"),
            ("adapter of another r", {"rank": 2, "alpha": ALPHA,
                                      "init_adapter": adapter_dir}, invalid,
             "lora.init_adapter"),
            ("adapter of another alpha", {"rank": RANK, "alpha": 16.0,
                                          "init_adapter": adapter_dir},
             invalid, "lora.init_adapter"),
            ("adapter of other targets", {"rank": RANK, "alpha": ALPHA,
                                          "train_mlp": False,
                                          "init_adapter": adapter_dir},
             invalid, "lora.init_adapter"),
            ("adapter tensors of another rank",
             {"rank": RANK, "alpha": ALPHA, "init_adapter": wrong_shape_dir},
             invalid, "lora_A"),
            ("no adapter there", {"rank": RANK, "alpha": ALPHA,
                                  "init_adapter": os.path.join(
                                      self.temp_dir, "absent")},
             grpc.StatusCode.NOT_FOUND, "lora.init_adapter"),
        ]
        for what, fields, code, field in cases:
            with self.subTest(what):
                request = pb.CreateModelRequest(
                    model_id="bad", init_checkpoint=self.base_dir,
                    dtype=pb.DTYPE_FLOAT64)
                request.lora.SetInParent()  # set, even when all default
                request.lora.MergeFrom(lora_config(fields))
                self.assertTrue(request.HasField("lora"))
                self.assertRefused(code, field, self.stub.CreateModel, request)
                self.assertEqual(models(), before)
        # A full model's checkpoint does not load into an adapter (it would
        # write into the shared base), nor an adapter's into a full model.
        full_checkpoint = os.path.join(self.temp_dir, "full-checkpoint")
        full.save(full_checkpoint).result()
        adapter_checkpoint = os.path.join(self.temp_dir, "adapter-checkpoint")
        good.save(adapter_checkpoint).result()
        for client, path in ((good, full_checkpoint),
                             (full, adapter_checkpoint)):
            with self.assertRaises(Exception) as raised:
                client.load(path).result()
            self.assertEqual(raised.exception.code, invalid, raised.exception)
        self.assertEqual(models(), before)
        self.assertEqual(good.forward_backward(batch, forward_only=True)
                         .result().loss_sum, good_loss)
        # The refused id is free.
        self.client("bad").create_model(init_checkpoint=self.base_dir,
                                        dtype=pb.DTYPE_FLOAT64, lora=RANK)


class PeftOptionsTest(LoraTestCase):

    def test_peft_options_tally_does_not_implement_are_refused(self):
        """An adapter_config.json with a per-module alpha (alpha_pattern) or
        adapting only some layers (layers_to_transform) would make the model
        compute another function than PEFT's with that adapter (q_proj
        scaled by alpha / r instead of 16 / r; layer 1 adapted): each is
        INVALID_ARGUMENT naming lora.init_adapter, as use_rslora is."""
        factors = random_adapter(CONFIG, target_modules(), RANK, seed=16)
        self.start_server()
        for option, value in (("alpha_pattern", {"q_proj": 16}),
                              ("layers_to_transform", [0])):
            with self.subTest(option):
                directory = os.path.join(self.temp_dir, option)
                write_peft_adapter(directory, factors, RANK, ALPHA,
                                   target_modules())
                path = os.path.join(directory, "adapter_config.json")
                adapter_config = read_json(path)
                adapter_config[option] = value
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(adapter_config, f)
                self.assertRefused(
                    grpc.StatusCode.INVALID_ARGUMENT, "lora.init_adapter",
                    self.stub.CreateModel, pb.CreateModelRequest(
                        model_id=option.replace("_", "-"),
                        init_checkpoint=self.base_dir, dtype=pb.DTYPE_FLOAT64,
                        lora=pb.LoraConfig(rank=RANK, alpha=ALPHA,
                                           init_adapter=directory)))


class TinkerLoraTest(LoraTestCase):

    def test_create_lora_training_client_trains_an_adapter(self):
        self.start_server()
        service = tinker.ServiceClient(
            base_url=f"localhost:{self.server.grpc_port}")
        self.addCleanup(service.close)
        training = service.create_lora_training_client(
            base_model=self.base_dir, rank=RANK, seed=3, train_unembed=False,
            dtype=pb.DTYPE_FLOAT64)
        info = training.get_info()
        self.assertTrue(info.is_lora)
        self.assertEqual(info.lora_rank, RANK)
        lora = info.model_info.lora
        self.assertEqual((lora.rank, lora.alpha, lora.seed, lora.train_attn,
                          lora.train_mlp, lora.train_unembed),
                         (RANK, 32.0, 3, True, True, False))
        self.assertEqual(info.model_name, self.base_dir)

        rng = np.random.default_rng(7)
        data = []
        for _ in range(3):
            tokens = [int(t) for t in rng.integers(0, VOCAB, 9)]
            data.append(types.Datum(
                model_input=types.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:],
                                "weights": [0.0, 0.0] + [1.0] * 6}))
        adam = types.AdamParams(learning_rate=1e-2)
        losses = []
        for _ in range(6):
            fwd_bwd = training.forward_backward(data, "cross_entropy")
            step = training.optim_step(adam)
            losses.append(fwd_bwd.result().metrics["loss:sum"])
            self.assertGreater(step.result().metrics["tally/grad_norm"], 0.0)
        self.assertLess(losses[-1], 0.7 * losses[0], losses)
        self.assertTrue(all(later < earlier for earlier, later
                            in zip(losses, losses[1:])), losses)

        # The sampler's weights: the adapter (PEFT), or merged on request.
        peft = training.save_weights_for_sampler(
            os.path.join(self.temp_dir, "sampler"), export=True).result().path
        self.assertEqual(sorted(os.listdir(peft)), [
            "adapter_config.json", "adapter_model.safetensors",
            "checksums.sha256"])
        merged = training.save_weights_for_sampler(
            os.path.join(self.temp_dir, "sampler-merged"), merge=True,
            dtype="float32").result().path
        self.assertTrue(os.path.isfile(os.path.join(merged, "config.json")))
        self.assertEqual(read_json(os.path.join(merged, "config.json"))
                         ["vocab_size"], VOCAB)

        # A saved LoRA state comes back as the same adapter of the base.
        def loss(client):
            return client.forward(data, "cross_entropy").result() \
                .metrics["loss:sum"]

        saved = training.save_state(os.path.join(self.temp_dir, "state")) \
            .result()
        restored = service.create_training_client_from_state_with_optimizer(
            saved.path)
        restored_info = restored.get_info()
        self.assertEqual((restored_info.is_lora, restored_info.lora_rank),
                         (True, RANK))
        self.assertEqual(restored_info.model_info.base, info.model_info.base)
        self.assertEqual(restored_info.model_info.step, 6)
        self.assertEqual(loss(restored), loss(training))

        # rank=None: tally's full fine-tuning.
        full = service.create_lora_training_client(
            base_model=self.base_dir, rank=None, dtype=pb.DTYPE_FLOAT64)
        full_info = full.get_info()
        self.assertEqual((full_info.is_lora, full_info.lora_rank),
                         (False, None))
        self.assertEqual(full_info.model_info.trainable_parameters,
                         full_info.model_info.num_parameters)


if __name__ == "__main__":
    unittest.main()
