#include "client/output.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "client/command_line.h"
#include "google/protobuf/util/json_util.h"

namespace tally {

absl::StatusOr<Output::Format> Output::FormatNamed(absl::string_view name) {
  if (name == "text") return Format::kText;
  if (name == "json") return Format::kJson;
  return FlagValueError("output", name, "text or json");
}

namespace {

// `message` in protobuf's JSON mapping, as Output prints it.
absl::StatusOr<std::string> MessageJsonLine(
    const google::protobuf::Message& message) {
  google::protobuf::util::JsonPrintOptions options;
  options.always_print_primitive_fields = true;
  options.preserve_proto_field_names = true;
  std::string line;
  const auto printed =
      google::protobuf::util::MessageToJsonString(message, &line, options);
  if (!printed.ok()) {
    return absl::InternalError(absl::StrCat("cannot print ",
                                            message.GetTypeName(),
                                            " as JSON: ", printed.ToString()));
  }
  return line;
}

}  // namespace

absl::Status Output::Print(const google::protobuf::Message& message,
                           const std::function<void(std::ostream&)>& text) {
  if (!json()) {
    text(out_);
    out_.flush();
    return absl::OkStatus();
  }
  TALLY_ASSIGN_OR_RETURN(std::string line, MessageJsonLine(message));
  out_ << line << "\n";
  out_.flush();
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::ordered_json> Output::MessageJson(
    const google::protobuf::Message& message) {
  TALLY_ASSIGN_OR_RETURN(std::string line, MessageJsonLine(message));
  nlohmann::ordered_json record = nlohmann::ordered_json::parse(
      line, /*cb=*/nullptr, /*allow_exceptions=*/false);
  if (record.is_discarded()) {
    return absl::InternalError(
        absl::StrCat("cannot read back ", message.GetTypeName(), " as JSON"));
  }
  return record;
}

void Output::Print(const nlohmann::ordered_json& record,
                   absl::string_view text) {
  if (json()) {
    // Strings hold what the server sent: replace bytes that are not UTF-8.
    out_ << record.dump(-1, ' ', false,
                        nlohmann::json::error_handler_t::replace)
         << "\n";
  } else {
    out_ << text;
  }
  out_.flush();
}

}  // namespace tally
