// tallyctl: command-line client of a tally server. Manages models and runs a
// small next-byte-prediction training loop on a text file.
//
//   tallyctl create --model-id demo --seed 1
//   tallyctl train demo --steps 30 --calls-per-step 4
//   tallyctl save demo /tmp/ckpt && tallyctl list
//   tallyctl export demo /tmp/demo-hf --dtype bfloat16
//   tallyctl list --target tally:50051 --ca-cert ca.pem --token "$TOKEN"
//
// The commands that change a model (train, load, abort) send its next
// seq_ids as the server reports them, so a retried call is answered from the
// server's cache and never applied twice; do not run them against a model a
// sequenced client is training (they would take its seq_ids). save and
// export change nothing and stay unsequenced.
//
// Exit status: 0 on success, 1 when the server or a file on it fails (the
// gRPC code and message go to stderr), 2 on a command-line error (an
// unreadable --ca-cert, --client-cert or --client-key included).
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/file_text.h"
#include "base/status.h"
#include "client/command_line.h"
#include "client/text_batcher.h"
#include "client/trainer_client.h"

namespace tally {
namespace {

constexpr int kExitFailure = 1;
constexpr int kExitUsage = 2;

// Prefixes a failure with where it happened, keeping its code.
absl::Status Annotate(const absl::Status& status, const std::string& where) {
  return absl::Status(status.code(),
                      absl::StrCat(where, ": ", status.message()));
}

// "DTYPE_FLOAT32" -> "float32".
std::string EnumLabel(const std::string& name, absl::string_view prefix) {
  std::string label(absl::StripPrefix(name, prefix));
  std::transform(label.begin(), label.end(), label.begin(),
                 [](unsigned char c) { return std::tolower(c); });
  return label;
}

std::string DTypeLabel(v1::DType dtype) {
  return EnumLabel(v1::DType_Name(dtype), "DTYPE_");
}
std::string OptimizerLabel(v1::Optimizer optimizer) {
  return EnumLabel(v1::Optimizer_Name(optimizer), "OPTIMIZER_");
}

// The dtype of `allowed` whose label is --dtype's `label`.
absl::StatusOr<v1::DType> ParseDTypeFlag(
    const std::string& label, const std::vector<v1::DType>& allowed) {
  std::string expected;
  for (size_t i = 0; i < allowed.size(); ++i) {
    if (DTypeLabel(allowed[i]) == label) return allowed[i];
    const char* separator = i == 0                    ? ""
                            : i + 1 == allowed.size() ? " or "
                                                      : ", ";
    absl::StrAppend(&expected, separator, DTypeLabel(allowed[i]));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("flag --dtype: '", label, "' is not ", expected));
}

void PrintModelInfo(const v1::ModelInfo& info) {
  const v1::ModelConfig& c = info.config();
  const v1::AdamParams& adam = info.default_adam();
  std::cout << absl::StrFormat(
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
    std::cout << absl::StrFormat(
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
void PrintWindow(const std::string& what, int64_t calls, int64_t tokens,
                 int64_t samples) {
  if (calls == 0) return;
  std::cout << absl::StrFormat("%s: %d calls, %d tokens, %d samples\n", what,
                               calls, tokens, samples);
}

// One subcommand: binds its flags, then runs against a connected client.
class Command {
 public:
  virtual ~Command() = default;
  virtual void AddFlags(FlagParser& flags) {}
  virtual absl::Status Run(TrainerClient& client,
                           const std::vector<std::string>& args) = 0;
};

class CreateCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("model-id", &model_id_, "model id (empty: the server picks one)");
    flags.Add("seed", &seed_, "parameter initialization seed");
    flags.Add("dtype", &dtype_, "parameter dtype: float32 or float64");
    flags.Add("optimizer", &optimizer_, "adamw or sgd");
    flags.Add("lr", &lr_, "default learning rate (default: the server's)");
    flags.Add("max-grad-norm", &max_grad_norm_,
              "default gradient clipping norm (0: no clipping)");
    flags.Add("init-checkpoint", &init_checkpoint_,
              "tally checkpoint or HF Llama directory to start from (with "
              "--lora-rank: the shared, frozen base)");
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

  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    v1::CreateModelRequest request;
    request.set_model_id(model_id_);
    request.set_seed(seed_);
    TALLY_ASSIGN_OR_RETURN(
        v1::DType dtype,
        ParseDTypeFlag(dtype_, {v1::DTYPE_FLOAT32, v1::DTYPE_FLOAT64}));
    request.set_dtype(dtype);
    if (optimizer_ == "adamw") {
      request.set_optimizer(v1::OPTIMIZER_ADAMW);
    } else if (optimizer_ == "sgd") {
      request.set_optimizer(v1::OPTIMIZER_SGD);
    } else {
      return absl::InvalidArgumentError(absl::StrCat(
          "flag --optimizer: '", optimizer_, "' is not adamw or sgd"));
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
      return absl::InvalidArgumentError(
          "flags --lora-alpha, --lora-targets and --lora-init-adapter need "
          "--lora-rank");
    }
    TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.CreateModel(request));
    std::cout << "created ";
    PrintModelInfo(info);
    return absl::OkStatus();
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
        return absl::InvalidArgumentError(absl::StrCat(
            "flag --lora-targets: '", part, "' is not attn, mlp or unembed"));
      }
    }
    lora.set_init_adapter(lora_init_adapter_);
    return absl::OkStatus();
  }
};

class ListCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    TALLY_ASSIGN_OR_RETURN(v1::ListModelsResponse response,
                           client.ListAllModels());
    if (response.models().empty()) {
      std::cout << "no models\n";
      return absl::OkStatus();
    }
    constexpr char kRow[] = "%-20s %8s %12s %-8s %-9s %s\n";
    std::cout << absl::StrFormat(kRow, "MODEL", "STEP", "PARAMETERS", "DTYPE",
                                 "OPTIMIZER", "PENDING CALLS");
    for (const v1::ModelInfo& info : response.models()) {
      std::cout << absl::StrFormat(
          kRow, info.model_id(), absl::StrCat(info.step()),
          absl::StrCat(info.num_parameters()), DTypeLabel(info.dtype()),
          OptimizerLabel(info.optimizer()),
          absl::StrCat(info.accumulated_calls()));
    }
    return absl::OkStatus();
  }
};

class InfoCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    v1::GetModelRequest request;
    request.set_model_id(args[0]);
    TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.GetModel(request));
    PrintModelInfo(info);
    return absl::OkStatus();
  }
};

class DeleteCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    v1::DeleteModelRequest request;
    request.set_model_id(args[0]);
    TALLY_ASSIGN_OR_RETURN(v1::DeleteModelResponse response,
                           client.DeleteModel(request));
    std::cout << absl::StrFormat("deleted model %s (at step %d)\n",
                                 response.model().model_id(),
                                 response.model().step());
    return absl::OkStatus();
  }
};

class SaveCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("allow-pending", &allow_pending_,
              "save even with a pending accumulation window (whose gradients "
              "the checkpoint does not hold; the model keeps them)");
  }

  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    v1::SaveCheckpointRequest request;
    request.set_model_id(args[0]);
    request.set_path(args[1]);
    request.set_allow_pending(allow_pending_);
    TALLY_ASSIGN_OR_RETURN(v1::SaveCheckpointResponse response,
                           client.SaveCheckpoint(request));
    std::cout << absl::StrFormat("saved model %s at step %d to %s (%d bytes)\n",
                                 args[0], response.step(), response.path(),
                                 response.bytes_written());
    PrintWindow("without the pending window", response.unsaved_calls(),
                response.unsaved_tokens(), response.unsaved_samples());
    return absl::OkStatus();
  }

 private:
  bool allow_pending_ = false;
};

class AbortCommand : public Command {
 public:
  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    TALLY_ASSIGN_OR_RETURN(SeqIds seq_ids, SeqIds::Of(client, args[0]));
    v1::AbortAccumulationRequest request;
    request.set_model_id(args[0]);
    request.set_seq_id(seq_ids.Next());
    TALLY_ASSIGN_OR_RETURN(v1::AbortAccumulationResponse response,
                           client.AbortAccumulation(request));
    if (response.discarded_calls() == 0) {
      std::cout << "model " << args[0] << " had no pending window\n";
    }
    PrintWindow(absl::StrCat("discarded the pending window of model ", args[0]),
                response.discarded_calls(), response.discarded_tokens(),
                response.discarded_samples());
    return absl::OkStatus();
  }
};

class ExportCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("dtype", &dtype_,
              "stored dtype: float32, float64, bfloat16 or float16 (empty: "
              "the model's)");
    flags.Add("merge", &merge_,
              "a LoRA model: the base with the adapter merged in, as a full "
              "HF directory (default: the adapter in PEFT's format)");
  }

  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
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
    std::cout << absl::StrFormat(
        "exported the weights of model %s to %s (%d files, %d bytes)\n",
        args[0], response.path(), response.files_size(),
        response.bytes_written());
    return absl::OkStatus();
  }

 private:
  std::string dtype_;
  bool merge_ = false;
};

