#pragma once
// latte::Error — the one exception type for invalid calls.
//
// Every message names the offending argument and states what was expected and
// what was given, e.g.
//   "latte: argument 'values' dimension T (time): expected 128, given 127".
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

namespace latte {

class Error : public std::invalid_argument {
 public:
  Error(std::string_view argument, std::string_view what_is_wrong)
      : std::invalid_argument(compose(argument, what_is_wrong)), argument_(argument) {}

  /// The name of the argument the error is about ("values", "window", ...).
  [[nodiscard]] const std::string& argument() const noexcept { return argument_; }

 private:
  static std::string compose(std::string_view argument, std::string_view what_is_wrong) {
    std::string message = "latte: argument '";
    message += argument;
    message += "': ";
    message += what_is_wrong;
    return message;
  }
  std::string argument_;
};

namespace detail {

/// Builds "expected X, given Y" messages without iostream noise at call sites.
template <class Expected, class Given>
[[nodiscard]] std::string expected_given(std::string_view what, const Expected& expected,
                                         const Given& given) {
  std::ostringstream message;
  message << what << ": expected " << expected << ", given " << given;
  return message.str();
}

/// The same error about another argument name (a callee's "angles" reported
/// as the caller's "latent_positional.angles"): the message keeps its text.
[[nodiscard]] inline Error renamed(const Error& error, std::string_view argument) {
  const std::string prefix = "latte: argument '" + error.argument() + "': ";
  std::string what = error.what();
  if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
  return Error(argument, what);
}

/// Throws latte::Error unless `condition` holds.
inline void require(bool condition, std::string_view argument, std::string_view what_is_wrong) {
  if (!condition) throw Error(argument, what_is_wrong);
}

}  // namespace detail
}  // namespace latte
