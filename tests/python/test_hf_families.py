"""Independent evidence that tally trains HF's llama (llama3 and linear RoPE
scaling, biases, explicit head_dim), qwen2, qwen3, mistral and mixtral
exactly, from HF model directories.

Each case writes a tiny HF directory (config.json as transformers writes it
for the family, random weights stored as bf16, as fp16 for mistral, sharded
with model.safetensors.index.json for some cases), creates a FLOAT64 model
from it with CreateModel(init_checkpoint=dir) on a running tally-server, runs
a two-call accumulation window (non-unit and zero weights, ignored targets,
a sample with no valid target, samples longer than the sliding windows) and
a clipped AdamW step, then compares per-token logprobs, per-sample and window
losses, the gradient norm, the clip coefficient and every updated weight
with hf_reference.py's float64 model + torch.optim.AdamW, to 1e-10 relative.
The weights tally loaded must equal the stored bf16 (fp16) values exactly.

Each case also exports the model with ExportWeights (docs/checkpoints.md,
"Weights export"): as bfloat16 right after CreateModel, where every tensor
must be the source's values rounded to bf16 to nearest even under the
source's HF names (a bf16 source's bytes as they are), and as float32 after
the step, where every tensor must be the float64 weights SaveCheckpoint wrote
rounded to nearest even. The float32 export, loaded into a new FLOAT32 model
with CreateModel(init_checkpoint=export), must give back exactly its values,
bit for bit. Both exports must hold config.json with the source's
model_type, architectures and math fields (typed-equal), its other fields
carried over, torch_dtype the export's; the source's generation_config.json
and tokenizer_config.json byte for byte; a checksums.sha256 covering every
file; a consistent index when sharded.

Each case also checks, on the reference alone, that the feature under test
moves the result far beyond the tolerance (so a server ignoring it fails).

One case per test method; run a single family with e.g.
    python3 -m unittest -v test_hf_families -k qwen3
or TALLY_HF_CASES=qwen3,mistral python3 -m unittest -v test_hf_families.
"""

import hashlib
import math
import os
import unittest

import grpc
import numpy as np
import torch

from hf_reference import (IGNORE, ReferenceCausalLM, SampleTerms, attention_biases,
                          default_inv_freq, float32_to_bf16_bits, has_qk_norm, head_dim,
                          hf_config, hf_weight_files, layer_windows, llama3_bands,
                          mlp_bias, num_experts, num_kv_heads, parameter_names,
                          parameter_shapes, random_weights, read_hf_directory,
                          read_safetensors_raw, rms_norm_eps, rope_inv_freq,
                          rope_settings, tie_word_embeddings, window_loss,
                          with_layer_types, write_hf_model)
from tally_testing import ServerTestCase, pb, read_json, read_safetensors

FLOAT64_RTOL = 1e-10
# A feature must move some logprob (or the loss) by more than this, relative.
SENSITIVITY = 1e-6

TOKEN_MEAN = pb.LOSS_REDUCTION_TOKEN_MEAN
SAMPLE_MEAN = pb.LOSS_REDUCTION_SAMPLE_MEAN


def llama3_scaling():
    # head_dim 16, rope_theta 1e4: wavelengths 2*pi*1e4^(i/8) = 6.3, 19.9,
    # 62.8, 199, ... against high_freq_wavelen 64/4 = 16 and
    # low_freq_wavelen 64/1 = 64: one high, two medium, five low bands.
    return {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
            "original_max_position_embeddings": 64, "rope_type": "llama3"}


