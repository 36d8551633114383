#pragma once
/// mixprec::Error, the one exception type of the library, and the MIXPREC_CHECK macro.

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace mixprec {

/// Thrown for every misuse the library detects; the message says what was wrong and how to fix it.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {

template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  std::ostringstream message;
  message << "mixprec: ";
  (message << ... << std::forward<Parts>(parts));
  throw Error(message.str());
}

}  // namespace detail
}  // namespace mixprec

/// Throws mixprec::Error with the streamed message parts when `cond` is false.
#define MIXPREC_CHECK(cond, ...)             \
  do {                                       \
    if (!(cond)) {                           \
      ::mixprec::detail::fail(__VA_ARGS__);  \
    }                                        \
  } while (false)
