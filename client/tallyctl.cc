// tallyctl: command-line client of a tally server. Manages models and runs a
// small next-byte-prediction training loop on a text file.
//
//   tallyctl create --model-id demo --seed 1 --dtype bf16
//   tallyctl train demo --steps 30 --calls-per-step 4
//   tallyctl save demo /tmp/ckpt && tallyctl list --output json
//   tallyctl export demo /tmp/demo-hf --dtype bfloat16
//   tallyctl sample --model demo --prompt-ids 72,105 --max-tokens 8 --seed 1
//   tallyctl sample --model llama --prompt-ids 9906,1917 --tokenizer dir
//   tallyctl samplers save demo step3
//   tallyctl sample --model demo --sampler step3 --prompt-ids 72,105
//   tallyctl samplers list --model demo && tallyctl samplers delete demo step3
//   tallyctl server-info --target tally:50051 --ca-cert ca.pem --token "$T"
//
// The commands that change a model (train, load, abort) send its next
// seq_ids as the server reports them, so a retried call is answered from the
// server's cache and never applied twice; do not run them against a model a
// sequenced client is training (they would take its seq_ids). save, export,
// sample and samplers change no weights and stay unsequenced.
//
// Exit status: 0 on success, 1 when the server or a file on it fails (the
// gRPC code and message go to stderr), 2 on a command-line error: an
// unknown command or flag, a missing argument or flag value, a flag value
// tallyctl refuses (FlagError, client/command_line.h), an unreadable
// --ca-cert, --client-cert or --client-key.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/file_text.h"
#include "base/status.h"
#include "client/command_line.h"
#include "client/dtype_names.h"
#include "client/output.h"
#include "client/text_batcher.h"
#include "client/tokenizer_json.h"
#include "client/trainer_client.h"
#include "nlohmann/json.hpp"

namespace tally {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Prefixes a failure with where it happened, keeping its code.
absl::Status Annotate(const absl::Status& status, const std::string& where) {
  return absl::Status(status.code(),
                      absl::StrCat(where, ": ", status.message()));
}

// "OPTIMIZER_ADAMW" -> "adamw".
std::string EnumLabel(const std::string& name, absl::string_view prefix) {
  return absl::AsciiStrToLower(absl::StripPrefix(name, prefix));
}

std::string OptimizerLabel(v1::Optimizer optimizer) {
  return EnumLabel(v1::Optimizer_Name(optimizer), "OPTIMIZER_");
}

std::string YesNo(bool value) { return value ? "yes" : "no"; }

// The dtype of `allowed` that --dtype's `name` spells (client/dtype_names.h).
absl::StatusOr<v1::DType> ParseDTypeFlag(
    const std::string& name, const std::vector<v1::DType>& allowed) {
  const std::optional<v1::DType> dtype = ProtoDTypeNamed(name);
  if (dtype.has_value() &&
      std::find(allowed.begin(), allowed.end(), *dtype) != allowed.end()) {
    return *dtype;
  }
  return FlagValueError("dtype", name, DTypeSpellings(allowed));
}

void PrintModelInfo(std::ostream& out, const v1::ModelInfo& info) {
  const v1::ModelConfig& c = info.config();
  const v1::AdamParams& adam = info.default_adam();
  out << absl::StrFormat(
      "model %s\n"
      "  step %d, %d parameters, %s, %s\n"
      "  config: vocab_size=%d hidden_size=%d intermediate_size=%d "
      "num_hidden_layers=%d num_attention_heads=%d num_key_value_heads=%d "
      "max_position_embeddings=%d rms_norm_eps=%g rope_theta=%g "
      "tie_word_embeddings=%s\n"
      "  optimizer defaults: lr=%g betas=(%g, %g) eps=%g weight_decay=%g "
      "max_grad_norm=%g\n"
      "  pending window: %d calls, %d tokens, %d samples\n",
      info.model_id(), info.step(), info.num_parameters(),
      DTypeLabel(info.dtype()), OptimizerLabel(info.optimizer()),
      c.vocab_size(), c.hidden_size(), c.intermediate_size(),
      c.num_hidden_layers(), c.num_attention_heads(), c.num_key_value_heads(),
      c.max_position_embeddings(), c.rms_norm_eps(), c.rope_theta(),
      c.tie_word_embeddings() ? "true" : "false", adam.learning_rate(),
      adam.beta1(), adam.beta2(), adam.eps(), adam.weight_decay(),
      info.default_max_grad_norm(), info.accumulated_calls(),
      info.accumulated_tokens(), info.accumulated_samples());
  if (info.has_lora()) {
    const v1::LoraConfig& lora = info.lora();
    out << absl::StrFormat(
        "  LoRA adapter: rank=%d alpha=%g attn=%s mlp=%s unembed=%s, %d "
        "trainable parameters (%d bytes)\n"
        "  base: %s\n",
        lora.rank(), lora.alpha(), lora.train_attn() ? "true" : "false",
        lora.train_mlp() ? "true" : "false",
        lora.train_unembed() ? "true" : "false", info.trainable_parameters(),
        info.trainable_bytes(), info.base());
  }
}

// The seq_ids of one model's mutating calls, counted from the model's
// next_seq_id: each call takes the next one.
class SeqIds {
 public:
  static absl::StatusOr<SeqIds> Of(TrainerClient& client,
                                   const std::string& model_id) {
    v1::GetModelRequest request;
    request.set_model_id(model_id);
    TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.GetModel(request));
    return From(info);
  }
  static SeqIds From(const v1::ModelInfo& info) {
    return SeqIds(info.next_seq_id());
  }
  uint64_t Next() { return next_++; }

 private:
  explicit SeqIds(uint64_t next) : next_(next) {}
  uint64_t next_;
};

// "<what>: 3 calls, 120 tokens, 4 samples" when calls > 0.
void PrintWindow(std::ostream& out, const std::string& what, int64_t calls,
                 int64_t tokens, int64_t samples) {
  if (calls == 0) return;
  out << absl::StrFormat("%s: %d calls, %d tokens, %d samples\n", what, calls,
                         tokens, samples);
}

// One subcommand: binds its flags, then runs against a connected client,
// printing its results to `out`. A flag value it refuses is a FlagError.
class Command {
 public:
  virtual ~Command() = default;
  virtual void AddFlags(FlagParser& flags) {}
  virtual absl::Status Run(TrainerClient& client,
                           const std::vector<std::string>& args,
                           Output& out) = 0;
};

class CreateCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("model-id", &model_id_, "model id (empty: the server picks one)");
    flags.Add("seed", &seed_, "parameter initialization seed");
    flags.Add("dtype", &dtype_,
              "float32, float64, or bfloat16 (mixed precision: float32 "
              "parameters and optimizer state, bfloat16 matmuls); also fp32, "
              "fp64, bf16 or DTYPE_<NAME>, any case");
    flags.Add("optimizer", &optimizer_, "adamw or sgd");
    flags.Add("lr", &lr_, "default learning rate (default: the server's)");
    flags.Add("max-grad-norm", &max_grad_norm_,
              "default gradient clipping norm (0: no clipping)");
    flags.Add("init-checkpoint", &init_checkpoint_,
              "model to start from: a tally checkpoint, or an HF model "
              "directory (config.json + safetensors) of a family the server "
              "trains (model types in 'tallyctl server-info': llama, qwen2, "
              "qwen3, mistral, mixtral); with --lora-rank the shared, frozen "
              "base");
    flags.Add("lora-rank", &lora_rank_,
              "LoRA rank: the model is an adapter over a frozen base shared "
              "with the other adapters of that base (0: a full model)");
    flags.Add("lora-alpha", &lora_alpha_, "LoRA alpha (0: 32)");
    flags.Add("lora-targets", &lora_targets_,
              "comma-separated parts the adapter covers: attn, mlp, unembed");
    flags.Add("lora-init-adapter", &lora_init_adapter_,
              "PEFT adapter directory or tally adapter checkpoint to start "
              "from");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::CreateModelRequest request;
    request.set_model_id(model_id_);
    request.set_seed(seed_);
    TALLY_ASSIGN_OR_RETURN(
        v1::DType dtype,
        ParseDTypeFlag(dtype_, {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT64,
                                v1::DTYPE_BFLOAT16}));
    request.set_dtype(dtype);
    if (optimizer_ == "adamw") {
      request.set_optimizer(v1::OPTIMIZER_ADAMW);
    } else if (optimizer_ == "sgd") {
      request.set_optimizer(v1::OPTIMIZER_SGD);
    } else {
      return FlagValueError("optimizer", optimizer_, "adamw or sgd");
    }
    if (lr_.has_value()) {
      request.mutable_default_adam()->set_learning_rate(*lr_);
    }
    request.set_default_max_grad_norm(max_grad_norm_);
    request.set_init_checkpoint(init_checkpoint_);
    if (lora_rank_ > 0) {
      TALLY_RETURN_IF_ERROR(SetLora(*request.mutable_lora()));
    } else if (lora_alpha_ != 0 || lora_targets_ != kAllLoraTargets ||
               !lora_init_adapter_.empty()) {
      return FlagError(
          "flags --lora-alpha, --lora-targets and --lora-init-adapter need "
          "--lora-rank");
    }
    TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.CreateModel(request));
    return out.Print(info, [&](std::ostream& os) {
      os << "created ";
      PrintModelInfo(os, info);
    });
  }

 private:
  std::string model_id_;
  uint64_t seed_ = 0;
  std::string dtype_ = "float32";
  std::string optimizer_ = "adamw";
  std::optional<double> lr_;
  double max_grad_norm_ = 0.0;
  std::string init_checkpoint_;
  int lora_rank_ = 0;
  double lora_alpha_ = 0.0;
  static constexpr char kAllLoraTargets[] = "attn,mlp,unembed";
  std::string lora_targets_ = kAllLoraTargets;
  std::string lora_init_adapter_;

  absl::Status SetLora(v1::LoraConfig& lora) const {
    lora.set_rank(lora_rank_);
    lora.set_alpha(lora_alpha_);
    lora.set_train_attn(false);
    lora.set_train_mlp(false);
    lora.set_train_unembed(false);
    for (absl::string_view part : absl::StrSplit(lora_targets_, ',')) {
      if (part == "attn") {
        lora.set_train_attn(true);
      } else if (part == "mlp") {
        lora.set_train_mlp(true);
      } else if (part == "unembed") {
        lora.set_train_unembed(true);
      } else {
        return FlagValueError("lora-targets", part, "attn, mlp or unembed");
      }
    }
    lora.set_init_adapter(lora_init_adapter_);
    return absl::OkStatus();
  }
};

class ListCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    TALLY_ASSIGN_OR_RETURN(v1::ListModelsResponse response,
                           client.ListAllModels());
    return out.Print(response,
                     [&](std::ostream& os) { PrintTable(os, response); });
  }

 private:
  static void PrintTable(std::ostream& os,
                         const v1::ListModelsResponse& response) {
    if (response.models().empty()) {
      os << "no models\n";
      return;
    }
    constexpr char kRow[] = "%-20s %8s %12s %-8s %-9s %s\n";
    os << absl::StrFormat(kRow, "MODEL", "STEP", "PARAMETERS", "DTYPE",
                          "OPTIMIZER", "PENDING CALLS");
    for (const v1::ModelInfo& info : response.models()) {
      os << absl::StrFormat(kRow, info.model_id(), absl::StrCat(info.step()),
                            absl::StrCat(info.num_parameters()),
                            DTypeLabel(info.dtype()),
                            OptimizerLabel(info.optimizer()),
                            absl::StrCat(info.accumulated_calls()));
    }
  }
};

class InfoCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::GetModelRequest request;
    request.set_model_id(args[0]);
    TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.GetModel(request));
    return out.Print(info, [&](std::ostream& os) { PrintModelInfo(os, info); });
  }
};

class DeleteCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::DeleteModelRequest request;
    request.set_model_id(args[0]);
    TALLY_ASSIGN_OR_RETURN(v1::DeleteModelResponse response,
                           client.DeleteModel(request));
    return out.Print(response, [&](std::ostream& os) {
      os << absl::StrFormat("deleted model %s (at step %d)\n",
                            response.model().model_id(),
                            response.model().step());
    });
  }
};

class SaveCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("allow-pending", &allow_pending_,
              "save even with a pending accumulation window (whose gradients "
              "the checkpoint does not hold; the model keeps them)");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::SaveCheckpointRequest request;
    request.set_model_id(args[0]);
    request.set_path(args[1]);
    request.set_allow_pending(allow_pending_);
    TALLY_ASSIGN_OR_RETURN(v1::SaveCheckpointResponse response,
                           client.SaveCheckpoint(request));
    return out.Print(response, [&](std::ostream& os) {
      os << absl::StrFormat("saved model %s at step %d to %s (%d bytes)\n",
                            args[0], response.step(), response.path(),
                            response.bytes_written());
      PrintWindow(os, "without the pending window", response.unsaved_calls(),
                  response.unsaved_tokens(), response.unsaved_samples());
    });
  }

 private:
  bool allow_pending_ = false;
};

class AbortCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    TALLY_ASSIGN_OR_RETURN(SeqIds seq_ids, SeqIds::Of(client, args[0]));
    v1::AbortAccumulationRequest request;
    request.set_model_id(args[0]);
    request.set_seq_id(seq_ids.Next());
    TALLY_ASSIGN_OR_RETURN(v1::AbortAccumulationResponse response,
                           client.AbortAccumulation(request));
    return out.Print(response, [&](std::ostream& os) {
      if (response.discarded_calls() == 0) {
        os << "model " << args[0] << " had no pending window\n";
      }
      PrintWindow(
          os, absl::StrCat("discarded the pending window of model ", args[0]),
          response.discarded_calls(), response.discarded_tokens(),
          response.discarded_samples());
    });
  }
};

class ExportCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("dtype", &dtype_,
              "stored dtype: float32, float64, bfloat16 or float16; also "
              "fp32, fp64, bf16, fp16 or DTYPE_<NAME>, any case (empty: the "
              "model's)");
    flags.Add("merge", &merge_,
              "a LoRA model: the base with the adapter merged in, as a full "
              "HF directory (default: the adapter in PEFT's format)");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::ExportWeightsRequest request;
    request.set_model_id(args[0]);
    request.set_path(args[1]);
    if (!dtype_.empty()) {
      TALLY_ASSIGN_OR_RETURN(
          v1::DType dtype,
          ParseDTypeFlag(dtype_, {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT64,
                                  v1::DTYPE_BFLOAT16, v1::DTYPE_FLOAT16}));
      request.set_dtype(dtype);
    }
    request.set_merge(merge_);
    TALLY_ASSIGN_OR_RETURN(v1::ExportWeightsResponse response,
                           client.ExportWeights(request));
    return out.Print(response, [&](std::ostream& os) {
      os << absl::StrFormat(
          "exported the weights of model %s to %s (%d files, %d bytes)\n",
          args[0], response.path(), response.files_size(),
          response.bytes_written());
    });
  }

 private:
  std::string dtype_;
  bool merge_ = false;
};

// "1,2,3" as token ids: FlagValueError naming --<flag> otherwise.
absl::StatusOr<std::vector<int32_t>> ParseTokenIds(const std::string& flag,
                                                   const std::string& text) {
  std::vector<int32_t> ids;
  for (absl::string_view part : absl::StrSplit(text, ',')) {
    int32_t id = 0;
    if (!absl::SimpleAtoi(part, &id) || id < 0) {
      return FlagValueError(flag, text,
                            "a comma-separated list of token ids (ints >= 0)");
    }
    ids.push_back(id);
  }
  return ids;
}

class SampleCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("model", &model_, "the model to sample from (required)");
    flags.Add("prompt-ids", &prompt_ids_,
              "the prompt as comma-separated token ids (required)");
    flags.Add("max-tokens", &max_tokens_, "the most tokens per sequence");
    flags.Add("temperature", &temperature_, "0: greedy (default: 1)");
    flags.Add("top-p", &top_p_, "in (0, 1] (default: 1, off)");
    flags.Add("top-k", &top_k_, "-1: off, else >= 1");
    flags.Add("seed", &seed_,
              "an integer >= 0 (default: the server picks one and prints it)");
    flags.Add("num-samples", &num_samples_, "sequences sampled");
    flags.Add("stop-ids", &stop_ids_,
              "comma-separated token ids that end a sequence; 'eos': the "
              "model's EOS tokens; 'none': only --max-tokens ends one");
    flags.Add("sampler", &sampler_,
              "a sampler snapshot of the model (tallyctl samplers save) to "
              "sample from (default: the live weights)");
    flags.Add("tokenizer", &tokenizer_dir_,
              "a local copy of the model's directory: prints the prompt and "
              "each sequence as text through its tokenizer.json (default: "
              "token ids only)");
    flags.Add("skip-special-tokens", &skip_special_tokens_,
              "with --tokenizer, leaves special tokens (BOS, EOS) out of the "
              "text");
    flags.Add("ids", &show_ids_, "with --tokenizer, prints the ids as well");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>&,
                   Output& out) override {
    TALLY_ASSIGN_OR_RETURN(v1::SampleRequest request, Request());
    TALLY_ASSIGN_OR_RETURN(std::optional<TokenizerJson> tokenizer,
                           LoadTokenizer());
    std::optional<std::string> prompt_text;
    if (tokenizer) {
      TALLY_ASSIGN_OR_RETURN(prompt_text,
                             Text(*tokenizer, request.prompts(0).tokens()));
    }
    TALLY_ASSIGN_OR_RETURN(v1::SampleResponse response, client.Sample(request));
    if (!tokenizer) {
      return out.Print(response, [&](std::ostream& os) {
        PrintSequences(os, response, std::nullopt, {}, /*show_ids=*/true);
      });
    }
    std::vector<std::string> texts;
    for (const v1::SampledSequence& sequence : response.sequences()) {
      TALLY_ASSIGN_OR_RETURN(std::string text,
                             Text(*tokenizer, sequence.tokens()));
      texts.push_back(std::move(text));
    }
    std::ostringstream text;
    PrintSequences(text, response, prompt_text, texts, show_ids_);
    TALLY_ASSIGN_OR_RETURN(nlohmann::ordered_json record,
                           Output::MessageJson(response));
    record["prompt_text"] = *prompt_text;
    for (size_t i = 0; i < texts.size(); ++i) {
      record["sequences"][i]["text"] = texts[i];
    }
    out.Print(record, text.str());
    return absl::OkStatus();
  }

 private:
  // A JSON string: quoted, with newlines and other control characters
  // escaped, so one sequence prints on one line.
  static std::string Quoted(const std::string& text) {
    return nlohmann::json(text).dump();
  }

  // "model ..., step ..., seed ...", the prompt's text when there is one,
  // and each sequence: its text when `texts` has one, its ids (on a line of
  // their own after a text, or in place of one), and its log-probabilities.
  void PrintSequences(std::ostream& os, const v1::SampleResponse& response,
                      const std::optional<std::string>& prompt_text,
                      const std::vector<std::string>& texts,
                      bool show_ids) const {
    os << absl::StrFormat("model %s, step %d, seed %d\n", model_,
                          response.step(), response.seed());
    if (prompt_text) os << "prompt: " << Quoted(*prompt_text) << "\n";
    for (int i = 0; i < response.sequences_size(); ++i) {
      const v1::SampledSequence& sequence = response.sequences(i);
      const std::string ids = absl::StrJoin(sequence.tokens(), ",");
      os << absl::StrFormat(
          "sample %d (%s): %s\n", i,
          sequence.stop_reason() == v1::STOP_REASON_STOP ? "stop" : "length",
          texts.empty() ? ids : Quoted(texts[i]));
      if (!texts.empty() && show_ids) os << "  ids: " << ids << "\n";
      os << "  logprobs: "
         << absl::StrJoin(sequence.logprobs(), ",",
                          [](std::string* text, double logprob) {
                            absl::StrAppend(text,
                                            absl::StrFormat("%.4f", logprob));
                          })
         << "\n";
    }
  }

  // --tokenizer's tokenizer.json, or none without the flag; what it cannot
  // read is a FlagError naming the flag (exit 2).
  absl::StatusOr<std::optional<TokenizerJson>> LoadTokenizer() const {
    if (tokenizer_dir_.empty()) {
      if (skip_special_tokens_) {
        return FlagError("flag --skip-special-tokens needs --tokenizer");
      }
      return std::nullopt;
    }
    absl::StatusOr<TokenizerJson> tokenizer =
        TokenizerJson::Load(tokenizer_dir_);
    if (!tokenizer.ok()) {
      return FlagError(
          absl::StrCat("flag --tokenizer: ", tokenizer.status().message()));
    }
    return std::move(*tokenizer);
  }

  // The text of `ids`; an id the tokenizer lacks is a FlagError: the
  // tokenizer does not belong to the model.
  absl::StatusOr<std::string> Text(
      const TokenizerJson& tokenizer,
      const google::protobuf::RepeatedField<int32_t>& ids) const {
    absl::StatusOr<std::string> text = tokenizer.Decode(
        absl::MakeConstSpan(ids.data(), ids.size()), skip_special_tokens_);
    if (!text.ok()) {
      return FlagError(absl::StrCat(
          "flag --tokenizer: ", text.status().message(),
          "; is it the tokenizer of model ", model_,
          "? (without --tokenizer, tallyctl sample prints token ids)"));
    }
    return text;
  }

  absl::StatusOr<v1::SampleRequest> Request() const {
    if (model_.empty()) return FlagError("flag --model is required");
    if (prompt_ids_.empty()) return FlagError("flag --prompt-ids is required");
    v1::SampleRequest request;
    request.set_model_id(model_);
    request.set_sampler(sampler_);
    TALLY_ASSIGN_OR_RETURN(std::vector<int32_t> prompt,
                           ParseTokenIds("prompt-ids", prompt_ids_));
    request.add_prompts()->mutable_tokens()->Add(prompt.begin(), prompt.end());
    if (num_samples_ < 1) {
      return FlagValueError("num-samples", std::to_string(num_samples_),
                            "an integer >= 1");
    }
    request.set_num_samples(num_samples_);
    v1::SamplingParams& params = *request.mutable_params();
    if (max_tokens_ < 1) {
      return FlagValueError("max-tokens", std::to_string(max_tokens_),
                            "an integer >= 1");
    }
    params.set_max_tokens(max_tokens_);
    if (temperature_) params.set_temperature(*temperature_);
    if (top_p_) params.set_top_p(*top_p_);
    if (top_k_ != -1) params.set_top_k(top_k_);
    if (!seed_.empty()) {
      uint64_t seed = 0;
      if (!absl::SimpleAtoi(seed_, &seed)) {
        return FlagValueError("seed", seed_, "an integer >= 0");
      }
      params.set_seed(seed);
    }
    if (stop_ids_ == "none") {
      params.mutable_stop();
    } else if (stop_ids_ != "eos") {
      TALLY_ASSIGN_OR_RETURN(std::vector<int32_t> stop,
                             ParseTokenIds("stop-ids", stop_ids_));
      params.mutable_stop()->mutable_token_ids()->Add(stop.begin(), stop.end());
    }
    return request;
  }

  std::string model_;
  std::string prompt_ids_;
  std::string tokenizer_dir_;
  bool skip_special_tokens_ = false;
  bool show_ids_ = false;
  int max_tokens_ = 16;
  std::optional<double> temperature_;
  std::optional<double> top_p_;
  int top_k_ = -1;
  std::string seed_;
  int num_samples_ = 1;
  std::string stop_ids_ = "eos";
  std::string sampler_;
};