# name: (family, config.json fields, shards, reduction, what the case
# isolates as {description: config fields that switch it off}). The source
# weights are stored in config.json's torch_dtype (hf_config's "bfloat16"
# unless the fields say otherwise; see SOURCE_STORAGE).
CASES = {
    "llama": (
        "llama", {}, 2, TOKEN_MEAN, {}),
    "llama3": (
        "llama",
        {"hidden_size": 64, "intermediate_size": 96, "rope_theta": 10000.0,
         "max_position_embeddings": 256, "rope_scaling": llama3_scaling()},
        2, TOKEN_MEAN,
        {"llama3 rope scaling": {"rope_scaling": None}}),
    "llama_linear_bias": (
        "llama",
        {"head_dim": 12, "attention_bias": True, "mlp_bias": True,
         "rope_scaling": {"factor": 2.0, "rope_type": "linear"}},
        1, SAMPLE_MEAN,
        {"linear rope scaling": {"rope_scaling": None}}),
    "qwen2": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},
        1, TOKEN_MEAN,
        {"the sliding window": {"use_sliding_window": False},
         "full attention in layer 0": {"max_window_layers": 0}}),
    "qwen3": (
        "qwen3",
        {"tie_word_embeddings": True, "head_dim": 16, "transformers_version": "4.55.0"},
        3, SAMPLE_MEAN,
        {}),
    "mistral": (
        "mistral",
        {"sliding_window": 3, "torch_dtype": "float16"},
        1, TOKEN_MEAN,
        {"the sliding window": {"sliding_window": None}}),
    "mixtral_aux": (
        "mixtral",
        {"output_router_logits": True, "router_aux_loss_coef": 0.05},
        2, SAMPLE_MEAN,
        {"the load-balancing loss": {"output_router_logits": False}}),
    "mixtral_no_aux": (
        "mixtral",
        {"output_router_logits": False, "router_aux_loss_coef": 0.05},
        1, TOKEN_MEAN,
        {"output_router_logits": {"output_router_logits": True}}),
}

# The config.json fields each family's transformers config reads that change
# the model's math (configuration_<family>.py; the modeling code reads them).
COMMON_MATH_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "hidden_act", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "tie_word_embeddings", "attention_dropout")
MATH_FIELDS = {
    "llama": COMMON_MATH_FIELDS + ("head_dim", "attention_bias", "mlp_bias",
                                   "pretraining_tp"),
    "mistral": COMMON_MATH_FIELDS + ("head_dim", "sliding_window"),
    "mixtral": COMMON_MATH_FIELDS + (
        "head_dim", "sliding_window", "num_local_experts", "num_experts_per_tok",
        "router_aux_loss_coef", "output_router_logits", "router_jitter_noise"),
    "qwen2": COMMON_MATH_FIELDS + ("use_sliding_window", "sliding_window",
                                   "max_window_layers", "layer_types"),
    "qwen3": COMMON_MATH_FIELDS + ("head_dim", "attention_bias", "use_sliding_window",
                                   "sliding_window", "max_window_layers", "layer_types"),
}
# config.json's torch_dtype of a source directory: how write_hf_model stores
# its weights.
SOURCE_STORAGE = {"bfloat16": "bf16", "float16": "f16"}
# How an export stores its weights: decided by the export, never carried over.
EXPORT_STORAGE_FIELDS = ("torch_dtype", "dtype", "quantization_config")
# The files an export copies from the init_checkpoint directory (the source
# directories here hold these two).
COPIED_FILES = ("generation_config.json", "tokenizer_config.json")


def write_extra_files(directory, name):
    """A generation_config.json and a tokenizer_config.json as a model
    directory ships them; unsorted keys and irregular spacing, so a copy that
    re-serializes them is not byte-identical."""
    texts = {
        "generation_config.json":
            '{\n    "eos_token_id": 2,  "bos_token_id": 1,\n'
            f'    "do_sample": false, "_case": "{name}"\n}}\n',
        "tokenizer_config.json":
            '{"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 256,'
            f' "bos_token": "<s>", "eos_token": "</s>", "_case": "{name}"}}',
    }
    for file_name, text in texts.items():
        with open(os.path.join(directory, file_name), "w", encoding="utf-8") as f:
            f.write(text)


