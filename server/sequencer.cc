#include "server/sequencer.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include <algorithm>
#include <cstring>
#include <optional>

#include "absl/strings/str_cat.h"
#include "base/error_reason.h"
#include "base/status.h"

namespace tally {
namespace {

// splitmix64's finalizer: every input bit flips each output bit with
// probability ~1/2.
uint64_t Mix(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

uint64_t Hash64(absl::string_view bytes) {
  constexpr uint64_t kPrime = 0x100000001b3ULL;  // FNV-1a's 64-bit prime
  uint64_t hash = 0xcbf29ce484222325ULL ^ Mix(bytes.size());
  size_t at = 0;
  for (; at + 8 <= bytes.size(); at += 8) {
    uint64_t word = 0;
    for (int i = 7; i >= 0; --i) {
      word = word << 8 | static_cast<unsigned char>(bytes[at + i]);
    }
    hash = (hash ^ Mix(word)) * kPrime;
  }
  uint64_t tail = 0;
  for (size_t i = bytes.size(); i > at; --i) {
    tail = tail << 8 | static_cast<unsigned char>(bytes[i - 1]);
  }
  return Mix(hash ^ Mix(tail + 1));
}

// SequencerState's encoding: "TSQ2", then little-endian u64s and
// length-prefixed strings. "TSQ1" (before outcomes kept their ErrorReason)
// is still read, each outcome without a reason.
constexpr absl::string_view kStateMagic = "TSQ2";
constexpr absl::string_view kStateMagicWithoutReasons = "TSQ1";

void PutU64(std::string& out, uint64_t value) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(value >> 8 * i));
}

void PutBytes(std::string& out, absl::string_view bytes) {
  PutU64(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

class StateReader {
 public:
  explicit StateReader(absl::string_view bytes) : rest_(bytes) {}

  absl::StatusOr<uint64_t> U64(const char* what) {
    if (rest_.size() < 8) return Truncated(what);
    uint64_t value = 0;
    for (int i = 7; i >= 0; --i) {
      value = value << 8 | static_cast<unsigned char>(rest_[i]);
    }
    rest_.remove_prefix(8);
    return value;
  }

  absl::StatusOr<std::string> Bytes(const char* what) {
    absl::StatusOr<uint64_t> size = U64(what);
    if (!size.ok()) return size.status();
    if (*size > rest_.size()) return Truncated(what);
    std::string bytes(rest_.substr(0, *size));
    rest_.remove_prefix(*size);
    return bytes;
  }

  bool done() const { return rest_.empty(); }

 private:
  static absl::Status Truncated(const char* what) {
    return absl::DataLossError(
        absl::StrCat("sequencer state truncated in ", what));
  }

  absl::string_view rest_;
};

absl::Status ValidateState(const SequencerState& state) {
  if (state.next_seq_id == 0) {
    return absl::InvalidArgumentError("sequencer state: next_seq_id is 0");
  }
  uint64_t previous = 0;
  for (const SequencerState::Outcome& outcome : state.outcomes) {
    if (outcome.seq_id <= previous || outcome.seq_id >= state.next_seq_id) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequencer state: outcome seq_id ", outcome.seq_id,
          " is not ascending within [1, next_seq_id=", state.next_seq_id, ")"));
    }
    previous = outcome.seq_id;
  }
  return absl::OkStatus();
}

SequencedOutcome Replay(const SequencerState::Outcome& cached) {
  absl::Status status(cached.code, cached.message);
  if (std::optional<ErrorReason> reason = ReasonFromName(cached.reason)) {
    status = WithReason(std::move(status), *reason);
  }
  return {std::move(status), cached.response};
}

}  // namespace

std::string SequencerState::Serialize() const {
  std::string out(kStateMagic);
  PutU64(out, next_seq_id);
  PutU64(out, outcomes.size());
  for (const Outcome& outcome : outcomes) {
    PutU64(out, outcome.seq_id);
    PutU64(out, outcome.fingerprint);
    PutU64(out, static_cast<uint64_t>(outcome.code));
    PutBytes(out, outcome.message);
    PutBytes(out, outcome.reason);
    PutBytes(out, outcome.response);
  }
  return out;
}