// One line per sampler snapshot.
void PrintSamplerInfo(std::ostream& os, const v1::SamplerInfo& info) {
  os << absl::StrFormat("%s: model %s, step %d, %d bytes%s\n", info.path(),
                        info.model_id(), info.step(), info.bytes(),
                        info.is_adapter() ? " (adapter)" : "");
}

class SamplersSaveCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::SaveWeightsForSamplerRequest request;
    request.set_model_id(args[0]);
    request.set_name(args[1]);
    TALLY_ASSIGN_OR_RETURN(v1::SamplerInfo info,
                           client.SaveWeightsForSampler(request));
    return out.Print(info, [&](std::ostream& os) {
      os << "saved ";
      PrintSamplerInfo(os, info);
    });
  }
};

class SamplersListCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("model", &model_, "only this model's (default: every model's)");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>&,
                   Output& out) override {
    v1::ListSamplersRequest request;
    request.set_model_id(model_);
    TALLY_ASSIGN_OR_RETURN(v1::ListSamplersResponse response,
                           client.ListSamplers(request));
    return out.Print(response, [&](std::ostream& os) {
      if (response.samplers().empty()) os << "no sampler snapshots\n";
      for (const v1::SamplerInfo& info : response.samplers()) {
        PrintSamplerInfo(os, info);
      }
    });
  }

 private:
  std::string model_;
};

class SamplersDeleteCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::DeleteSamplerRequest request;
    request.set_model_id(args[0]);
    request.set_name(args[1]);
    TALLY_ASSIGN_OR_RETURN(v1::SamplerInfo info, client.DeleteSampler(request));
    return out.Print(info, [&](std::ostream& os) {
      os << "deleted ";
      PrintSamplerInfo(os, info);
    });
  }
};

class LoadCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("no-optimizer", &no_optimizer_,
              "load weights only; optimizer moments restart from zero");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    TALLY_ASSIGN_OR_RETURN(SeqIds seq_ids, SeqIds::Of(client, args[0]));
    v1::LoadCheckpointRequest request;
    request.set_model_id(args[0]);
    request.set_seq_id(seq_ids.Next());
    request.set_path(args[1]);
    request.set_load_optimizer(!no_optimizer_);
    TALLY_ASSIGN_OR_RETURN(v1::LoadCheckpointResponse response,
                           client.LoadCheckpoint(request));
    return out.Print(response, [&](std::ostream& os) {
      os << absl::StrFormat(
          "loaded %s into model %s (%s): now at step %d\n", args[1], args[0],
          no_optimizer_ ? "weights only" : "weights and optimizer state",
          response.model().step());
      PrintWindow(os, "discarded the pending window",
                  response.discarded_calls(), response.discarded_tokens(),
                  response.discarded_samples());
    });
  }

 private:
  bool no_optimizer_ = false;
};

// "a, b, c", or "none".
template <typename Range, typename Formatter>
std::string ListOr(const Range& items, Formatter format) {
  return items.empty() ? "none" : absl::StrJoin(items, ", ", format);
}

