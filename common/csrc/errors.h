// How the shim's C functions report C++ exceptions to Rust (csrc/torch_ext.cpp and
// csrc/cuda_graph.cpp): no exception crosses into Rust; a failing call returns -1 (or null)
// and leaves the exception's message on this thread, for the library's `*_last_error`.
#pragma once

#include <cstring>
#include <string>

namespace shim {

inline thread_local std::string last_error;

// Runs `f`: 0, or -1 with the exception's message kept.
template <typename F>
int protect_status(F&& f) {
  try {
    f();
    return 0;
  } catch (const std::exception& e) {
    last_error = e.what();
  } catch (...) {
    last_error = "unknown C++ exception";
  }
  return -1;
}

// Copies the last message into `buffer` (NUL-terminated, cut at `size`), clears it, and
// returns its full length.
inline size_t take_last_error(char* buffer, size_t size) {
  size_t length = last_error.size();
  if (size > 0) {
    size_t n = length < size - 1 ? length : size - 1;
    std::memcpy(buffer, last_error.data(), n);
    buffer[n] = '\0';
  }
  last_error.clear();
  return length;
}

}  // namespace shim
