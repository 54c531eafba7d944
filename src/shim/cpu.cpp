// What the CPU and libtorch's oneDNN can do with fp16/bf16 (bound in src/sys/cpu.rs): the
// capabilities ATen detected with cpuinfo, and oneDNN's own checks for its low-precision
// paths (the ones libtorch consults before sending an fp16/bf16 GEMM or convolution to
// oneDNN), plus the process's peak-memory counters of libtorch's CPU allocator.
#include "amp_shim.h"

#include <ATen/ATen.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/Utils.h>
#include <c10/core/CPUAllocator.h>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <algorithm>
#include <atomic>
#include <mutex>
#include <sstream>
#include <string>
#include <unordered_map>

namespace {

// Calls a `mkldnn::<name>() -> bool` operator when libtorch registers it (false otherwise).
bool mkldnn_flag(const char* name) {
  auto op = c10::Dispatcher::singleton().findSchema({name, ""});
  if (!op.has_value()) return false;
  return op->typed<bool()>().call();
}

// libtorch's CPU allocator wrapped to count the bytes it hands out: current and peak, for
// the whole process (every thread). Installed on demand (tests and benchmarks), never removed;
// blocks allocated before it was installed are freed by their own deleter and not counted.
// The data pointer is its own context (as with the default allocator), so raw_allocate
// (oneDNN's scratch buffers) and copy-on-write tensors work unchanged.
struct Tracking {
  c10::Allocator* base = nullptr;
  c10::DeleterFnPtr base_deleter = nullptr;
  std::mutex mu;
  std::unordered_map<void*, size_t> sizes;
  int64_t current = 0;
  int64_t peak = 0;
};
Tracking& tracking() {
  static Tracking* t = new Tracking();  // leaked: frees may come during static destruction
  return *t;
}

void tracked_delete(void* ptr) {
  if (ptr == nullptr) return;
  auto& t = tracking();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    auto it = t.sizes.find(ptr);
    if (it != t.sizes.end()) {
      t.current -= static_cast<int64_t>(it->second);
      t.sizes.erase(it);
    }
  }
  t.base_deleter(ptr);
}

struct TrackingAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    auto& t = tracking();
    void* ptr = t.base->raw_allocate(n);
    if (ptr != nullptr) {
      std::lock_guard<std::mutex> lock(t.mu);
      t.sizes[ptr] = n;
      t.current += static_cast<int64_t>(n);
      t.peak = std::max(t.peak, t.current);
    }
    return {ptr, ptr, &tracked_delete, c10::Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &tracked_delete; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }
};

}  // namespace

extern "C" {

// Installs the counting CPU allocator (once; later calls do nothing).
char* tch_amp_cpu_memory_tracking_install() {
  TCH_AMP_PROTECT({
    static std::once_flag once;
    std::call_once(once, [] {
      auto& t = tracking();
      t.base = c10::GetCPUAllocator();
      t.base_deleter = t.base->raw_deleter();
      TORCH_CHECK(t.base_deleter != nullptr, "libtorch's CPU allocator has no raw deleter: cannot track it");
      static TrackingAllocator allocator;
      c10::SetCPUAllocator(&allocator, /*priority=*/100);
    });
  })
}

// Bytes the counting allocator holds now and at its peak; reset_peak = 1 then sets the peak to
// the current value (after reading both).
char* tch_amp_cpu_memory(int64_t* current, int64_t* peak, int reset_peak) {
  TCH_AMP_PROTECT({
    auto& t = tracking();
    std::lock_guard<std::mutex> lock(t.mu);
    *current = t.current;
    *peak = t.peak;
    if (reset_peak) t.peak = t.current;
  })
}

// glibc's malloc keeps freed memory for reuse instead of handing it back to the kernel (see
// src/cast/cpu.rs, keep_freed_cpu_memory; an explicit opt-in, never called by the library): blocks up to 32 MiB come from the heap (not a fresh
// mmap each time) and the heap top is never trimmed below 1 GiB of free space. Sets *applied
// to 1 when both settings took effect, 0 elsewhere (another C library, or mallopt refused).
char* tch_amp_keep_freed_memory(int* applied) {
  TCH_AMP_PROTECT({
    *applied = 0;
#if defined(__GLIBC__)
    const int mmap_ok = mallopt(M_MMAP_THRESHOLD, 32 * 1024 * 1024);
    const int trim_ok = mallopt(M_TRIM_THRESHOLD, 1024 * 1024 * 1024);
    *applied = (mmap_ok == 1 && trim_ok == 1) ? 1 : 0;
#endif
  })
}

// Calls `sink` with one "key=value" string per capability of at::cpu::get_cpu_capabilities()
// (booleans as 0/1), then "mkldnn=", "mkldnn_enabled=", "mkldnn_bf16=" and "mkldnn_fp16=".
char* tch_amp_cpu_capabilities(void* ctx, void (*sink)(void*, const char*)) {
  TCH_AMP_PROTECT({
    for (const auto& [key, value] : at::cpu::get_cpu_capabilities()) {
      std::ostringstream line;
      line << key << "=";
      if (value.isBool()) {
        line << (value.toBool() ? 1 : 0);
      } else if (value.isInt()) {
        line << value.toInt();
      } else if (value.isString()) {
        line << value.toStringRef();
      } else {
        continue;
      }
      sink(ctx, line.str().c_str());
    }
    const bool mkldnn = at::hasMKLDNN();
    sink(ctx, mkldnn ? "mkldnn=1" : "mkldnn=0");
    sink(ctx, at::globalContext().userEnabledMkldnn() ? "mkldnn_enabled=1" : "mkldnn_enabled=0");
    sink(ctx, mkldnn && mkldnn_flag("mkldnn::_is_mkldnn_bf16_supported") ? "mkldnn_bf16=1" : "mkldnn_bf16=0");
    sink(ctx, mkldnn && mkldnn_flag("mkldnn::_is_mkldnn_fp16_supported") ? "mkldnn_fp16=1" : "mkldnn_fp16=0");
  })
}

}  // extern "C"