void PrintServerInfo(std::ostream& out, const v1::ServerInfo& info) {
  const v1::ServerInfo::Compute& compute = info.compute();
  const v1::ServerInfo::Mesh& mesh = info.mesh();
  const v1::ServerInfo::Limits& limits = info.limits();
  const v1::ServerInfo::Devices& devices = info.devices();
  out << absl::StrFormat(
      "tally-server %s\n"
      "  compute: BLAS %s (%s), oneDNN %s, %d threads, CUDA %s\n"
      "  device: %s (%s)\n"
      "  mesh: world_size=%d dp_replicate=%d dp_shard=%d cp=%d ep=%d pp=%d "
      "tp=%d zero_stage=%d\n"
      "  model types: %s\n"
      "  dtypes: %s\n"
      "  reductions: %s\n"
      "  losses: %s\n"
      "  features: %s\n"
      "  limits (0: none): max_message_bytes=%d max_tokens_per_call=%d "
      "max_batch_tokens=%d max_memory_bytes=%d max_memory_bytes_per_tenant=%d "
      "max_queued_requests=%d max_queued_requests_per_model=%d "
      "max_queued_requests_per_tenant=%d\n"
      "  authentication: %s\n",
      info.version(), compute.blas(), compute.blas_library(),
      YesNo(compute.onednn()), compute.threads(),
      YesNo(compute.cuda_available()), devices.device(), devices.reason(),
      mesh.world_size(), mesh.dp_replicate(), mesh.dp_shard(), mesh.cp(),
      mesh.ep(), mesh.pp(), mesh.tp(), mesh.zero_stage(),
      ListOr(info.model_types(), absl::StreamFormatter()),
      ListOr(info.dtypes(),
             [](std::string* text, int dtype) {
               absl::StrAppend(text, DTypeLabel(static_cast<v1::DType>(dtype)));
             }),
      ListOr(info.reductions(),
             [](std::string* text, int reduction) {
               absl::StrAppend(
                   text,
                   EnumLabel(v1::LossReduction_Name(
                                 static_cast<v1::LossReduction>(reduction)),
                             "LOSS_REDUCTION_"));
             }),
      ListOr(info.losses(), absl::StreamFormatter()),
      ListOr(info.features(), absl::StreamFormatter()),
      limits.max_message_bytes(), limits.max_tokens_per_call(),
      limits.max_batch_tokens(), limits.max_memory_bytes(),
      limits.max_memory_bytes_per_tenant(), limits.max_queued_requests(),
      limits.max_queued_requests_per_model(),
      limits.max_queued_requests_per_tenant(), YesNo(info.authentication()));
  for (const v1::ServerInfo::Devices::Gpu& gpu : devices.gpus()) {
    out << absl::StrFormat("  GPU %d: %s, compute capability %s, %d bytes\n",
                           gpu.index(), gpu.name(), gpu.compute_capability(),
                           gpu.total_memory_bytes());
  }
  if (devices.gpus().empty() && !devices.no_gpu_reason().empty()) {
    out << "  GPUs: none (" << devices.no_gpu_reason() << ")\n";
  }
}

// "42s", "3m05s", "1h02m": a whole number of seconds, rounded up.
std::string FormatEta(absl::Duration eta) {
  const int64_t seconds =
      absl::ToInt64Seconds(absl::Ceil(eta, absl::Seconds(1)));
  if (seconds >= 3600) {
    return absl::StrFormat("%dh%02dm", seconds / 3600, seconds % 3600 / 60);
  }
  if (seconds >= 60)
    return absl::StrFormat("%dm%02ds", seconds / 60, seconds % 60);
  return absl::StrFormat("%ds", seconds);
}

// "[########............] 12/30"
std::string ProgressBar(int64_t done, int64_t total) {
  constexpr int64_t kWidth = 20;
  const int64_t filled = total > 0 ? done * kWidth / total : kWidth;
  const int digits = static_cast<int>(absl::StrCat(total).size());
  return absl::StrFormat("[%s%s] %*d/%d", std::string(filled, '#'),
                         std::string(kWidth - filled, '.'), digits, done,
                         total);
}

class TrainCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("text", &text_, "training text file");
    flags.Add("steps", &steps_, "optimizer steps to take");
    flags.Add("calls-per-step", &batcher_options_.calls_per_step,
              "ForwardBackward calls accumulated per step");
    flags.Add("max-samples-per-call", &batcher_options_.max_samples_per_call,
              "most samples in one call (counts vary from 1 up to this)");
    flags.Add("max-len", &max_len_,
              "longest sample in tokens; 0: min(128, the model's "
              "max_position_embeddings)");
    flags.Add("zero-weight-probability",
              &batcher_options_.zero_weight_probability,
              "chance that an unmasked token gets weight 0");
    flags.Add("lr", &lr_, "learning rate (default: the model's)");
    flags.Add("max-grad-norm", &max_grad_norm_,
              "clip gradients to this norm, 0 disables (default: the "
              "model's)");
    flags.Add("seed", &batcher_options_.seed, "data sampling seed");
    flags.Add("metrics-url", &metrics_url_,
              "the server's Prometheus endpoint, printed at the end");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    const std::string& model_id = args[0];
    if (steps_ < 1)
      return FlagValueError("steps", absl::StrCat(steps_), ">= 1");
    if (max_len_ != 0 && max_len_ < 2) {
      return FlagValueError("max-len", absl::StrCat(max_len_),
                            "0 or >= 2 (BOS + one byte)");
    }
    v1::GetModelRequest get;
    get.set_model_id(model_id);
    TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.GetModel(get));
    TALLY_ASSIGN_OR_RETURN(TextBatcher batcher, MakeBatcher(info));
    SeqIds seq_ids = SeqIds::From(info);

    if (!out.json()) {
      std::cout << absl::StrFormat(
          "training model %s (%d parameters, step %d) on %s (%d bytes): "
          "%d steps x %d calls, samples of %d..%d tokens\n",
          model_id, info.num_parameters(), info.step(), text_,
          batcher.text().size(), steps_, batcher_options_.calls_per_step,
          batcher_options_.min_len, batcher_options_.max_len);
    }
    double first_loss = 0.0;
    double last_loss = 0.0;
    int64_t model_step = info.step();
    const absl::Time started = absl::Now();
    for (int64_t step = 1; step <= steps_; ++step) {
      const absl::Time start = absl::Now();
      TALLY_ASSIGN_OR_RETURN(
          const StepResult result,
          TrainStep(client, model_id, step, batcher.NextStep(), seq_ids));
      const absl::Time now = absl::Now();
      // The steps left at the mean pace so far.
      const absl::Duration eta = (now - started) / step * (steps_ - step);
      PrintStep(out, step, result, now - start, eta);
      model_step = result.optim.step();
      if (step == 1) first_loss = result.loss();
      last_loss = result.loss();
    }
    if (out.json()) return absl::OkStatus();
    std::cout << absl::StrFormat(
        "loss %.4f -> %.4f over %d steps (%+.1f%%); model %s is at step %d\n",
        first_loss, last_loss, steps_,
        100.0 * (last_loss - first_loss) / first_loss, model_id, model_step);
    if (!metrics_url_.empty()) std::cout << "metrics: " << metrics_url_ << "\n";
    return absl::OkStatus();
  }

 private:
  struct StepResult {
    double loss_sum = 0.0;
    int64_t valid_tokens = 0;
    v1::OptimStepResponse optim;

    // Mean loss over the step's valid tokens.
    double loss() const {
      return valid_tokens > 0 ? loss_sum / valid_tokens : std::nan("");
    }
  };

  // One optimizer step: the ForwardBackward `calls`, then OptimStep.
  absl::StatusOr<StepResult> TrainStep(
      TrainerClient& client, const std::string& model_id, int64_t step,
      std::vector<std::vector<v1::Sample>> calls, SeqIds& seq_ids) const {
    StepResult result;
    for (size_t c = 0; c < calls.size(); ++c) {
      v1::ForwardBackwardRequest request;
      request.set_model_id(model_id);
      request.set_seq_id(seq_ids.Next());
      request.set_reduction(v1::LOSS_REDUCTION_TOKEN_MEAN);
      for (v1::Sample& sample : calls[c]) {
        *request.add_samples() = std::move(sample);
      }
      absl::StatusOr<v1::ForwardBackwardResponse> response =
          client.ForwardBackward(request);
      if (!response.ok()) {
        return Annotate(
            response.status(),
            absl::StrFormat("step %d, ForwardBackward call %d", step, c + 1));
      }
      result.loss_sum += response->loss_sum();
      result.valid_tokens += response->valid_tokens();
    }
    v1::OptimStepRequest optim;
    optim.set_model_id(model_id);
    optim.set_seq_id(seq_ids.Next());
    if (lr_.has_value()) optim.mutable_adam()->set_learning_rate(*lr_);
    if (max_grad_norm_.has_value()) optim.set_max_grad_norm(*max_grad_norm_);
    absl::StatusOr<v1::OptimStepResponse> stepped = client.OptimStep(optim);
    if (!stepped.ok()) {
      return Annotate(stepped.status(),
                      absl::StrFormat("step %d, OptimStep", step));
    }
    result.optim = *std::move(stepped);
    return result;
  }

  // One line per step: a progress bar and the step's figures, or a JSON
  // object of them; tokens/s counts the step's valid tokens.
  void PrintStep(Output& out, int64_t step, const StepResult& result,
                 absl::Duration took, absl::Duration eta) const {
    const double seconds = absl::ToDoubleSeconds(took);
    const double tokens_per_second =
        seconds > 0 ? static_cast<double>(result.valid_tokens) / seconds : 0.0;
    const v1::OptimStepResponse& optim = result.optim;
    const nlohmann::ordered_json record = {
        {"step", step},
        {"steps", steps_},
        {"model_step", optim.step()},
        {"loss", result.loss()},
        {"valid_tokens", result.valid_tokens},
        {"grad_norm", optim.grad_norm()},
        {"clip_coef", optim.clip_coef()},
        {"seconds", seconds},
        {"tokens_per_second", tokens_per_second},
        {"eta_seconds", absl::ToDoubleSeconds(eta)},
        {"skipped", optim.skipped()},
        {"skip_reason", optim.skip_reason()}};
    out.Print(
        record,
        absl::StrFormat(
            "%s  loss %.4f  tokens %5d  grad_norm %8.4f  clip %.3f  "
            "time %.2fs  %.0f tok/s  eta %s%s\n",
            ProgressBar(step, steps_), result.loss(), result.valid_tokens,
            optim.grad_norm(), optim.clip_coef(), seconds, tokens_per_second,
            FormatEta(eta),
            optim.skipped() ? absl::StrCat("  SKIPPED: ", optim.skip_reason())
                            : ""));
  }

  // Sample lengths must fit the model's context and ids its vocabulary.
  absl::StatusOr<TextBatcher> MakeBatcher(const v1::ModelInfo& info) {
    constexpr int kPreferredMaxLen = 128;
    constexpr int kPreferredMinLen = 16;
    constexpr int kHfDefaultContext = 2048;  // what a 0 in the config means
    const int context = info.config().max_position_embeddings() > 0
                            ? info.config().max_position_embeddings()
                            : kHfDefaultContext;
    if (info.config().vocab_size() <= byte_vocab::kBos) {
      return absl::FailedPreconditionError(absl::StrCat(
          "model ", info.model_id(), " has vocab_size ",
          info.config().vocab_size(), "; byte-level training needs >= ",
          byte_vocab::kBos + 1, " (256 bytes + BOS)"));
    }
    if (max_len_ > context) {
      return FlagError(absl::StrCat("flag --max-len ", max_len_,
                                    " exceeds model ", info.model_id(),
                                    "'s max_position_embeddings ", context));
    }
    batcher_options_.max_len =
        max_len_ > 0 ? max_len_ : std::min(kPreferredMaxLen, context);
    batcher_options_.min_len =
        std::min(kPreferredMinLen, batcher_options_.max_len);
    absl::StatusOr<TextBatcher> batcher =
        TextBatcher::FromFile(text_, batcher_options_);
    if (batcher.status().code() != absl::StatusCode::kInvalidArgument) {
      return batcher;  // a batcher, or a file error
    }
    // The options it refuses are this command's flags.
    return FlagError(absl::StrReplaceAll(
        batcher.status().message(),
        {{"options.calls_per_step", "flag --calls-per-step"},
         {"options.max_samples_per_call", "flag --max-samples-per-call"},
         {"options.zero_weight_probability", "flag --zero-weight-probability"},
         {"options.max_len", "flag --max-len"}}));
  }

  // Flags bind the counts, the zero-weight probability and the seed here;
  // MakeBatcher fills in the lengths.
  TextBatcherOptions batcher_options_;
  std::string text_ = DefaultCorpusPath();
  int64_t steps_ = 30;
  int max_len_ = 0;
  std::optional<double> lr_;
  std::optional<double> max_grad_norm_;
  std::string metrics_url_;
};

class ServerInfoCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    TALLY_ASSIGN_OR_RETURN(v1::ServerInfo info, client.GetServerInfo());
    return out.Print(info,
                     [&](std::ostream& os) { PrintServerInfo(os, info); });
  }
};

// How to reach and authenticate to the server: every command's flags.
class ConnectionFlags {
 public:
  void Add(FlagParser& flags) {
    flags.Add("target", &options_.target, "server address host:port");
    flags.Add("deadline-seconds", &deadline_seconds_, "deadline of each call");
    flags.Add("token", &token_,
              "bearer token of --auth-tokens-file (default: $TALLY_TOKEN)");
    flags.Add("tls", &tls_, "connect over TLS (implied by the flags below)");
    flags.Add("ca-cert", &ca_cert_,
              "PEM file of the server's CA (default: the system roots)");
    flags.Add("client-cert", &client_cert_,
              "PEM certificate chain of this client, for mutual TLS");
    flags.Add("client-key", &client_key_, "PEM private key of --client-cert");
    flags.Add("tls-server-name", &server_name_,
              "name the server's certificate must carry (default: the "
              "--target host)");
  }

  // The client options the flags describe, the PEM files read.
  absl::StatusOr<TrainerClientOptions> Options() const {
    TrainerClientOptions options = options_;
    options.deadline = absl::Seconds(deadline_seconds_);
    options.token = token_;
    if (options.token.empty()) {
      const char* env = std::getenv("TALLY_TOKEN");
      if (env != nullptr) options.token = env;
    }
    if (!(deadline_seconds_ > 0)) {
      return FlagValueError("deadline-seconds", absl::StrCat(deadline_seconds_),
                            "> 0");
    }
    if (client_cert_.empty() != client_key_.empty()) {
      return FlagError("flags --client-cert and --client-key go together");
    }
    if (!tls_ && ca_cert_.empty() && client_cert_.empty() &&
        server_name_.empty()) {
      return options;
    }
    ClientTlsOptions& tls = options.tls.emplace();
    tls.server_name = server_name_;
    for (auto [path, flag, pem] :
         {std::tuple{&ca_cert_, "--ca-cert", &tls.ca_pem},
          {&client_cert_, "--client-cert", &tls.cert_chain_pem},
          {&client_key_, "--client-key", &tls.private_key_pem}}) {
      if (path->empty()) continue;
      TALLY_ASSIGN_OR_RETURN(*pem, ReadFileText(*path, flag));
    }
    return options;
  }