absl::StatusOr<SequencerState> SequencerState::Parse(absl::string_view bytes) {
  const absl::string_view magic = bytes.substr(0, kStateMagic.size());
  if (magic != kStateMagic && magic != kStateMagicWithoutReasons) {
    return absl::DataLossError("not a sequencer state (bad magic)");
  }
  const bool with_reasons = magic == kStateMagic;
  StateReader in(bytes.substr(kStateMagic.size()));
  SequencerState state;
  absl::StatusOr<uint64_t> next = in.U64("next_seq_id");
  if (!next.ok()) return next.status();
  state.next_seq_id = *next;
  absl::StatusOr<uint64_t> count = in.U64("the outcome count");
  if (!count.ok()) return count.status();
  for (uint64_t i = 0; i < *count; ++i) {
    Outcome outcome;
    absl::StatusOr<uint64_t> seq_id = in.U64("an outcome");
    absl::StatusOr<uint64_t> fingerprint = in.U64("an outcome");
    absl::StatusOr<uint64_t> code = in.U64("an outcome");
    if (!seq_id.ok() || !fingerprint.ok() || !code.ok()) {
      return absl::DataLossError("sequencer state truncated in an outcome");
    }
    if (*code > static_cast<uint64_t>(absl::StatusCode::kUnauthenticated)) {
      return absl::DataLossError(
          absl::StrCat("sequencer state: unknown status code ", *code));
    }
    absl::StatusOr<std::string> message = in.Bytes("an outcome message");
    if (!message.ok()) return message.status();
    absl::StatusOr<std::string> reason =
        with_reasons ? in.Bytes("an outcome reason") : std::string();
    if (!reason.ok()) return reason.status();
    absl::StatusOr<std::string> response = in.Bytes("an outcome response");
    if (!response.ok()) return response.status();
    outcome.seq_id = *seq_id;
    outcome.fingerprint = *fingerprint;
    outcome.code = static_cast<absl::StatusCode>(*code);
    outcome.message = *std::move(message);
    outcome.reason = *std::move(reason);
    outcome.response = *std::move(response);
    state.outcomes.push_back(std::move(outcome));
  }
  if (!in.done()) {
    return absl::DataLossError("sequencer state has trailing bytes");
  }
  if (absl::Status valid = ValidateState(state); !valid.ok()) {
    return absl::DataLossError(valid.message());
  }
  return state;
}

uint64_t RequestFingerprint(const google::protobuf::Message& request) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream stream(&bytes);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    request.SerializeToCodedStream(&coded);
  }
  return Hash64(bytes);
}

Sequencer::Sequencer(SequencerOptions options, SequencerHooks hooks)
    : options_(std::move(options)),
      hooks_(std::move(hooks)),
      heartbeat_(
          options_.liveness == nullptr
              ? nullptr
              : options_.liveness->Register("sequencer", Liveness::kLoopBound)),
      gap_timer_([this] { GapTimerLoop(); }) {}

Sequencer::~Sequencer() {
  Stop(ReasonError(ErrorReason::kShuttingDown, "the server is shutting down"));
  {
    absl::MutexLock lock(&mu_);
    exiting_ = true;
    gap_changed_.Signal();
  }
  gap_timer_.join();
}

void Sequencer::AddModel(const std::string& model_id) {
  Replies replies;
  {
    absl::MutexLock lock(&mu_);
    auto queue = std::make_shared<ModelQueue>();
    queue->model_id = model_id;
    std::shared_ptr<ModelQueue>& slot = models_[model_id];
    if (slot != nullptr) {
      slot->removed = true;
      AnswerWaiting(*slot,
                    absl::NotFoundError(
                        absl::StrCat("model '", model_id, "' was re-created")),
                    replies);
      CloseGap(*slot);
    }
    slot = std::move(queue);
  }
  Send(replies);
}

void Sequencer::RemoveModel(const std::string& model_id) {
  Replies replies;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(model_id);
    if (it == models_.end()) return;
    ModelQueue& queue = *it->second;
    queue.removed = true;
    AnswerWaiting(queue,
                  absl::NotFoundError(absl::StrCat("model '", model_id,
                                                   "' was deleted before this "
                                                   "request ran")),
                  replies);
    CloseGap(queue);
    models_.erase(it);
  }
  Send(replies);
}

void Sequencer::AnswerWaiting(ModelQueue& queue, const absl::Status& status,
                              Replies& replies) {
  for (auto it = queue.pending.begin(); it != queue.pending.end();) {
    if (queue.dispatched && it->first == queue.next_seq_id) {
      ++it;
      continue;
    }
    for (SequencedRequest& caller : it->second.callers) {
      replies.push_back({std::move(caller), {status, ""}});
    }
    it = queue.pending.erase(it);
  }
}

