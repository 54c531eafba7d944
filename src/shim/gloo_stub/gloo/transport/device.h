// Declaration-only stand-in (see ../../README.md): ProcessGroupGloo holds transport devices and
// unbound buffers only through shared_ptr / unique_ptr.
#pragma once

namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
}  // namespace transport
}  // namespace gloo