def json_same(a, b):
    """Equal JSON values of the same JSON types (an int is not a float, a
    bool is not a number), recursively."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict):
        return (isinstance(b, dict) and a.keys() == b.keys()
                and all(json_same(a[k], b[k]) for k in a))
    if isinstance(a, list):
        return (isinstance(b, list) and len(a) == len(b)
                and all(json_same(x, y) for x, y in zip(a, b)))
    return type(a) is type(b) and a == b


def effective_config(config):
    """What a config means to the family's transformers model, as
    hf_reference.py interprets it (HF's defaults and derived fields
    applied)."""
    theta, scaling = rope_settings(config)
    meaning = {
        "model_type": config["model_type"],
        "shapes": parameter_shapes(config),
        "head_dim": head_dim(config),
        "num_key_value_heads": num_kv_heads(config),
        "rms_norm_eps": rms_norm_eps(config),
        "rope_theta": theta,
        "rope_scaling": scaling,
        "rope_inv_freq": rope_inv_freq(config).tolist(),
        "layer_windows": layer_windows(config),
        "attention_biases": attention_biases(config),
        "mlp_bias": mlp_bias(config),
        "qk_norm": has_qk_norm(config),
        "tie_word_embeddings": tie_word_embeddings(config),
        "hidden_act": config.get("hidden_act", "silu"),
    }
    if num_experts(config):
        meaning.update(
            num_experts=num_experts(config),
            num_experts_per_tok=config.get("num_experts_per_tok", 2),
            # MixtralConfig defaults.
            router_aux_loss_coef=config.get("router_aux_loss_coef", 0.001),
            output_router_logits=bool(config.get("output_router_logits", False)),
            router_jitter_noise=config.get("router_jitter_noise", 0.0))
    return meaning


def bf16_ties(values):
    """How many of `values` (exact in float32) lie exactly halfway between
    two neighbouring bf16 values: the 16 low bits of the float32 are 0x8000."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    return int(np.sum((bits & 0xFFFF) == 0x8000))


def sha256_of(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


ADAM = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
MAX_GRAD_NORM = 1.0


def case_config(name):
    family, fields, _, _, _ = CASES[name]
    config = hf_config(family, **fields)
    if name == "qwen3":
        # transformers >= 4.53 writes layer_types for qwen2/qwen3.
        config = with_layer_types(config)
    return config


def make_calls(vocab, seed):
    """Two calls: lengths up to 11 (beyond the windows of 3), omitted
    weights, non-unit and zero weights, ignored targets, a sample whose
    targets are all ignored, and a single-token sample. Weights are exact in
    float32."""
    rng = np.random.default_rng(seed)

    def tokens(n):
        return [int(t) for t in rng.integers(0, vocab, n)]

    ignored = tokens(11)
    ignored[0] = ignored[1] = ignored[6] = IGNORE
    first = [(tokens(9), tokens(9), None),
             (tokens(5), tokens(5), [1.5, 0.0, 0.25, 2.0, 1.0])]
    second = [(tokens(11), ignored,
               [1.0, 1.0, 0.5, 0.5, 3.0, 1.0, 1.0, 0.75, 1.0, 1.0, 1.25]),
              (tokens(4), [IGNORE] * 4, None),
              (tokens(1), tokens(1), [2.5])]
    return [first, second]


def to_proto(sample):
    inputs, targets, weights = sample
    return pb.Sample(input_tokens=inputs, target_tokens=targets, weights=weights or [])


def assert_close(test, got, expected, rtol, what):
    expected = float(expected)
    tolerance = rtol * max(abs(expected), 1e-30)
    test.assertLessEqual(abs(got - expected), tolerance,
                         f"{what}: tally {got!r}, reference {expected!r}")


def relative_max_diff(got, expected):
    scale = max(float(np.max(np.abs(expected))), 1e-30)
    return float(np.max(np.abs(np.asarray(got) - expected))) / scale


def selected(names):
    only = os.environ.get("TALLY_HF_CASES")
    if not only:
        return names
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(CASES))
    if unknown:
        raise ValueError(f"TALLY_HF_CASES names unknown cases {unknown}; known: {sorted(CASES)}")
    return [n for n in names if n in wanted]