void Sequencer::Submit(const std::string& model_id, SequencedRequest request) {
  Replies replies;
  {
    absl::MutexLock lock(&mu_);
    auto it = models_.find(model_id);
    auto answer = [&](absl::Status status, std::string response = "") {
      replies.push_back(
          {std::move(request), {std::move(status), std::move(response)}});
    };
    const uint64_t seq_id = request.seq_id;
    if (!stopped_.ok()) {
      answer(stopped_);
    } else if (it == models_.end()) {
      answer(absl::NotFoundError(
          absl::StrCat("model '", model_id, "' not found")));
    } else if (ModelQueue& queue = *it->second; seq_id < queue.next_seq_id) {
      auto done = queue.outcomes.find(seq_id);
      if (done == queue.outcomes.end()) {
        answer(ReasonError(
            ErrorReason::kSeqIdExpired,
            absl::StrCat(
                "seq_id ", seq_id, " of model '", model_id,
                "' was executed and its response is no longer cached (the "
                "server keeps those of the current and the previous window, "
                "and at least the last ",
                options_.cache_size, "); next_seq_id is ", queue.next_seq_id)));
      } else if (done->second.fingerprint != request.fingerprint) {
        answer(
            ReasonError(ErrorReason::kSeqIdReused,
                        absl::StrCat("seq_id ", seq_id, " of model '", model_id,
                                     "' was already executed with a different "
                                     "payload")));
      } else {
        if (hooks_.on_duplicate) hooks_.on_duplicate(model_id);
        SequencedOutcome cached = Replay(done->second);
        answer(std::move(cached.status), std::move(cached.response));
      }
    } else {
      auto [slot, inserted] = queue.pending.try_emplace(seq_id);
      // A dispatched seq_id whose callers all withdrew is still unused.
      const bool taken = slot->second.running || !slot->second.callers.empty();
      if (taken && slot->second.fingerprint != request.fingerprint) {
        answer(ReasonError(
            ErrorReason::kSeqIdReused,
            absl::StrCat("seq_id ", seq_id, " of model '", model_id,
                         "' is already taken by a pending request with "
                         "a different payload")));
      } else {
        if (taken && hooks_.on_duplicate) hooks_.on_duplicate(model_id);
        slot->second.fingerprint = request.fingerprint;
        slot->second.callers.push_back(std::move(request));
        if (inserted) Advance(it->second, replies);
      }
    }
  }
  Send(replies);
}

void Sequencer::Withdraw(const std::string& model_id, uint64_t seq_id,
                         uint64_t caller_id, const absl::Status& status) {
  if (caller_id == 0) return;
  Replies replies;
  {
    absl::MutexLock lock(&mu_);
    auto model = models_.find(model_id);
    if (model == models_.end()) return;
    ModelQueue& queue = *model->second;
    auto waiting = queue.pending.find(seq_id);
    if (waiting == queue.pending.end()) return;
    std::vector<SequencedRequest>& callers = waiting->second.callers;
    auto caller = std::find_if(callers.begin(), callers.end(),
                               [caller_id](const SequencedRequest& r) {
                                 return r.caller_id == caller_id;
                               });
    if (caller == callers.end()) return;
    replies.push_back({std::move(*caller), {status, ""}});
    callers.erase(caller);
    // A dispatched seq_id stays for RunNext, which finds it empty.
    const bool dispatched = queue.dispatched && seq_id == queue.next_seq_id;
    if (callers.empty() && !waiting->second.running && !dispatched) {
      queue.pending.erase(waiting);
      Advance(model->second, replies);  // closes the gap if none waits
    }
  }
  Send(replies);
}

void Sequencer::CloseGap(ModelQueue& queue) {
  if (queue.gap_since == absl::InfiniteFuture()) return;
  if (hooks_.on_gap_closed) {
    hooks_.on_gap_closed(absl::ToDoubleSeconds(absl::Now() - queue.gap_since));
  }
  queue.gap_since = absl::InfiniteFuture();
}

void Sequencer::Advance(const std::shared_ptr<ModelQueue>& queue,
                        Replies& replies) {
  ModelQueue& q = *queue;
  if (q.dispatched || q.removed) return;
  auto first = q.pending.begin();
  if (first == q.pending.end()) {
    CloseGap(q);
    return;
  }
  if (first->first != q.next_seq_id) {
    if (q.gap_since == absl::InfiniteFuture()) {
      q.gap_since = absl::Now();
      gap_changed_.Signal();
    }
    return;
  }
  CloseGap(q);
  q.dispatched = true;
  if (hooks_.dispatch([this, queue] { RunNext(queue); })) return;
  // The executor stopped: nothing of this model runs any more.
  q.dispatched = false;
  for (auto& [seq_id, waiting] : q.pending) {
    for (SequencedRequest& caller : waiting.callers) {
      replies.push_back({std::move(caller),
                         {ReasonError(ErrorReason::kShuttingDown,
                                      "the server is shutting down"),
                          ""}});
    }
  }
  q.pending.clear();
}

