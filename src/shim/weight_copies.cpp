// The registry of O1's rounded weight copies (see weight_copies.h). Process-wide, behind one
// mutex: it is touched once per weight per forward and per step. Keyed by the weight's
// TensorImpl; an entry holds a weak reference to it, so its address is not reused while the
// entry lives, and the version counter at which the copy was written: a weight changed in
// place since (a user's edit, a checkpoint load) is rounded again.
#include "amp_shim.h"
#include "weight_copies.h"

#include <atomic>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace tch_amp::weight_copies {
namespace {

using Weak = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

struct Entry {
  explicit Entry(Weak s) : source(std::move(s)) {}
  Weak source;
  at::ScalarType low = at::kHalf;
  bool single = false;
  bool has_copy = false;
  uint32_t version = 0;
  at::Tensor copy;
};

struct Registry {
  std::mutex mu;
  std::unordered_map<const c10::TensorImpl*, Entry> entries;
};
Registry& registry() {
  static Registry* r = new Registry();  // leaked: used until process exit
  return *r;
}

// On by default: with the rounding nodes' gradients rounded in place, the MLP's O1 step is
// 0.25-0.5 ms faster with them in most runs, for 4 bytes per weight element (BENCHMARKS.md).
std::atomic<bool> on{true};
// Per thread: a forward runs on its caller's thread.
thread_local int64_t served = 0, rounded = 0, demoted = 0, in_place = 0;

bool usable(const at::Tensor& w) {
  return w.defined() && w.is_cpu() && w.scalar_type() == at::kFloat && w.layout() == at::kStrided;
}

// `w`'s entry when it holds a copy written at `w`'s current version (the lock held).
const Entry* current_entry(Registry& r, const at::Tensor& w) {
  auto it = r.entries.find(w.unsafeGetTensorImpl());
  if (it == r.entries.end()) return nullptr;
  const Entry& e = it->second;
  return e.has_copy && e.version == w._version() && e.copy.sizes().equals(w.sizes()) ? &e : nullptr;
}

}  // namespace

bool set_enabled(bool v) {
  const bool prev = on.exchange(v);
  if (!v) {
    // The copies go; the record of uses stays (the rounding nodes do not depend on copies).
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (auto& [impl, e] : r.entries) {
      e.has_copy = false;
      e.copy = at::Tensor();
    }
  }
  return prev;
}
bool enabled() { return on.load(std::memory_order_relaxed); }

void note_uses(const std::vector<Use>& uses) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  for (const Use& u : uses) {
    if (!usable(u.weight)) continue;
    auto it = r.entries.find(u.weight.unsafeGetTensorImpl());
    if (it == r.entries.end()) {
      it = r.entries.emplace(u.weight.unsafeGetTensorImpl(), Entry(Weak(u.weight.getIntrusivePtr()))).first;
    }
    Entry& e = it->second;
    if (!u.single || e.low != u.low) {
      e.has_copy = false;
      e.copy = at::Tensor();
    }
    e.single = u.single;
    e.low = u.low;
  }
  for (auto it = r.entries.begin(); it != r.entries.end();) {
    it = it->second.source.expired() ? r.entries.erase(it) : std::next(it);
  }
}

bool single_use(const at::Tensor& w, at::ScalarType low) {
  if (!usable(w)) return false;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(w.unsafeGetTensorImpl());
  return it != r.entries.end() && it->second.single && it->second.low == low;
}

at::Tensor lookup(const at::Tensor& w, at::ScalarType low) {
  if (!enabled() || !usable(w)) return at::Tensor();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const Entry* e = current_entry(r, w);
  if (e == nullptr || e->low != low) return at::Tensor();
  ++served;
  return e->copy;
}

std::optional<std::pair<at::ScalarType, at::Tensor>> wanted(const at::Tensor& w) {
  if (!enabled() || !usable(w) || !w.is_contiguous()) return std::nullopt;
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(w.unsafeGetTensorImpl());
  if (it == r.entries.end() || !it->second.single) return std::nullopt;
  Entry& e = it->second;
  at::Tensor buf;
  // The previous copy is overwritten only when no tensor but the registry's shares its storage
  // (a graph still holding it keeps its values; it gets a new buffer instead).
  if (e.copy.defined() && e.copy.sizes().equals(w.sizes()) && e.copy.is_contiguous() &&
      e.copy.storage().use_count() == 1 && e.copy.use_count() == 1) {
    buf = e.copy;
  } else {
    buf = at::empty(w.sizes(), w.options().requires_grad(false));
  }
  e.has_copy = false;
  e.copy = at::Tensor();
  return std::make_pair(e.low, buf);
}

void store(const at::Tensor& w, at::ScalarType low, const at::Tensor& copy) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  auto it = r.entries.find(w.unsafeGetTensorImpl());
  if (it == r.entries.end() || it->second.low != low) return;
  it->second.copy = copy;
  it->second.has_copy = true;
  it->second.version = w._version();
}

at::Tensor current(const at::Tensor& w) {
  if (!usable(w)) return at::Tensor();
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  const Entry* e = current_entry(r, w);
  return e != nullptr ? e->copy.detach() : at::Tensor();
}

void note_demoted() { ++demoted; }
void note_rounded() { ++rounded; }
void note_rounded_in_place() { ++in_place; }

Stats stats() {
  Stats s;
  {
    auto& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const auto& [impl, e] : r.entries) {
      // A dead weight's copy counts until the next forward's note_uses lets it go.
      if (e.has_copy) {
        ++s.copies;
        s.bytes += static_cast<int64_t>(e.copy.nbytes());
      }
    }
  }
  s.served = served;
  s.rounded = rounded;
  s.demoted = demoted;
  s.in_place = in_place;
  return s;
}

}  // namespace tch_amp::weight_copies

using namespace tch_amp::weight_copies;

extern "C" {

// Turns O1's rounded weight copies on or off (process-wide); *previous receives the old setting.
char* tch_amp_o1_weight_copies_set(int enabled_, int* previous) {
  TCH_AMP_PROTECT(*previous = set_enabled(enabled_ != 0) ? 1 : 0)
}

// *out receives a new handle to `w`'s rounded copy when one is current (NULL otherwise).
char* tch_amp_o1_weight_copy(at::Tensor* w, at::Tensor** out) {
  TCH_AMP_PROTECT({
    *out = nullptr;
    at::Tensor c = current(*w);
    if (c.defined()) *out = new at::Tensor(std::move(c));
  })
}

// out[0] copies kept, [1] their bytes; on the calling thread: [2] forward uses served from a
// copy, [3] forward uses given one rounding node without a copy, [4] weights given one that
// the same forward used again, [5] gradients its backward rounded in place.
char* tch_amp_o1_weight_copies_stats(int64_t* out) {
  TCH_AMP_PROTECT({
    const Stats s = stats();
    out[0] = s.copies;
    out[1] = s.bytes;
    out[2] = s.served;
    out[3] = s.rounded;
    out[4] = s.demoted;
    out[5] = s.in_place;
  })
}

}  // extern "C"