class HfFamiliesTest(ServerTestCase):

    def reference(self, config, stored):
        return ReferenceCausalLM(config, stored, torch.float64)

    def check_semantics(self, name, config, stored, calls):
        """What the case pins down, on the reference alone."""
        windows = layer_windows(config)
        if name == "llama3":
            bands = llama3_bands(config)
            for band in ("low", "medium", "high"):
                self.assertIn(band, bands, f"llama3 bands {bands}")
            # high: kept; low: divided by factor; medium: strictly between.
            plain = default_inv_freq(config).tolist()
            scaled = rope_inv_freq(config).tolist()
            factor = config["rope_scaling"]["factor"]
            for band, p, s in zip(bands, plain, scaled):
                if band == "high":
                    self.assertEqual(s, p)
                elif band == "low":
                    self.assertEqual(s, p / factor)
                else:
                    self.assertTrue(p / factor < s < p, (p, s))
        if name == "qwen2":
            # max_window_layers 1 of 2: layer 0 full, layer 1 slides.
            self.assertEqual(windows, [None, 3])
        if name == "mistral":
            self.assertEqual(windows, [3, 3])
        if name in ("qwen2", "mistral"):
            longest = max(len(s[0]) for call in calls for s in call)
            self.assertGreater(longest, 3, "samples must outrun the window")
        if name == "qwen3":
            self.assertEqual(windows, [None, None])
            self.assertNotEqual(config["head_dim"],
                                config["hidden_size"] // config["num_attention_heads"])
        samples = [s for call in calls for s in call]
        with torch.no_grad():
            base = self.reference(config, stored)
            base_terms = [SampleTerms(base, s) for s in samples]
            for what, fields in CASES[name][4].items():
                other = self.reference(dict(config, **fields), stored)
                other_terms = [SampleTerms(other, s) for s in samples]
                logprob_diff = max(relative_max_diff(o.logprobs.numpy(), b.logprobs.numpy())
                                   for o, b in zip(other_terms, base_terms)
                                   if b.valid_tokens > 0)
                loss_diff = abs(float(window_loss(other_terms, False))
                                - float(window_loss(base_terms, False)))
                self.assertGreater(max(logprob_diff, loss_diff), SENSITIVITY,
                                   f"{name}: {what} changes nothing measurable")

    def run_case(self, name):
        family, _, shards, reduction, _ = CASES[name]
        config = case_config(name)
        directory = os.path.join(self.temp_dir, f"hf_{name}")
        stored = write_hf_model(directory, config, random_weights(config, seed=len(name)),
                                storage=SOURCE_STORAGE[config["torch_dtype"]],
                                shards=shards)
        write_extra_files(directory, name)
        if shards > 1:  # the index checker, on an index written independently
            self.check_index(directory, *self.read_weight_files(directory))
        calls = make_calls(config["vocab_size"], seed=sum(map(ord, name)))
        self.check_semantics(name, config, stored, calls)

        self.start_server()
        model_id = name
        info = self.stub.CreateModel(pb.CreateModelRequest(
            model_id=model_id, init_checkpoint=directory, dtype=pb.DTYPE_FLOAT64,
            optimizer=pb.OPTIMIZER_ADAMW))
        self.assertEqual(info.model_id, model_id)
        self.check_bf16_export(name, directory, config)

        before = self.read_checkpoint(self.save(model_id, "A"), config)
        for n, value in stored.items():  # loaded exactly: bf16 (fp16) upcast
            self.assertTrue(np.array_equal(before[n], value), f"{name}: loaded {n}")

        responses = [self.stub.ForwardBackward(pb.ForwardBackwardRequest(
            model_id=model_id, samples=[to_proto(s) for s in call], reduction=reduction,
            return_logprobs=True)) for call in calls]
        step = self.stub.OptimStep(pb.OptimStepRequest(
            model_id=model_id, max_grad_norm=MAX_GRAD_NORM,
            adam=pb.AdamParams(learning_rate=ADAM["lr"], beta1=ADAM["betas"][0],
                               beta2=ADAM["betas"][1], eps=ADAM["eps"],
                               weight_decay=ADAM["weight_decay"])))
        after = self.read_checkpoint(self.save(model_id, "B"), config)
        export_dir = self.check_float32_export(name, directory, config, after)
        self.check_reimport(name, export_dir, config)

        model = self.reference(config, stored)
        terms = [[SampleTerms(model, s) for s in call] for call in calls]
        self.check_responses(name, responses, terms, calls, reduction)

        flat = [t for call in terms for t in call]
        loss = window_loss(flat, reduction == SAMPLE_MEAN)
        loss.backward()
        params = list(model.params.values())
        for p in params:  # e.g. an expert no token reached
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in params))
        clip_coef = min(1.0, MAX_GRAD_NORM / (norm + 1e-6))
        counted = [t for t in flat if t.valid_tokens > 0]
        normalizer = (len(counted) if reduction == SAMPLE_MEAN
                      else sum(t.valid_tokens for t in counted))

        self.assertEqual(step.step, 1)
        self.assertFalse(step.skipped, step.skip_reason)
        self.assertEqual(step.normalizer, normalizer)
        assert_close(self, step.grad_norm, norm, FLOAT64_RTOL, f"{name}: grad_norm")
        assert_close(self, step.clip_coef, clip_coef, FLOAT64_RTOL, f"{name}: clip_coef")
        self.assertLess(step.clip_coef, 0.9, "clipping must be active")

        with torch.no_grad():
            for p in params:
                p.grad.mul_(clip_coef)
        torch.optim.AdamW(params, **ADAM).step()
        for n, p in model.params.items():
            expected = p.detach().numpy()
            self.assertLess(relative_max_diff(after[n], expected), FLOAT64_RTOL,
                            f"{name}: updated {n}")
        moved = max(float(np.max(np.abs(after[n] - before[n]))) for n in after)
        self.assertGreater(moved, 1e-3, f"{name}: the step changed nothing")

    # -- ExportWeights -----------------------------------------------------

    def export(self, model_id, tag, dtype):
        """ExportWeights to a fresh directory in the test's temp dir; checks
        the response against the directory written."""
        path = os.path.join(self.temp_dir, f"{model_id}_export_{tag}")
        response = self.stub.ExportWeights(pb.ExportWeightsRequest(
            model_id=model_id, path=path, dtype=dtype))
        what = f"{model_id}: export {tag}"
        self.assertEqual(os.path.realpath(response.path), os.path.realpath(path), what)
        files = sorted(os.listdir(path))
        self.assertEqual(list(response.files), files, what)
        self.assertEqual(response.bytes_written,
                         sum(os.path.getsize(os.path.join(path, f)) for f in files), what)
        return path

    def read_weight_files(self, directory):
        """({name: (dtype, shape, raw bytes)}, {name: file}) over the
        directory's safetensors files (no name twice), each file's metadata
        required to be {"format": "pt"}."""
        tensors = {}
        where = {}
        for file_name in hf_weight_files(directory):
            metadata, found = read_safetensors_raw(os.path.join(directory, file_name))
            self.assertEqual(metadata, {"format": "pt"}, f"{directory}/{file_name}")
            for n, entry in found.items():
                self.assertNotIn(n, tensors, f"{directory}: {n} stored twice")
                tensors[n] = entry
                where[n] = file_name
        return tensors, where

    def check_index(self, directory, tensors, where):
        """model.safetensors.index.json, when present, matches the shards:
        HF's shard names, every tensor mapped to the shard holding it and
        nothing else, total_size the tensor bytes; without an index there is
        one model.safetensors and no shard file."""
        listed = sorted(os.listdir(directory))
        shard_files = [f for f in listed if f.startswith("model-") and
                       f.endswith(".safetensors")]
        index_path = os.path.join(directory, "model.safetensors.index.json")
        if not os.path.exists(index_path):
            self.assertIn("model.safetensors", listed, directory)
            self.assertEqual(shard_files, [], directory)
            return
        index = read_json(index_path)
        self.assertEqual(sorted(index), ["metadata", "weight_map"], directory)
        weight_map = index["weight_map"]
        self.assertEqual(sorted(weight_map), sorted(tensors), directory)
        self.assertEqual(weight_map, where, directory)
        shards = sorted(set(weight_map.values()))
        self.assertEqual(shards, [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                  for i in range(len(shards))], directory)
        self.assertEqual(shard_files, shards, f"{directory}: shard files")
        self.assertNotIn("model.safetensors", listed, directory)
        self.assertEqual(index["metadata"].get("total_size"),
                         sum(len(raw) for _, _, raw in tensors.values()), directory)

    def check_export_directory(self, name, source_dir, path, config, torch_dtype):
        """The files, checksums.sha256, the copied files and config.json of
        an export of the model created from `source_dir` (whose config.json
        is `config`). Returns the exported tensors (raw)."""
        what = f"{name}: export {os.path.basename(path)}"
        files = sorted(os.listdir(path))
        weight_files = hf_weight_files(path)
        expected = {"config.json", "checksums.sha256", *COPIED_FILES, *weight_files}
        if weight_files != ["model.safetensors"]:
            expected.add("model.safetensors.index.json")
        self.assertEqual(files, sorted(expected), what)

        # checksums.sha256: `<sha256>  <file>` for every other file.
        with open(os.path.join(path, "checksums.sha256"), encoding="utf-8") as f:
            lines = f.read().splitlines()
        digests = {}
        for line in lines:
            digest, _, file_name = line.partition("  ")
            self.assertNotIn(file_name, digests, f"{what}: {line!r}")
            digests[file_name] = digest
        self.assertEqual(sorted(digests), sorted(set(files) - {"checksums.sha256"}), what)
        for file_name, digest in digests.items():
            self.assertEqual(digest, sha256_of(os.path.join(path, file_name)),
                             f"{what}: checksum of {file_name}")

        for file_name in COPIED_FILES:
            with open(os.path.join(source_dir, file_name), "rb") as f:
                source_bytes = f.read()
            with open(os.path.join(path, file_name), "rb") as f:
                self.assertEqual(f.read(), source_bytes, f"{what}: {file_name} not copied as is")

        self.check_export_config(what, read_json(os.path.join(path, "config.json")),
                                 read_json(os.path.join(source_dir, "config.json")),
                                 torch_dtype)
        self.assertEqual(read_json(os.path.join(source_dir, "config.json")), config)

        tensors, where = self.read_weight_files(path)
        self.check_index(path, tensors, where)
        self.assertEqual(sorted(tensors), parameter_names(config), f"{what}: tensor names")
        return tensors

    def check_export_config(self, what, exported, source, torch_dtype):
        """model_type, architectures and every math field of the source
        config.json, typed-equal; every other source field carried over; the
        export's own torch_dtype; and the exported config means the same
        model as the source (fields the export adds are the defaults)."""
        family = source["model_type"]
        self.assertEqual(exported.get("model_type"), family, what)
        self.assertEqual(exported.get("architectures"), source["architectures"], what)
        self.assertEqual(exported.get("torch_dtype"), torch_dtype, what)
        for field in ("dtype", "quantization_config"):
            self.assertNotIn(field, exported, what)
        math_fields = MATH_FIELDS[family]
        differing_math = {f: (source[f], exported.get(f, "<missing>"))
                          for f in math_fields
                          if f in source and not json_same(exported.get(f), source[f])}
        self.assertEqual(differing_math, {},
                         f"{what}: math fields of config.json differ (source, export)")
        dropped = {f: source[f] for f in source
                   if f not in math_fields and f not in EXPORT_STORAGE_FIELDS
                   and not json_same(exported.get(f, ()), source[f])}
        self.assertEqual(dropped, {}, f"{what}: source config.json fields not carried over")
        self.assertEqual(effective_config(exported), effective_config(source),
                         f"{what}: the exported config.json means another model")

    def check_bf16_export(self, name, source_dir, config):
        """Right after CreateModel: a bfloat16 export of the float64 model
        holding the source's values stores them rounded to nearest even: a
        bf16 source's bytes as they are, an fp16 source's values rounded
        (ties to even among them)."""
        path = self.export(name, "bf16", pb.DTYPE_BFLOAT16)
        exported = self.check_export_directory(name, source_dir, path, config, "bfloat16")
        source, _ = self.read_weight_files(source_dir)
        values = read_hf_directory(source_dir)
        self.assertEqual(sorted(exported), sorted(source), f"{name}: exported tensor names")
        ties = 0
        for n, (dtype, shape, raw) in exported.items():
            self.assertEqual(dtype, "BF16", f"{name}: exported {n}")
            self.assertEqual(shape, source[n][1], f"{name}: exported {n} shape")
            got = np.frombuffer(raw, dtype="<u2")
            want = float32_to_bf16_bits(values[n]).reshape(-1)
            self.assertEqual(got.size, want.size, f"{name}: exported {n}")
            mismatched = int(np.sum(got != want))
            self.assertEqual(mismatched, 0, f"{name}: exported {n}: {mismatched} of "
                             f"{want.size} bf16 values are not the source's "
                             f"{source[n][0]} values rounded to nearest even")
            ties += bf16_ties(values[n])
        if {dtype for dtype, _, _ in source.values()} != {"BF16"}:
            # The rounding is exercised, round-half-to-even included.
            self.assertGreater(ties, 0, f"{name}: no source value is a bf16 tie")

    def check_float32_export(self, name, source_dir, config, weights):
        """After the step: a float32 export stores `weights` (the float64
        model's, from SaveCheckpoint) rounded to nearest even. Returns the
        export's path."""
        path = self.export(name, "f32", pb.DTYPE_FLOAT32)
        exported = self.check_export_directory(name, source_dir, path, config, "float32")
        self.assertEqual(sorted(exported), sorted(weights), f"{name}: exported tensor names")
        inexact = 0
        for n, (dtype, shape, raw) in exported.items():
            self.assertEqual(dtype, "F32", f"{name}: exported {n}")
            self.assertEqual(shape, weights[n].shape, f"{name}: exported {n} shape")
            expected = weights[n].astype(np.float32)
            got = np.frombuffer(raw, dtype="<f4").reshape(shape)
            mismatched = int(np.sum(got.view(np.uint32) != expected.view(np.uint32)))
            self.assertEqual(mismatched, 0, f"{name}: exported {n}: {mismatched} of "
                             f"{expected.size} values are not the float64 weights rounded "
                             f"to float32")
            inexact += int(np.sum(expected.astype(np.float64) != weights[n]))
        # The rounding is exercised: most updated weights are not floats.
        self.assertGreater(inexact, 0, f"{name}: every weight is exact in float32")
        return path

    def check_reimport(self, name, export_dir, config):
        """The float32 export loads back: a FLOAT32 model created with
        CreateModel(init_checkpoint=export_dir) holds exactly the exported
        tensors, bit for bit (from its SaveCheckpoint). The model is deleted
        afterwards."""
        model_id = f"{name}_reimport"
        info = self.stub.CreateModel(pb.CreateModelRequest(
            model_id=model_id, init_checkpoint=export_dir, dtype=pb.DTYPE_FLOAT32))
        self.assertEqual(info.model_id, model_id)
        self.assertEqual(info.dtype, pb.DTYPE_FLOAT32, f"{name}: re-imported dtype")
        loaded = self.read_checkpoint(self.save(model_id, "loaded"), config, "<f4")
        exported, _ = self.read_weight_files(export_dir)
        self.assertEqual(sorted(loaded), sorted(exported), f"{name}: re-imported names")
        for n, (_, shape, raw) in exported.items():
            want = np.frombuffer(raw, dtype="<f4").reshape(shape)
            self.assertEqual(loaded[n].shape, want.shape, f"{name}: re-imported {n} shape")
            mismatched = int(np.sum(loaded[n].view(np.uint32) != want.view(np.uint32)))
            self.assertEqual(mismatched, 0, f"{name}: re-imported {n}: {mismatched} of "
                             f"{want.size} values differ from the float32 export's")
        self.stub.DeleteModel(pb.DeleteModelRequest(model_id=model_id))

    def save(self, model_id, tag):
        path = os.path.join(self.temp_dir, f"{model_id}_{tag}")
        self.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model_id=model_id, path=path))
        return path

    def read_checkpoint(self, path, config, dtype="<f8"):
        """{name: array} of the checkpoint at `path` of a model of `config`,
        every tensor stored as `dtype` (the model's: "<f8" for FLOAT64,
        "<f4" for FLOAT32)."""
        saved = read_json(os.path.join(path, "config.json"))
        self.assertEqual(saved.get("model_type"), config["model_type"])
        tensors = read_safetensors(os.path.join(path, "model.safetensors"))
        self.assertEqual(sorted(tensors), parameter_names(config))
        for n, value in tensors.items():
            self.assertEqual(value.dtype, np.dtype(dtype), n)
        return tensors

    def check_responses(self, name, responses, terms, calls, reduction):
        window_tokens = window_samples = 0
        for index, (response, call_terms) in enumerate(zip(responses, terms)):
            what = f"{name} call {index}"
            self.assertEqual(len(response.samples), len(call_terms), what)
            for j, (result, term) in enumerate(zip(response.samples, call_terms)):
                assert_close(self, result.loss_sum, term.loss_sum, FLOAT64_RTOL,
                             f"{what} sample {j} loss_sum")
                self.assertEqual(result.valid_tokens, term.valid_tokens,
                                 f"{what} sample {j} valid_tokens")
                expected = term.logprobs.detach().numpy()
                got = np.array(result.logprobs)
                self.assertEqual(got.shape, expected.shape, f"{what} sample {j} logprobs")
                self.assertLess(relative_max_diff(got, expected), FLOAT64_RTOL,
                                f"{what} sample {j} logprobs: tally {got}, "
                                f"reference {expected}")
                ignored = [t == IGNORE for t in calls[index][j][1]]
                self.assertTrue(np.all(got[ignored] == 0.0), f"{what} sample {j}")
            loss_sum = sum(float(t.loss_sum) for t in call_terms)
            tokens = sum(t.valid_tokens for t in call_terms)
            counted = [t for t in call_terms if t.valid_tokens > 0]
            assert_close(self, response.loss_sum, loss_sum, FLOAT64_RTOL, f"{what} loss_sum")
            self.assertEqual(response.valid_tokens, tokens, f"{what} valid_tokens")
            self.assertEqual(response.num_samples, len(counted), f"{what} num_samples")
            mean = float(window_loss(call_terms, reduction == SAMPLE_MEAN))
            assert_close(self, response.loss_mean, mean, FLOAT64_RTOL, f"{what} loss_mean")
            window_tokens += tokens
            window_samples += len(counted)
            self.assertEqual(response.accumulated_calls, index + 1, what)
            self.assertEqual(response.accumulated_tokens, window_tokens, what)
            self.assertEqual(response.accumulated_samples, window_samples, what)

    def test_unimplemented_rope_scaling_is_refused(self):
        """A config.json whose math tally does not implement (yarn RoPE) is
        refused at CreateModel, naming the field."""
        config = hf_config("llama", rope_scaling={
            "factor": 4.0, "original_max_position_embeddings": 64, "rope_type": "yarn"})
        directory = os.path.join(self.temp_dir, "hf_yarn")
        write_hf_model(directory, config, random_weights(config, seed=3))
        self.start_server()
        with self.assertRaises(grpc.RpcError) as raised:
            self.stub.CreateModel(pb.CreateModelRequest(
                model_id="yarn", init_checkpoint=directory, dtype=pb.DTYPE_FLOAT64))
        self.assertEqual(raised.exception.code(), grpc.StatusCode.INVALID_ARGUMENT,
                         raised.exception.details())
        self.assertIn("rope_scaling", raised.exception.details())


def _add_case(name):
    def test(self):
        self.run_case(name)
    test.__name__ = f"test_{name}"
    test.__doc__ = f"{name}: {CASES[name][0]} from an HF directory, window + AdamW step."
    setattr(HfFamiliesTest, test.__name__, test)


for _name in selected(list(CASES)):
    _add_case(_name)


if __name__ == "__main__":
    unittest.main()
