// Declaration-only stand-in (see ../README.md): gloo::Context is held through shared_ptr by
// ProcessGroupGloo; its inline setTimeout names Context::setTimeout, declared (never defined)
// here. tch-amp never calls it.
#pragma once
#include <chrono>

namespace gloo {
class Context {
 public:
  void setTimeout(std::chrono::milliseconds timeout);
};
}  // namespace gloo
