// Output: how a CLI command prints its results (tallyctl's --output): text
// for people (the default), or JSON for programs, one object per line.
// Messages print in protobuf's JSON mapping with the proto's field names and
// every field (zeros and empty lists included; 64-bit integers as strings,
// enums by name); other records (a training step) as plain JSON objects.
//
//   TALLY_ASSIGN_OR_RETURN(tally::Output::Format format,
//                          tally::Output::FormatNamed(output_flag));
//   tally::Output out(format, std::cout);
//   TALLY_RETURN_IF_ERROR(out.Print(model_info, [&](std::ostream& os) {
//     os << "model m\n";
//   }));
//   out.Print(nlohmann::ordered_json{{"step", 1}}, "step 1\n");
#ifndef TALLY_CLIENT_OUTPUT_H_
#define TALLY_CLIENT_OUTPUT_H_

#include <functional>
#include <ostream>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"

namespace tally {

class Output {
 public:
  enum class Format { kText, kJson };

  // "text" or "json"; anything else is a FlagValueError naming --output.
  static absl::StatusOr<Format> FormatNamed(absl::string_view name);

  Output(Format format, std::ostream& out) : format_(format), out_(out) {}

  bool json() const { return format_ == Format::kJson; }

  // A result message: one line of JSON, or what `text` writes. INTERNAL if
  // protobuf cannot print it.
  absl::Status Print(const google::protobuf::Message& message,
                     const std::function<void(std::ostream&)>& text);
  // A record: one line of JSON (NaN and infinities as null), or `text`.
  void Print(const nlohmann::ordered_json& record, absl::string_view text);

  // `message` as Print writes it in JSON, as a record to add fields to
  // (tallyctl sample's decoded text). INTERNAL as for Print.
  static absl::StatusOr<nlohmann::ordered_json> MessageJson(
      const google::protobuf::Message& message);

 private:
  Format format_;
  std::ostream& out_;
};

}  // namespace tally

#endif  // TALLY_CLIENT_OUTPUT_H_