 private:
  TrainerClientOptions options_;
  double deadline_seconds_ = absl::ToDoubleSeconds(options_.deadline);
  std::string token_;
  bool tls_ = false;
  std::string ca_cert_, client_cert_, client_key_, server_name_;
};

// Artifacts: tallyctl checkpoints list|delete|download.

std::string ArtifactKindName(v1::ArtifactKind kind) {
  switch (kind) {
    case v1::ARTIFACT_KIND_STATE:
      return "state";
    case v1::ARTIFACT_KIND_EXPORT:
      return "export";
    case v1::ARTIFACT_KIND_SAMPLER_SNAPSHOT:
      return "sampler";
    default:
      return "unknown";
  }
}

std::string UnixTimeText(int64_t seconds) {
  if (seconds == 0) return "-";
  return absl::FormatTime("%Y-%m-%dT%H:%M:%SZ", absl::FromUnixSeconds(seconds),
                          absl::UTCTimeZone());
}

class CheckpointsListCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("model", &model_, "only this model's artifacts (empty: all)");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::ListCheckpointsRequest request;
    request.set_model_id(model_);
    TALLY_ASSIGN_OR_RETURN(v1::ListCheckpointsResponse response,
                           client.ListCheckpoints(request));
    return out.Print(response, [&](std::ostream& os) {
      if (response.artifacts().empty()) os << "no checkpoints\n";
      for (const v1::Artifact& a : response.artifacts()) {
        os << absl::StrFormat(
            "%s  %s  model %s  step %d  %d bytes  created %s  expires %s\n",
            a.handle(), ArtifactKindName(a.kind()),
            a.model_id().empty() ? "-" : a.model_id(), a.step(), a.size_bytes(),
            UnixTimeText(a.created_unix_seconds()),
            UnixTimeText(a.expires_unix_seconds()));
      }
    });
  }

 private:
  std::string model_;
};

class CheckpointsDeleteCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    v1::DeleteCheckpointRequest request;
    request.set_handle(args[0]);
    TALLY_ASSIGN_OR_RETURN(v1::DeleteCheckpointResponse response,
                           client.DeleteCheckpoint(request));
    return out.Print(response, [&](std::ostream& os) {
      os << "deleted " << response.deleted().handle() << " ("
         << response.deleted().size_bytes() << " bytes)\n";
    });
  }
};

class CheckpointsDownloadCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("quiet", &quiet_, "no progress on stderr");
  }

  absl::Status Run(TrainerClient& client, const std::vector<std::string>& args,
                   Output& out) override {
    std::function<void(uint64_t, uint64_t)> progress;
    if (!quiet_) {
      progress = [](uint64_t done, uint64_t total) {
        std::cerr << absl::StrFormat("\r%d / %d bytes", done, total)
                  << (done == total ? "\n" : "") << std::flush;
      };
    }
    TALLY_ASSIGN_OR_RETURN(ArtifactManifest manifest,
                           client.DownloadArtifact(args[0], args[1], progress));
    uint64_t bytes = 0;
    nlohmann::ordered_json files = nlohmann::ordered_json::array();
    for (const v1::ArtifactFile& file : manifest) {
      bytes += file.size_bytes();
      files.push_back({{"path", file.path()},
                       {"size_bytes", file.size_bytes()},
                       {"sha256", file.sha256()}});
    }
    out.Print({{"handle", args[0]},
               {"dir", args[1]},
               {"bytes", bytes},
               {"files", files}},
              absl::StrFormat("downloaded %s to %s (%d files, %d bytes, "
                              "checksums verified)\n",
                              args[0], args[1], manifest.size(), bytes));
    return absl::OkStatus();
  }

 private:
  bool quiet_ = false;
};

struct CommandSpec {
  std::string name;
  std::vector<std::string> positional;
  std::string summary;  // one line, for the command list
  std::string description;
  std::function<std::unique_ptr<Command>()> make;
};

