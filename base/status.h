// Status plumbing shared by every tally library and client.
//
// Abseil 20220623 has no RETURN_IF_ERROR / ASSIGN_OR_RETURN, so tally defines
// its own, and a boundary helper that turns LibTorch / c10d exceptions into an
// absl::Status so they never cross a library interface.
//
//   absl::StatusOr<torch::Tensor> Load(const std::string& path);
//
//   absl::Status Run() {
//     TALLY_ASSIGN_OR_RETURN(torch::Tensor t, Load("x"));
//     TALLY_RETURN_IF_ERROR(Check(t));
//     return tally::CatchTorch("matmul", [&] { t.matmul(t); });
//   }
#ifndef TALLY_BASE_STATUS_H_
#define TALLY_BASE_STATUS_H_

#include <exception>
#include <string>
#include <type_traits>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#define TALLY_STATUS_CONCAT_INNER_(a, b) a##b
#define TALLY_STATUS_CONCAT_(a, b) TALLY_STATUS_CONCAT_INNER_(a, b)

#define TALLY_RETURN_IF_ERROR(expr)                \
  do {                                             \
    ::absl::Status tally_status_ = (expr);         \
    if (!tally_status_.ok()) return tally_status_; \
  } while (false)

#define TALLY_ASSIGN_OR_RETURN(lhs, expr) \
  TALLY_ASSIGN_OR_RETURN_IMPL_(           \
      TALLY_STATUS_CONCAT_(tally_statusor_, __LINE__), lhs, expr)

#define TALLY_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr)  \
  auto statusor = (expr);                                  \
  if (!statusor.ok()) return std::move(statusor).status(); \
  lhs = std::move(statusor).value()

namespace tally {

// Runs `fn` and converts any exception (c10::Error, std::exception) into an
// INTERNAL status naming `what`. `fn` returns void, absl::Status or
// absl::StatusOr<T>.
template <typename Fn>
auto CatchTorch(const char* what, Fn&& fn)
    -> decltype(std::conditional_t<std::is_void_v<decltype(fn())>, absl::Status,
                                   decltype(fn())>()) {
  using R = decltype(fn());
  try {
    if constexpr (std::is_void_v<R>) {
      fn();
      return absl::OkStatus();
    } else {
      return fn();
    }
  } catch (const std::exception& e) {
    // c10::Error's what() carries a backtrace after the first line.
    std::string message = e.what();
    if (auto eol = message.find('\n'); eol != std::string::npos) {
      message.resize(eol);
    }
    return absl::InternalError(absl::StrCat(what, ": ", message));
  }
}

}  // namespace tally

#endif  // TALLY_BASE_STATUS_H_