class LoadCommand : public Command {
 public:
  void AddFlags(FlagParser& flags) override {
    flags.Add("no-optimizer", &no_optimizer_,
              "load weights only; optimizer moments restart from zero");
  }

  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    TALLY_ASSIGN_OR_RETURN(SeqIds seq_ids, SeqIds::Of(client, args[0]));
    v1::LoadCheckpointRequest request;
    request.set_model_id(args[0]);
    request.set_seq_id(seq_ids.Next());
    request.set_path(args[1]);
    request.set_load_optimizer(!no_optimizer_);
    TALLY_ASSIGN_OR_RETURN(v1::LoadCheckpointResponse response,
                           client.LoadCheckpoint(request));
    std::cout << absl::StrFormat(
        "loaded %s into model %s (%s): now at step %d\n", args[1], args[0],
        no_optimizer_ ? "weights only" : "weights and optimizer state",
        response.model().step());
    PrintWindow("discarded the pending window", response.discarded_calls(),
                response.discarded_tokens(), response.discarded_samples());
    return absl::OkStatus();
  }

 private:
  bool no_optimizer_ = false;
};

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

  absl::Status Run(TrainerClient& client,
                   const std::vector<std::string>& args) override {
    const std::string& model_id = args[0];
    if (steps_ < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("flag --steps must be >= 1, got ", steps_));
    }
    v1::GetModelRequest get;
    get.set_model_id(model_id);
    TALLY_ASSIGN_OR_RETURN(v1::ModelInfo info, client.GetModel(get));
    TALLY_ASSIGN_OR_RETURN(TextBatcher batcher, MakeBatcher(info));
    SeqIds seq_ids = SeqIds::From(info);

    std::cout << absl::StrFormat(
        "training model %s (%d parameters, step %d) on %s (%d bytes): "
        "%d steps x %d calls, samples of %d..%d tokens\n",
        model_id, info.num_parameters(), info.step(), text_,
        batcher.text().size(), steps_, batcher_options_.calls_per_step,
        batcher_options_.min_len, batcher_options_.max_len);

    double first_loss = 0.0;
    double last_loss = 0.0;
    int64_t model_step = info.step();
    for (int64_t step = 1; step <= steps_; ++step) {
      const absl::Time start = absl::Now();
      double loss_sum = 0.0;
      int64_t valid_tokens = 0;
      std::vector<std::vector<v1::Sample>> calls = batcher.NextStep();
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
        loss_sum += response->loss_sum();
        valid_tokens += response->valid_tokens();
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
      model_step = stepped->step();
      const double loss =
          valid_tokens > 0 ? loss_sum / valid_tokens : std::nan("");
      if (step == 1) first_loss = loss;
      last_loss = loss;
      std::cout << absl::StrFormat(
          "%s  loss %.4f  tokens %5d  grad_norm %8.4f  clip %.3f  "
          "time %.2fs%s\n",
          ProgressBar(step, steps_), loss, valid_tokens, stepped->grad_norm(),
          stepped->clip_coef(), absl::ToDoubleSeconds(absl::Now() - start),
          stepped->skipped()
              ? absl::StrCat("  SKIPPED: ", stepped->skip_reason())
              : "");
      std::cout.flush();
    }
    std::cout << absl::StrFormat(
        "loss %.4f -> %.4f over %d steps (%+.1f%%); model %s is at step %d\n",
        first_loss, last_loss, steps_,
        100.0 * (last_loss - first_loss) / first_loss, model_id, model_step);
    if (!metrics_url_.empty()) std::cout << "metrics: " << metrics_url_ << "\n";
    return absl::OkStatus();
  }

 private:
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
    if (max_len_ != 0 && max_len_ < 2) {
      return absl::InvalidArgumentError(absl::StrCat(
          "flag --max-len must be >= 2 (BOS + one byte), got ", max_len_));
    }
    if (max_len_ > context) {
      return absl::InvalidArgumentError(absl::StrCat(
          "flag --max-len ", max_len_, " exceeds model ", info.model_id(),
          "'s max_position_embeddings ", context));
    }
    batcher_options_.max_len =
        max_len_ > 0 ? max_len_ : std::min(kPreferredMaxLen, context);
    batcher_options_.min_len =
        std::min(kPreferredMinLen, batcher_options_.max_len);
    return TextBatcher::FromFile(text_, batcher_options_);
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
    if (client_cert_.empty() != client_key_.empty()) {
      return absl::InvalidArgumentError(
          "flags --client-cert and --client-key go together");
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
       "tokens, valid tokens, pre-clip gradient norm, clip coefficient and "
       "time.",
       [] { return std::make_unique<TrainCommand>(); }},
  };
  return *commands;
}

std::string Overview() {
  std::string text =
      "usage: tallyctl COMMAND [ARGS] [flags]\n\n"
      "Command-line client of a tally training server.\n\ncommands:\n";
  for (const CommandSpec& spec : Commands()) {
    absl::StrAppend(&text,
                    absl::StrFormat("  %-7s %s\n", spec.name, spec.summary));
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
    // "tallyctl help train" == "tallyctl train --help".
    args = {args[1], "--help"};
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
  FlagParser flags(absl::StrCat("tallyctl ", spec->name), spec->positional,
                   spec->description);
  connection.Add(flags);
  std::unique_ptr<Command> command = spec->make();
  command->AddFlags(flags);

  absl::StatusOr<std::vector<std::string>> positional =
      flags.Parse({args.begin() + 1, args.end()});
  if (flags.help_requested()) {
    std::cout << flags.Help();
    return 0;
  }
  if (!positional.ok()) {
    std::cerr << "tallyctl " << spec->name << ": "
              << positional.status().message() << "\n"
              << flags.UsageLine() << "\nRun 'tallyctl " << spec->name
              << " --help' for details.\n";
    return kExitUsage;
  }
  absl::StatusOr<TrainerClientOptions> options = connection.Options();
  if (!options.ok()) {
    std::cerr << "tallyctl " << spec->name << ": " << options.status().message()
              << "\n";
    return kExitUsage;
  }

  TrainerClient client(*options);
  if (absl::Status status = command->Run(client, *positional); !status.ok()) {
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
