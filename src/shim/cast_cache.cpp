// O1's weight-cast cache (per thread) and the one function that casts a kernel's arguments.
//
// Keyed by the source leaf's TensorImpl and the target dtype; the entry keeps a weak reference
// to the TensorImpl (so its address cannot be reused while the entry lives), the version
// counter at cast time (an in-place change of the weight forces a recast) and the cast tensor.
// Entries are stored only while grad mode is on, so a cast made under no_grad (which has no
// autograd edge back to the weight) never reaches a later training forward.
#include "cast_policy.h"

#include <c10/core/GradMode.h>
#include <unordered_map>
#include <utility>

namespace tch_amp::cast {
namespace {

struct CacheKey {
  c10::TensorImpl* impl;
  at::ScalarType to;
  bool operator==(const CacheKey& o) const { return impl == o.impl && to == o.to; }
};
struct CacheKeyHash {
  size_t operator()(const CacheKey& k) const {
    return std::hash<const void*>()(k.impl) ^ (static_cast<size_t>(k.to) * 0x9E3779B97F4A7C15ull);
  }
};
struct CacheEntry {
  CacheEntry(const at::Tensor& weight, uint32_t v, at::Tensor c)
      : source(weight.getIntrusivePtr()), version(v), cast(std::move(c)) {}
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> source;
  uint32_t version;
  at::Tensor cast;
};
thread_local std::unordered_map<CacheKey, CacheEntry, CacheKeyHash> tls_cache;

bool is_managed_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

// The cache's entry for `t` under `key` when it is still valid, else `make()` (stored under
// grad mode).
template <class Make>
at::Tensor cached(const at::Tensor& t, const CacheKey& key, Make&& make) {
  const uint32_t version = t._version();
  const bool grad_mode = c10::GradMode::is_enabled();
  auto it = tls_cache.find(key);
  if (it != tls_cache.end()) {
    auto& e = it->second;
    // Under grad mode only an entry with an autograd edge back to the weight may be reused.
    if (e.version == version && (!grad_mode || e.cast.requires_grad())) return e.cast;
    tls_cache.erase(it);
  }
  at::Tensor out = make();
  if (grad_mode) tls_cache.emplace(key, CacheEntry(t, version, out));
  return out;
}

}  // namespace

bool cacheable_weight(const at::Tensor& t) {
  return t.requires_grad() && t.is_leaf() && !t.is_view() && !t.is_inference();
}

bool eligible(const at::Tensor& t, int dev) {
  if (!t.defined() || !is_managed_float(t.scalar_type())) return false;
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) return false;
  return dev == kCpu ? (t.is_cpu() || t.is_mkldnn()) : (t.is_cuda() || t.is_xla());
}

// Leaf tensors that require grad (model weights) go through the cache in both directions a
// policy casts them (fp32 -> fp16/bf16 for the low-precision list, fp16/bf16 -> fp32 for CPU
// emulation of a low-precision model).
at::Tensor cast_tensor(const at::Tensor& t, at::ScalarType to, int dev) {
  if (!eligible(t, dev)) return t;
  const auto from = t.scalar_type();
  if (from == to || from == at::kDouble) return t;
  const bool cacheable =
      ((from == at::kFloat && is_low(to)) || (is_low(from) && to == at::kFloat)) && cacheable_weight(t);
  if (!cacheable) return t.to(to);
  return cached(t, CacheKey{t.unsafeGetTensorImpl(), to}, [&] { return t.to(to); });
}

// Ends a cache lifetime (Apex's: each scale_loss exit).
void cache_clear() { tls_cache.clear(); }
size_t cache_len() { return tls_cache.size(); }

}  // namespace tch_amp::cast