void Sequencer::RunNext(const std::shared_ptr<ModelQueue>& queue) {
  ModelQueue& q = *queue;
  std::vector<SequencedRequest> live;
  uint64_t seq_id = 0, fingerprint = 0;
  while (live.empty()) {
    std::vector<SequencedRequest> callers;
    Replies unrun;
    bool removed = false;
    {
      absl::MutexLock lock(&mu_);
      seq_id = q.next_seq_id;
      removed = q.removed;
      auto waiting = q.pending.find(seq_id);
      if (waiting != q.pending.end()) {
        fingerprint = waiting->second.fingerprint;
        callers = std::move(waiting->second.callers);
        waiting->second.callers.clear();
        waiting->second.running = !callers.empty();
      }
      if (callers.empty() || removed) {
        // Every caller gave up (the seq_id stays unused for their retry), or
        // the model is gone: nothing runs.
        if (waiting != q.pending.end()) q.pending.erase(waiting);
        q.dispatched = false;
        Advance(queue, unrun);
      }
    }
    if (removed) {
      for (SequencedRequest& caller : callers) {
        unrun.push_back({std::move(caller),
                         {absl::NotFoundError(absl::StrCat(
                              "model '", q.model_id,
                              "' was deleted before this request ran")),
                          ""}});
      }
    }
    if (callers.empty() || removed) {
      Send(unrun);
      return;
    }
    Replies refused;
    for (SequencedRequest& caller : callers) {
      absl::Status ready = caller.precheck();
      if (ready.ok()) {
        live.push_back(std::move(caller));
      } else {
        refused.push_back({std::move(caller), {std::move(ready), ""}});
      }
    }
    Send(refused);
  }

  const SequencedOutcome outcome = live.front().execute();
  Replies replies;
  {
    absl::MutexLock lock(&mu_);
    SequencerState::Outcome cached;
    cached.seq_id = seq_id;
    cached.fingerprint = fingerprint;
    cached.code = outcome.status.code();
    cached.message = std::string(outcome.status.message());
    if (std::optional<ErrorReason> reason = ReasonOf(outcome.status)) {
      cached.reason = std::string(ReasonName(*reason));
    }
    cached.response = outcome.response;
    Remember(q, std::move(cached), outcome.closes_window);
    q.next_seq_id = seq_id + 1;
    q.restored = false;
    auto joined = q.pending.find(seq_id);
    if (joined != q.pending.end()) {
      for (SequencedRequest& caller : joined->second.callers) {
        live.push_back(std::move(caller));
      }
      q.pending.erase(joined);
    }
    q.dispatched = false;
    Advance(queue, replies);
  }
  for (SequencedRequest& caller : live) {
    replies.push_back({std::move(caller), outcome});
  }
  Send(replies);
}

void Sequencer::Remember(ModelQueue& queue, SequencerState::Outcome outcome,
                         bool closes_window) {
  const uint64_t seq_id = outcome.seq_id;
  queue.cached_bytes += outcome.response.size();
  queue.outcomes[seq_id] = std::move(outcome);
  if (closes_window) {
    queue.previous_window_start = queue.window_start;
    queue.window_start = seq_id + 1;
  }
  Prune(queue);
}

void Sequencer::Prune(ModelQueue& queue) const {
  const size_t floor = std::max<size_t>(options_.cache_size, 1);
  while (queue.outcomes.size() > floor) {
    auto oldest = queue.outcomes.begin();
    const bool in_kept_windows = oldest->first >= queue.previous_window_start;
    if (in_kept_windows && queue.cached_bytes <= options_.cache_bytes) break;
    queue.cached_bytes -= oldest->second.response.size();
    queue.outcomes.erase(oldest);
  }
}

absl::Status Sequencer::GapTimedOut(const ModelQueue& queue, uint64_t seq_id,
                                    uint64_t missing) const {
  if (queue.restored) {
    return ReasonError(
        ErrorReason::kSeqRestored,
        absl::StrCat(
            "model '", queue.model_id,
            "' was restored from a checkpoint to next_seq_id ", missing,
            ", and seq_id ", seq_id,
            " is ahead of it: the requests before it were lost with the "
            "previous server process; resend the window from seq_id ",
            missing, " (ModelInfo.next_seq_id)"));
  }
  return ReasonError(
      ErrorReason::kSeqGap,
      absl::StrCat(
          "seq_id ", seq_id, " of model '", queue.model_id, "' waited ",
          absl::FormatDuration(options_.gap_timeout), " for seq_id ", missing,
          ", which never arrived; the accumulation window is poisoned: call "
          "AbortAccumulation and resend from seq_id ",
          missing, " (ModelInfo.next_seq_id)"));
}

