// check.h -- memsched's three levels of assertion and its error type.
//
//   MEMSCHED_CHECK(cond, ...)            always on; throws memsched::Error with
//                                         the streamed message (what was asked,
//                                         what was available, what to do).
//   MEMSCHED_DEBUG_ASSERT(cond)          on unless NDEBUG.
//   MEMSCHED_EXPENSIVE_ASSERT(cond)      only with MEMSCHED_EXPENSIVE_CHECKS
//                                         (O(n) checks such as check_invariants()).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace memsched {

// Every error memsched throws; bound to Python as memsched.MemschedError
// (a subclass of RuntimeError).
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
inline void stream_all(std::ostringstream&) {}
template <typename T, typename... Rest>
void stream_all(std::ostringstream& os, const T& first, const Rest&... rest) {
  os << first;
  stream_all(os, rest...);
}
template <typename... Args>
[[noreturn]] void throw_error(const char* cond, const char* file, int line, const Args&... args) {
  std::ostringstream os;
  stream_all(os, args...);
  // A bare check is an internal error: say where. A check with a message is
  // written for the user and stands alone.
  if (sizeof...(Args) == 0) os << "internal check failed: " << cond << " [" << file << ":" << line << "]";
  throw Error(os.str());
}
}  // namespace detail

}  // namespace memsched

#define MEMSCHED_CHECK(cond, ...)                                                  \
  do {                                                                             \
    if (!(cond)) ::memsched::detail::throw_error(#cond, __FILE__, __LINE__, ##__VA_ARGS__); \
  } while (0)

#ifdef NDEBUG
#define MEMSCHED_DEBUG_ASSERT(cond) ((void)0)
#else
#define MEMSCHED_DEBUG_ASSERT(cond) MEMSCHED_CHECK(cond, "internal assertion failed: " #cond)
#endif

#ifdef MEMSCHED_EXPENSIVE_CHECKS
#define MEMSCHED_EXPENSIVE_ASSERT(cond) MEMSCHED_CHECK(cond, "internal assertion failed: " #cond)
#else
#define MEMSCHED_EXPENSIVE_ASSERT(cond) ((void)0)
#endif