const std::vector<CommandSpec>& Commands() {
  static const auto* commands = new std::vector<CommandSpec>{
      {"create",
       {},
       "Creates a model.",
       "Creates a model. tallyctl sends no architecture config, so the model "
       "is the server's embedded byte-level demo model, or the one in "
       "--init-checkpoint. With --lora-rank it is a LoRA adapter over that "
       "model, frozen and shared by every adapter of the same base.",
       [] { return std::make_unique<CreateCommand>(); }},
      {"server-info",
       {},
       "Shows what the server is and accepts.",
       "Shows the server's version, compute (BLAS, threads, device, GPUs), "
       "mesh, the model types, dtypes, losses and features it supports, its "
       "limits and whether it requires a token (GetServerInfo).",
       [] { return std::make_unique<ServerInfoCommand>(); }},
      {"list",
       {},
       "Lists the models.",
       "Lists the server's models.",
       [] { return std::make_unique<ListCommand>(); }},
      {"info",
       {"MODEL"},
       "Shows one model.",
       "Shows a model's config, step, optimizer defaults and pending window.",
       [] { return std::make_unique<InfoCommand>(); }},
      {"delete",
       {"MODEL"},
       "Deletes a model.",
       "Deletes a model.",
       [] { return std::make_unique<DeleteCommand>(); }},
      {"save",
       {"MODEL", "PATH"},
       "Saves a checkpoint.",
       "Saves a checkpoint of MODEL into the server-side directory PATH.",
       [] { return std::make_unique<SaveCommand>(); }},
      {"abort",
       {"MODEL"},
       "Discards the pending window.",
       "Discards the pending accumulation window of MODEL (its "
       "ForwardBackward calls since the last OptimStep), e.g. after a "
       "client died mid-window.",
       [] { return std::make_unique<AbortCommand>(); }},
      {"export",
       {"MODEL", "PATH"},
       "Exports the weights for inference.",
       "Writes the weights of MODEL into the server-side directory PATH as "
       "an HF model directory that transformers and vLLM load (config.json, "
       "safetensors, and the tokenizer files of the model's "
       "init_checkpoint); a LoRA model's adapter as PEFT's "
       "adapter_config.json and adapter_model.safetensors, or with --merge "
       "merged into its base.",
       [] { return std::make_unique<ExportCommand>(); }},
      {"sample",
       {},
       "Samples completions of a prompt.",
       "Completes the prompt --prompt-ids with --model's weights after its "
       "last OptimStep (Sample; a pending window is neither used nor "
       "changed), or with its sampler snapshot --sampler, and prints each "
       "sequence's token ids, its stop reason and each token's "
       "log-probability under the model before temperature, top-k and "
       "top-p. With --tokenizer DIR (a local copy of the model's "
       "directory) the prompt and each sequence print as text, decoded "
       "through DIR/tokenizer.json (ByteLevel, Metaspace and SentencePiece "
       "byte-fallback decoders); a tokenizer.json it cannot read, or an id "
       "it has no token for, exits 2. The prompt is always token ids.",
       [] { return std::make_unique<SampleCommand>(); }},
      {"samplers save",
       {"MODEL", "NAME"},
       "Freezes the weights as a sampler snapshot.",
       "Freezes MODEL's weights after its last OptimStep as the sampler "
       "snapshot NAME (SaveWeightsForSampler; a LoRA model's adapter "
       "alone), which 'tallyctl sample --sampler NAME' reads whatever later "
       "steps do. It holds server memory until deleted.",
       [] { return std::make_unique<SamplersSaveCommand>(); }},
      {"samplers list",
       {},
       "Lists the sampler snapshots.",
       "Lists the sampler snapshots of every model, or of --model.",
       [] { return std::make_unique<SamplersListCommand>(); }},
      {"samplers delete",
       {"MODEL", "NAME"},
       "Deletes a sampler snapshot.",
       "Deletes MODEL's sampler snapshot NAME, freeing its memory.",
       [] { return std::make_unique<SamplersDeleteCommand>(); }},
      {"load",
       {"MODEL", "PATH"},
       "Loads a checkpoint.",
       "Loads the server-side checkpoint PATH into MODEL, discarding its "
       "pending window.",
       [] { return std::make_unique<LoadCommand>(); }},
      {"train",
       {"MODEL"},
       "Trains a model on a text file.",
       "Trains MODEL on next-byte prediction over a text file (default: the "
       "bundled public-domain corpus). Each step is --calls-per-step "
       "ForwardBackward calls with uneven sample counts and lengths "
       "(TOKEN_MEAN, a masked prompt prefix per sample) and one OptimStep; "
       "one line is printed per step: mean loss over the step's valid "
       "tokens, valid tokens, pre-clip gradient norm, clip coefficient, "
       "time, valid tokens per second and the estimated time left (the mean "
       "step time so far times the steps left); with --output json one "
       "object per step.",
       [] { return std::make_unique<TrainCommand>(); }},
      {"checkpoints list",
       {},
       "Lists the saved checkpoints and exports.",
       "Lists your checkpoints and weight exports under the server's "
       "--checkpoint-root (ListCheckpoints): handle, kind (state or "
       "export), model, step, size, created and expiry (ttl_seconds).",
       [] { return std::make_unique<CheckpointsListCommand>(); }},
      {"checkpoints delete",
       {"HANDLE"},
       "Deletes a checkpoint or export.",
       "Deletes the checkpoint or export HANDLE (tally://...) on the "
       "server.",
       [] { return std::make_unique<CheckpointsDeleteCommand>(); }},
      {"checkpoints download",
       {"HANDLE", "DIR"},
       "Downloads a checkpoint or export.",
       "Downloads the files of HANDLE (tally://...) into the local "
       "directory DIR, resuming a partial download found there, and "
       "verifies every file's SHA-256.",
       [] { return std::make_unique<CheckpointsDownloadCommand>(); }},
  };
  return *commands;
}

std::string Overview() {
  std::string text =
      "usage: tallyctl COMMAND [ARGS] [flags]\n\n"
      "Command-line client of a tally training server.\n\ncommands:\n";
  size_t width = 0;
  for (const CommandSpec& spec : Commands()) {
    width = std::max(width, spec.name.size());
  }
  for (const CommandSpec& spec : Commands()) {
    absl::StrAppend(
        &text, absl::StrFormat("  %-*s  %s\n", width, spec.name, spec.summary));
  }
  absl::StrAppend(&text,
                  "\nRun 'tallyctl COMMAND --help' for a command's flags, "
                  "'tallyctl --version' for the version.\n");
  return text;
}

int Main(std::vector<std::string> args) {
  if (args.empty()) {
    std::cerr << Overview();
    return kExitUsage;
  }
  if (args[0] == "--version") {
    std::cout << "tallyctl " << TALLY_VERSION << "\n";
    return 0;
  }
  if (args[0] == "help" || args[0] == "--help" || args[0] == "-h") {
    if (args.size() == 1) {
      std::cout << Overview();
      return 0;
    }
    // "tallyctl help train" == "tallyctl train --help" (and so for a
    // two-word command).
    args.erase(args.begin());
    args.push_back("--help");
  }
  // Two-word commands ("checkpoints list") as one name.
  if (args.size() > 1 &&
      std::any_of(Commands().begin(), Commands().end(),
                  [&](const CommandSpec& s) {
                    return s.name == absl::StrCat(args[0], " ", args[1]);
                  })) {
    args[1] = absl::StrCat(args[0], " ", args[1]);
    args.erase(args.begin());
  }
  const auto spec =
      std::find_if(Commands().begin(), Commands().end(),
                   [&](const CommandSpec& s) { return s.name == args[0]; });
  if (spec == Commands().end()) {
    std::cerr << "tallyctl: unknown command '" << args[0] << "'\n\n"
              << Overview();
    return kExitUsage;
  }

  ConnectionFlags connection;
  std::string output = "text";
  FlagParser flags(absl::StrCat("tallyctl ", spec->name), spec->positional,
                   spec->description);
  connection.Add(flags);
  flags.Add("output", &output,
            "text, or json: each result as one line of JSON (protobuf's JSON "
            "mapping of the response, proto field names)");
  std::unique_ptr<Command> command = spec->make();
  command->AddFlags(flags);

  absl::StatusOr<std::vector<std::string>> positional =
      flags.Parse({args.begin() + 1, args.end()});
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return 0;
  }
  auto usage_error = [&](const absl::Status& status) {
    std::cerr << "tallyctl " << spec->name << ": " << status.message() << "\n"
              << flags.UsageLine() << "\nRun 'tallyctl " << spec->name
              << " --help' for details.\n";
    return kExitUsage;
  };
  if (!positional.ok()) return usage_error(positional.status());
  const absl::StatusOr<Output::Format> format = Output::FormatNamed(output);
  if (!format.ok()) return usage_error(format.status());
  absl::StatusOr<TrainerClientOptions> options = connection.Options();
  if (!options.ok()) return usage_error(options.status());

  Output out(*format, std::cout);
  TrainerClient client(*options);
  const absl::Status status = command->Run(client, *positional, out);
  if (IsFlagError(status)) return usage_error(status);
  if (!status.ok()) {
    std::cerr << "tallyctl " << spec->name << ": " << status.ToString() << "\n";
    return kExitFailure;
  }
  return 0;
}

}  // namespace
}  // namespace tally

int main(int argc, char** argv) {
  return tally::Main(std::vector<std::string>(argv + 1, argv + argc));
}
