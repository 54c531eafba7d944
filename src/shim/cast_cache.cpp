// O1's weight-cast cache (per thread) and the one function that casts a kernel's arguments.
//
// Keyed by the source leaf's TensorImpl and the target dtype; the entry keeps a weak reference
// to the TensorImpl (so its address cannot be reused while the entry lives), the version
// counter at cast time (an in-place change of the weight forces a recast) and the cast tensor.
// Entries are stored only while grad mode is on, so a cast made under no_grad (which has no
// autograd edge back to the weight) never reaches a later training forward.
#include "cast_policy.h"

#include "weight_copies.h"

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/variable.h>

#include <type_traits>
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
  // The cast; for an entry made by `weight_rounded`'s one rounding node, that node's fp32
  // output (`rounding` set) until a second use turns it into a cast.
  at::Tensor cast;
  // Uses since the entry was made, and whether one was not the rounding of an emulated op's
  // argument (weight_copies.h wants weights rounded once for emulated ops and nothing else).
  int uses = 1;
  bool other_use = false;
  std::decay_t<decltype(std::declval<const at::Tensor&>().grad_fn())> rounding;
};
thread_local std::unordered_map<CacheKey, CacheEntry, CacheKeyHash> tls_cache;

bool is_managed_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

// Turns a weight's rounding-node entry into a cast entry at its second use in a forward: the
// cast to `low` is made now and the rounding node's gradient edge is rewired into it, so the
// gradients of all uses add up in `low` (the engine converts the node's fp32 gradient, already
// rounded, to `low` exactly) before the cast's backward converts their sum to fp32, as when
// every use takes the cast.
void demote(CacheEntry& e, const at::Tensor& t, at::ScalarType low) {
  at::Tensor cast = t.to(low);
  const torch::autograd::Edge to_weight = torch::autograd::impl::gradient_edge(t);
  TORCH_CHECK(e.rounding->num_outputs() >= 1 && e.rounding->next_edge(0) == to_weight,
              "tch-amp: a weight's rounding node does not lead to the weight");
  // Written in place: set_next_edge refuses a node that already has a parent (its topological
  // number could have to grow). It stays 1 here, the cast's number, not above it; the engine
  // only prunes nodes numbered below every node it is asked for gradients of, and the cast
  // is internal: no caller can ask for the gradient of `cast`, only of the weight (0) or of
  // tensors made from this node's output (above 1), so nothing is pruned that would not be.
  e.rounding->next_edges()[0] = torch::autograd::impl::gradient_edge(cast);
  e.cast = cast;
  e.rounding.reset();
  weight_copies::note_demoted();
}

// The cache's entry for `t` under `key` when it is still valid, else `make()` (stored under
// grad mode). `other_use`: the caller is not rounding an emulated op's argument.
template <class Make>
at::Tensor cached(const at::Tensor& t, const CacheKey& key, bool other_use, Make&& make) {
  const uint32_t version = t._version();
  const bool grad_mode = c10::GradMode::is_enabled();
  auto it = tls_cache.find(key);
  if (it != tls_cache.end()) {
    auto& e = it->second;
    // Under grad mode only an entry with an autograd edge back to the weight may be reused.
    if (e.version == version && (!grad_mode || e.cast.requires_grad())) {
      if (!grad_mode) {
        // No graph is built: a rounding entry's values serve as they are.
        return e.rounding ? e.cast.to(key.to) : e.cast;
      }
      ++e.uses;
      e.other_use = e.other_use || other_use;
      if (e.rounding) demote(e, t, key.to);
      return e.cast;
    }
    tls_cache.erase(it);
  }
  at::Tensor out = make();
  if (grad_mode) {
    CacheEntry e(t, version, out);
    e.other_use = other_use;
    tls_cache.emplace(key, std::move(e));
  }
  return out;
}

bool cacheable_weight(const at::Tensor& t) {
  return t.requires_grad() && t.is_leaf() && !t.is_view() && !t.is_inference();
}

// An fp32 weight as an emulated low-precision op's argument: the fp32 tensor of its values
// rounded to `low`. A weight whose previous forward used it once, for this only, gets one
// rounding node (from the optimizer's rounded copy when it is current); any other takes the
// cached cast to `low` and a conversion back per use.
at::Tensor weight_rounded(const at::Tensor& t, at::ScalarType low) {
  const CacheKey key{t.unsafeGetTensorImpl(), low};
  auto it = tls_cache.find(key);
  if (!c10::GradMode::is_enabled()) {
    // No graph: a current entry's values, else one rounding pass.
    if (it == tls_cache.end() || it->second.version != t._version()) return round_through(t, low);
    return it->second.rounding ? it->second.cast : it->second.cast.to(at::kFloat);
  }
  const bool valid = it != tls_cache.end() && it->second.version == t._version() && it->second.cast.requires_grad();
  if (!valid && weight_copies::single_use(t, low)) {
    if (it != tls_cache.end()) tls_cache.erase(it);
    const at::Tensor copy = weight_copies::lookup(t, low);
    if (!copy.defined()) weight_copies::note_rounded();
    at::Tensor out = round_weight(t, low, copy);
    CacheEntry e(t, static_cast<uint32_t>(t._version()), out);
    e.rounding = out.grad_fn();
    tls_cache.emplace(key, std::move(e));
    return out;
  }
  const at::Tensor cast = cached(t, key, /*other_use=*/false, [&] { return t.to(low); });
  return cast.to(at::kFloat);
}

}  // namespace

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
  if (!cacheable) return to == at::kFloat ? widen(t) : t.to(to);
  return cached(t, CacheKey{t.unsafeGetTensorImpl(), to}, /*other_use=*/true, [&] { return t.to(to); });
}

// An fp32 argument of an emulated low-precision-list op (O1 on CPU): fp32 values rounded to
// `low` in one pass (round_through); a `low` argument is converted to fp32 as the emulation
// converts it. A model weight goes through `weight_rounded`: one rounding node where its last
// forward used it once, else its cached `low` cast, shared by every op that uses it in the
// forward, so their gradients add up in `low` before the cast back, as under Apex (an RNN's
// weights, tied weights); one fp32 node shared by the uses would add them in fp32 instead.
at::Tensor round_through_tensor(const at::Tensor& t, at::ScalarType low) {
  if (!eligible(t, kCpu)) return t;
  if (t.scalar_type() != at::kFloat) return cast_tensor(t, at::kFloat, kCpu);
  if (cacheable_weight(t)) return weight_rounded(t, low);
  return round_through(t, low);
}

// Ends a cache lifetime (Apex's: each scale_loss exit): tells the registry how each fp32 weight
// rounded to fp16/bf16 was used (weight_copies.h), then empties the cache.
void cache_clear() {
  std::vector<weight_copies::Use> uses;
  for (const auto& [key, e] : tls_cache) {
    if (!is_low(key.to) || e.source.expired()) continue;
    const at::Tensor w(e.source.lock());
    if (w.scalar_type() == at::kFloat) uses.push_back(weight_copies::Use{w, key.to, e.uses == 1 && !e.other_use});
  }
  if (!uses.empty()) weight_copies::note_uses(uses);
  tls_cache.clear();
  handoff_clear();
}
size_t cache_len() { return tls_cache.size(); }

}  // namespace tch_amp::cast