void Sequencer::GapTimerLoop() {
  absl::MutexLock lock(&mu_);
  auto deadline = [this](const ModelQueue& q) {
    if (q.gap_since == absl::InfiniteFuture()) return absl::InfiniteFuture();
    return q.gap_since +
           (q.restored ? options_.restored_gap_timeout : options_.gap_timeout);
  };
  const absl::Duration period =
      heartbeat_ ? heartbeat_->period() : absl::InfiniteDuration();
  while (!exiting_) {
    if (heartbeat_) heartbeat_->Beat();
    absl::Time earliest = absl::InfiniteFuture();
    for (const auto& [id, queue] : models_) {
      earliest = std::min(earliest, deadline(*queue));
    }
    const absl::Time now = absl::Now();
    if (earliest > now) {
      gap_changed_.WaitWithDeadline(&mu_, std::min(earliest, now + period));
      continue;
    }
    // Models whose window a lost request poisoned, and the answers.
    std::vector<std::string> poisoned;
    Replies replies;
    for (auto& [id, queue] : models_) {
      ModelQueue& q = *queue;
      if (deadline(q) > now) continue;
      const uint64_t missing = q.next_seq_id;
      // A restored model lost the requests with the process: nothing of its
      // window ran, so there is nothing to poison.
      if (!q.restored) poisoned.push_back(id);
      CloseGap(q);
      for (auto& [seq_id, waiting] : q.pending) {
        for (SequencedRequest& caller : waiting.callers) {
          replies.push_back(
              {std::move(caller), {GapTimedOut(q, seq_id, missing), ""}});
        }
      }
      q.pending.clear();
    }
    mu_.Unlock();
    for (const std::string& id : poisoned) {
      if (hooks_.on_gap_timeout) hooks_.on_gap_timeout(id);
    }
    Send(replies);
    mu_.Lock();
  }
}

void Sequencer::Stop(absl::Status status) {
  Replies replies;
  {
    absl::MutexLock lock(&mu_);
    if (!stopped_.ok()) return;
    stopped_ = status;
    for (auto& [id, queue] : models_) {
      AnswerWaiting(*queue, status, replies);
      CloseGap(*queue);
    }
  }
  Send(replies);
}

absl::StatusOr<Sequencer::ModelQueue*> Sequencer::FindQueue(
    const std::string& model_id) const {
  auto it = models_.find(model_id);
  if (it == models_.end()) {
    return absl::NotFoundError(
        absl::StrCat("model '", model_id, "' not found"));
  }
  return it->second.get();
}

absl::StatusOr<uint64_t> Sequencer::NextSeqId(
    const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  TALLY_ASSIGN_OR_RETURN(const ModelQueue* q, FindQueue(model_id));
  return q->next_seq_id;
}

absl::StatusOr<SequencerState> Sequencer::ExportState(
    const std::string& model_id) const {
  absl::MutexLock lock(&mu_);
  TALLY_ASSIGN_OR_RETURN(const ModelQueue* q, FindQueue(model_id));
  SequencerState state;
  state.next_seq_id = q->next_seq_id;
  for (const auto& [seq_id, outcome] : q->outcomes) {
    state.outcomes.push_back(outcome);
  }
  return state;
}

absl::Status Sequencer::ImportState(const std::string& model_id,
                                    SequencerState state) {
  if (absl::Status valid = ValidateState(state); !valid.ok()) return valid;
  absl::MutexLock lock(&mu_);
  TALLY_ASSIGN_OR_RETURN(ModelQueue * found, FindQueue(model_id));
  ModelQueue& q = *found;
  if (!q.pending.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", model_id, "' has sequenced requests waiting or executing"));
  }
  q.next_seq_id = state.next_seq_id;
  q.restored = true;
  q.outcomes.clear();
  q.cached_bytes = 0;
  // The restored outcomes were what retention kept: they stay retryable.
  q.window_start = q.previous_window_start =
      state.outcomes.empty() ? state.next_seq_id
                             : state.outcomes.front().seq_id;
  for (SequencerState::Outcome& outcome : state.outcomes) {
    q.cached_bytes += outcome.response.size();
    const uint64_t seq_id = outcome.seq_id;
    q.outcomes[seq_id] = std::move(outcome);
  }
  Prune(q);
  return absl::OkStatus();
}

void Sequencer::Send(Replies& replies) {
  for (auto& [caller, outcome] : replies) caller.reply(outcome);
  replies.clear();
}

}  // namespace tally
