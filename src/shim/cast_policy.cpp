// O1's cast policy as libtorch dispatcher kernels.
//
// One boxed kernel per aten operator overload is registered at the AutocastCPU and
// AutocastCUDA dispatch keys, above autograd, so the casts it makes are recorded by autograd
// and every op a tch program runs passes through it, wherever the call comes from. The
// kernels live in torch::Library objects created by the first install and destroyed by the
// last remove, which hands the keys back to libtorch's own autocast kernels.
//
// What a kernel does is decided per call from the calling thread's active policy (a
// thread-local pointer set by the Rust side). A thread with no tch-amp policy gets exactly
// what it would get without tch-amp: libtorch's own autocast kernel for that op (captured
// before ours replaced it), or the fallthrough for ops libtorch does not list.
//
// The op lists are data (opt_levels/*.toml), resolved to overloads on the Rust side; this file
// only knows categories: low precision, fp32, promote, banned, and passthrough.
#include "amp_shim.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tch_amp::cast {
namespace {

enum class Category : uint8_t { Passthrough = 0, LowPrecision = 1, Fp32 = 2, Promote = 3, Banned = 4 };

// Index of a device type in per-device tables (0 = CPU, 1 = CUDA).
constexpr int kCpu = 0;
constexpr int kCuda = 1;
constexpr int kDevices = 2;

c10::DeviceType device_type_of(int dev) { return dev == kCpu ? c10::DeviceType::CPU : c10::DeviceType::CUDA; }
c10::DispatchKey autocast_key_of(int dev) {
  return dev == kCpu ? c10::DispatchKey::AutocastCPU : c10::DispatchKey::AutocastCUDA;
}

// A resolved policy: a category per registered op id and device, and the CPU emulation set.
// Immutable once built, shared between threads through shared_ptr.
struct Policy {
  std::vector<uint8_t> category[kDevices];
  std::vector<uint8_t> emulate;  // CPU only
  bool allow_banned = false;
  // CPU emulation on and no cast lists: the policy O2/O3 use for half models.
  bool emulation_only = false;
  // CPU emulation on and some cast lists: the same emulation set with no cast lists, under
  // which a cast op's internals run.
  std::shared_ptr<const Policy> inner;

  Category category_of(size_t id, int dev) const {
    const auto& v = category[dev];
    return id < v.size() ? static_cast<Category>(v[id]) : Category::Passthrough;
  }
  bool emulated(size_t id) const { return id < emulate.size() && emulate[id] != 0; }
};

// The calling thread's active policy (null: none).
thread_local std::shared_ptr<const Policy> tls_policy;

// ---------------------------------------------------------------------------------------------
// Weight-cast cache (per thread)
//
// Keyed by the source leaf's TensorImpl and the target dtype; the entry keeps a weak reference
// to the TensorImpl (so its address cannot be reused while the entry lives), the version
// counter at cast time (an in-place change of the weight forces a recast) and the cast tensor.
// Entries are stored only while grad mode is on, so a cast made under no_grad (which has no
// autograd edge back to the weight) never reaches a later training forward.
// ---------------------------------------------------------------------------------------------
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
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> source;
  uint32_t version;
  at::Tensor cast;
};
struct Cache {
  uint64_t generation = 0;
  std::unordered_map<CacheKey, CacheEntry, CacheKeyHash> entries;
};
thread_local Cache tls_cache;
// Bumped when the engine is removed: every thread's cache is dropped on its next use.
std::atomic<uint64_t> cache_generation{1};

Cache& cache() {
  uint64_t g = cache_generation.load(std::memory_order_acquire);
  if (tls_cache.generation != g) {
    tls_cache.entries.clear();
    tls_cache.generation = g;
  }
  return tls_cache;
}

bool is_low(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
bool is_managed_float(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat || t == at::kDouble;
}

// A tensor the kernel for `dev` may cast or count: defined, fp16/bf16/fp32/fp64, on that
// device type, and not a wrapped Python/Rust number (those follow type promotion, not casts).
bool eligible(const at::Tensor& t, int dev) {
  if (!t.defined() || !is_managed_float(t.scalar_type())) return false;
  if (t.unsafeGetTensorImpl()->is_wrapped_number()) return false;
  return dev == kCpu ? (t.is_cpu() || t.is_mkldnn()) : (t.is_cuda() || t.is_xla());
}

// Casts an eligible tensor to `to`; fp64 is never cast. Leaf tensors that require grad (model
// weights) go through the cache in both directions a policy casts them (fp32 -> fp16/bf16 for
// the low-precision list, fp16/bf16 -> fp32 for CPU emulation of a low-precision model).
at::Tensor cast_tensor(const at::Tensor& t, at::ScalarType to, int dev) {
  if (!eligible(t, dev)) return t;
  const auto from = t.scalar_type();
  if (from == to || from == at::kDouble) return t;
  const bool cacheable = ((from == at::kFloat && is_low(to)) || (is_low(from) && to == at::kFloat)) &&
                         t.requires_grad() && t.is_leaf() && !t.is_view() && !t.is_inference();
  if (!cacheable) return t.to(to);
  auto& c = cache();
  const CacheKey key{t.unsafeGetTensorImpl(), to};
  const uint32_t version = t._version();
  const bool grad_mode = c10::GradMode::is_enabled();
  auto it = c.entries.find(key);
  if (it != c.entries.end()) {
    const auto& e = it->second;
    // Under grad mode only an entry with an autograd edge back to the weight may be reused.
    if (e.version == version && (!grad_mode || e.cast.requires_grad())) return e.cast;
    c.entries.erase(it);
  }
  at::Tensor out = t.to(to);
  if (grad_mode) {
    c.entries.emplace(key, CacheEntry{c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>(
                                          t.getIntrusivePtr()),
                                      version, out});
  }
  return out;
}

// Applies `f` to every tensor among the last `n` stack entries (tensors, optional tensors,
// tensor lists and lists of optional tensors), replacing them with what `f` returns.
// `skip_first` leaves argument 0 alone (the self of an in-place op).
template <class F>
void map_tensor_args(torch::jit::Stack* stack, size_t n, bool skip_first, F&& f) {
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  for (size_t i = skip_first ? 1 : 0; i < n; ++i) {
    c10::IValue& v = first[static_cast<std::ptrdiff_t>(i)];
    if (v.isTensor()) {
      v = f(v.toTensor());
    } else if (v.isTensorList()) {
      auto in = v.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(in.size());
      for (const at::Tensor& t : in) out.push_back(f(t));
      v = std::move(out);
    } else if (v.isOptionalTensorList()) {
      auto in = v.toOptionalTensorList();
      c10::List<std::optional<at::Tensor>> out;
      out.reserve(in.size());
      for (const std::optional<at::Tensor>& t : in) {
        out.push_back(t.has_value() ? std::optional<at::Tensor>(f(*t)) : std::nullopt);
      }
      v = std::move(out);
    }
  }
}

// Calls `f` on every tensor among the last `n` stack entries without changing them.
template <class F>
void for_each_tensor_arg(const torch::jit::Stack* stack, size_t n, bool skip_first, F&& f) {
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  for (size_t i = skip_first ? 1 : 0; i < n; ++i) {
    const c10::IValue& v = first[static_cast<std::ptrdiff_t>(i)];
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) f(t);
    } else if (v.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        if (t.has_value()) f(*t);
      }
    }
  }
}

// "name" or "name.overload", without the "aten::" namespace.
std::string op_display(const c10::OperatorName& name) {
  std::string base = name.name.rfind("aten::", 0) == 0 ? name.name.substr(6) : name.name;
  return name.overload_name.empty() ? base : base + "." + name.overload_name;
}

// The boxed kernel registered for one op overload at one Autocast key.
class CastKernel final : public c10::OperatorKernel {
 public:
  CastKernel(size_t id, int dev, bool inplace, std::optional<c10::SafeKernelFunction> native)
      : id_(id), dev_(dev), inplace_(inplace), native_(std::move(native)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::DispatchKeySet below = ks - c10::autocast_dispatch_keyset;
    const Policy* policy = tls_policy.get();
    if (policy == nullptr) {
      // No tch-amp policy on this thread: behave exactly as libtorch would.
      if (native_.has_value()) {
        native_->callBoxed(op, ks, stack);
      } else {
        op.redispatchBoxed(below, stack);  // what libtorch's fallthrough does
      }
      return;
    }
    if (torch::autograd::get_current_graph_task_id() != -1) {
      // A backward pass running on this thread (CPU backward runs on the caller's thread):
      // Apex's casts never touched backward, so its ops run uncast, in the dtypes autograd
      // hands them (the forward's casts already fixed those).
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      op.redispatchBoxed(below, stack);
      return;
    }
    const Category cat = policy->category_of(id_, dev_);
    const bool emulate = dev_ == kCpu && !inplace_ && policy->emulated(id_);
    if (cat == Category::Passthrough && !emulate) {
      if (native_.has_value()) {
        // In libtorch's lists but not in this policy: run in the inputs' dtypes, as a
        // libtorch autocast kernel runs its op.
        run_below(op, below, stack, *policy);
      } else {
        op.redispatchBoxed(below, stack);  // registered for another policy: fall through
      }
      return;
    }
    const size_t nargs = op.schema().arguments().size();
    {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      if (inplace_) {
        apply_inplace_rule(op, cat, stack, nargs);
      } else {
        apply_category(op, cat, *policy, stack, nargs);
      }
      if (emulate) {
        run_emulated(op, below, stack, nargs);
        return;
      }
    }
    run_below(op, below, stack, *policy);
  }

 private:
  // Runs the op (its arguments already cast) below the Autocast keys. Without CPU emulation the
  // autocast keys are excluded inside it, as libtorch's autocast kernels do, so its internals
  // are not cast again. With CPU emulation on, a composite op (an LSTM cell, bilinear, einsum,
  // scaled_dot_product_attention, ...) runs instead under the policy's emulation-only twin:
  // its internals still get no casts, but their GEMMs and convolutions are emulated.
  void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack,
                 const Policy& policy) const {
    if (dev_ == kCpu && policy.emulation_only) {
      op.redispatchBoxed(below, stack);  // the thread's policy already is emulation-only
    } else if (dev_ == kCpu && policy.inner) {
      std::shared_ptr<const Policy> outer = tls_policy;
      struct Restore {
        std::shared_ptr<const Policy>& slot;
        std::shared_ptr<const Policy> saved;
        ~Restore() { slot = std::move(saved); }
      } restore{tls_policy, std::move(outer)};
      tls_policy = policy.inner;
      op.redispatchBoxed(below, stack);
    } else {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      op.redispatchBoxed(below, stack);
    }
  }

  // Apex's in-place rules: an fp32-list op in place on a low-precision self is an error (the
  // result could not be kept in fp32); any other listed in-place op casts its other operands
  // to self's dtype.
  void apply_inplace_rule(const c10::OperatorHandle& op, Category cat, torch::jit::Stack* stack,
                          size_t nargs) const {
    if (cat == Category::Passthrough || nargs == 0) return;
    const c10::IValue& self = *(stack->end() - static_cast<std::ptrdiff_t>(nargs));
    if (!self.isTensor() || !eligible(self.toTensor(), dev_)) return;
    const at::ScalarType self_type = self.toTensor().scalar_type();
    if ((cat == Category::Fp32 || cat == Category::Banned) && is_low(self_type)) {
      const std::string name = op_display(op.operator_name());
      std::string base = name.substr(0, name.find('.'));
      if (!base.empty() && base.back() == '_') base.pop_back();
      TORCH_CHECK(false, "tch-amp O1 [in-place fp32 op ", name, " on ", c10::toString(self_type),
                  "]: ", base, " runs in fp32 under O1, so it cannot write its result into a ",
                  c10::toString(self_type), " tensor in place; call the out-of-place ", base,
                  " (or cast the tensor to fp32 first)");
    }
    const int dev = dev_;
    map_tensor_args(stack, nargs, /*skip_first=*/true, [&](const at::Tensor& t) {
      return cast_tensor(t, self_type, dev);
    });
  }

  void apply_category(const c10::OperatorHandle& op, Category cat, const Policy& policy,
                      torch::jit::Stack* stack, size_t nargs) const {
    const int dev = dev_;
    switch (cat) {
      case Category::Passthrough:
        return;
      case Category::LowPrecision: {
        const at::ScalarType low = at::autocast::get_autocast_dtype(device_type_of(dev));
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) { return cast_tensor(t, low, dev); });
        return;
      }
      case Category::Banned: {
        bool any_low = false;
        for_each_tensor_arg(stack, nargs, false, [&](const at::Tensor& t) {
          if (eligible(t, dev) && is_low(t.scalar_type())) any_low = true;
        });
        if (any_low && !policy.allow_banned) {
          const std::string name = op_display(op.operator_name());
          TORCH_CHECK(false, "tch-amp O1 [banned op ", name, "]: ", name,
                      " is unsafe on fp16/bf16 inputs: its log saturates where a low-precision "
                      "sigmoid has rounded to 0 or 1. Models usually apply a sigmoid right before "
                      "it: feed the logits to binary_cross_entropy_with_logits (BCEWithLogitsLoss) "
                      "instead, which is safe and runs in fp32 under O1. If you really want it, "
                      "set allow_banned in the O1 settings: it then runs in fp32.");
        }
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) { return cast_tensor(t, at::kFloat, dev); });
        return;
      }
      case Category::Fp32:
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) { return cast_tensor(t, at::kFloat, dev); });
        return;
      case Category::Promote: {
        std::optional<at::ScalarType> widest;
        bool mixed = false;
        for_each_tensor_arg(stack, nargs, false, [&](const at::Tensor& t) {
          if (!eligible(t, dev)) return;
          const auto s = t.scalar_type();
          if (!widest.has_value()) {
            widest = s;
          } else if (*widest != s) {
            mixed = true;
            widest = c10::promoteTypes(*widest, s);
          }
        });
        if (!mixed) return;
        const at::ScalarType to = *widest;
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) {
          if (!eligible(t, dev) || t.scalar_type() == to) return t;
          return t.to(to);  // fp64 only ever widens here (it is the widest when present)
        });
        return;
      }
    }
  }

  // CPU low-precision emulation: when every floating input is the same 16-bit type D, compute
  // the op in fp32 from the (already rounded) inputs and round the floating outputs to D —
  // what a Tensor-Core GEMM does (fp16 in, fp32 accumulate, fp16 out). The casts are made
  // here, above autograd, so backward has the same rounding points.
  void run_emulated(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack,
                    size_t nargs) const {
    std::optional<at::ScalarType> low;
    bool uniform = true;
    for_each_tensor_arg(stack, nargs, false, [&](const at::Tensor& t) {
      if (!eligible(t, kCpu)) return;
      const auto s = t.scalar_type();
      if (!is_low(s) || (low.has_value() && *low != s)) uniform = false;
      low = s;
    });
    if (!uniform || !low.has_value()) {
      op.redispatchBoxed(below, stack);  // mixed or full-precision inputs: the native kernel decides
      return;
    }
    map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) { return cast_tensor(t, at::kFloat, kCpu); });
    op.redispatchBoxed(below, stack);
    const size_t nret = op.schema().returns().size();
    const at::ScalarType to = *low;
    auto first = stack->end() - static_cast<std::ptrdiff_t>(nret);
    for (size_t i = 0; i < nret; ++i) {
      c10::IValue& v = first[static_cast<std::ptrdiff_t>(i)];
      if (v.isTensor()) {
        const at::Tensor& t = v.toTensor();
        if (t.defined() && t.scalar_type() == at::kFloat) v = t.to(to);
      }
    }
  }

  size_t id_;
  int dev_;
  bool inplace_;
  std::optional<c10::SafeKernelFunction> native_;
};

// ---------------------------------------------------------------------------------------------
// Process-wide registration state
// ---------------------------------------------------------------------------------------------
struct Engine {
  std::mutex mu;
  // Op ids only grow for the life of the process, so a policy's tables stay valid.
  std::unordered_map<c10::OperatorName, size_t> ids;
  std::vector<c10::OperatorName> names;
  int installs = 0;
  std::vector<std::unique_ptr<torch::Library>> libraries;
  std::set<std::pair<size_t, int>> registered;  // (op id, device)
  // Ops libtorch (not tch-amp) registers at each Autocast key, captured at the first install.
  std::vector<c10::OperatorName> native_ops[kDevices];

  size_t id_of(const c10::OperatorName& name) {
    auto it = ids.find(name);
    if (it != ids.end()) return it->second;
    names.push_back(name);
    ids.emplace(name, names.size() - 1);
    return names.size() - 1;
  }
};
// Leaked on purpose: libraries must not be torn down after the dispatcher at process exit.
Engine& engine() {
  static Engine* e = new Engine();
  return *e;
}

// Swallows libtorch's one-time "Overriding a previously registered kernel" warning (and any
// other) while tch-amp registers, so it never reaches the user's output.
struct SilentWarnings final : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

bool has_out_argument(const c10::FunctionSchema& s) {
  for (const auto& a : s.arguments()) {
    if (a.is_out()) return true;
  }
  return false;
}

bool is_inplace(const c10::FunctionSchema& s) {
  const std::string& n = s.name();
  if (n.empty() || n.back() != '_' || s.arguments().empty()) return false;
  const auto* alias = s.arguments()[0].alias_info();
  return alias != nullptr && alias->isWrite();
}

std::vector<c10::OperatorName> enumerate_native(int dev) {
  std::vector<c10::OperatorName> out;
  const auto key = autocast_key_of(dev);
  for (const auto& name : c10::Dispatcher::singleton().getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto op = c10::Dispatcher::singleton().findOp(name);
    if (op.has_value() && op->hasKernelForDispatchKey(key)) out.push_back(name);
  }
  return out;
}

char* dup_string(const std::string& s) { return strdup(s.c_str()); }

// Holder handed to Rust for an installed policy.
struct PolicyBox {
  std::shared_ptr<const Policy> policy;
};

// Parses the install spec, registers what is missing and builds the policy (see
// tch_amp_cast_policy_install).
void install(const char* spec, bool allow_banned, void** out) {
  *out = nullptr;
  struct Line {
    int dev;
    std::string cat;
    c10::OperatorName name;
  };
  std::vector<Line> lines;
  {
    std::istringstream in(spec);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      std::vector<std::string> f;
      size_t start = 0;
      for (;;) {
        size_t tab = line.find('\t', start);
        f.push_back(line.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
        if (tab == std::string::npos) break;
        start = tab + 1;
      }
      TORCH_CHECK(f.size() == 4, "malformed cast-policy line: ", line);
      TORCH_CHECK(f[0] == "cpu" || f[0] == "cuda", "unknown device in cast-policy line: ", line);
      lines.push_back(Line{f[0] == "cpu" ? kCpu : kCuda, f[1], c10::OperatorName("aten::" + f[2], f[3])});
    }
  }

  auto& e = engine();
  std::lock_guard<std::mutex> lock(e.mu);
  if (e.installs == 0) {
    for (int dev = 0; dev < kDevices; ++dev) e.native_ops[dev] = enumerate_native(dev);
  }

  // What this policy needs registered, per device: its own ops and all of libtorch's.
  std::vector<std::pair<c10::OperatorName, int>> wanted;
  for (const auto& l : lines) wanted.emplace_back(l.name, l.dev);
  for (int dev = 0; dev < kDevices; ++dev) {
    for (const auto& n : e.native_ops[dev]) wanted.emplace_back(n, dev);
  }

  std::unique_ptr<torch::Library> libs[kDevices];
  std::vector<std::pair<size_t, int>> added;
  {
    SilentWarnings silent;
    c10::WarningUtils::WarningHandlerGuard guard(&silent);
    for (const auto& [name, dev] : wanted) {
      auto op = c10::Dispatcher::singleton().findOp(name);
      TORCH_CHECK(op.has_value() && op->hasSchema(), "unknown aten op ", op_display(name));
      const size_t id = e.id_of(name);
      if (e.registered.count({id, dev}) > 0) continue;
      bool already = false;
      for (const auto& a : added) already = already || (a.first == id && a.second == dev);
      if (already) continue;
      TORCH_CHECK(!has_out_argument(op->schema()), "tch-amp does not cast out= overloads: ",
                  op_display(name));
      const auto key = autocast_key_of(dev);
      std::optional<c10::SafeKernelFunction> native;
      if (op->hasKernelForDispatchKey(key)) native.emplace(op->getComputedKernelForDispatchKey(key));
      if (!libs[dev]) {
        libs[dev] = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
      }
      const std::string display = op_display(name);
      libs[dev]->impl(display.c_str(),
                      torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CastKernel>(
                          id, dev, is_inplace(op->schema()), std::move(native))));
      added.emplace_back(id, dev);
    }
  }

  auto policy = std::make_shared<Policy>();
  policy->allow_banned = allow_banned;
  const size_t n = e.names.size();
  for (int dev = 0; dev < kDevices; ++dev) policy->category[dev].assign(n, 0);
  policy->emulate.assign(n, 0);
  for (const auto& l : lines) {
    const size_t id = e.id_of(l.name);
    Category c;
    if (l.cat == "emulate") {
      TORCH_CHECK(l.dev == kCpu, "emulation is CPU-only: ", op_display(l.name));
      policy->emulate[id] = 1;
      continue;
    } else if (l.cat == "low") {
      c = Category::LowPrecision;
    } else if (l.cat == "fp32") {
      c = Category::Fp32;
    } else if (l.cat == "promote") {
      c = Category::Promote;
    } else if (l.cat == "banned") {
      c = Category::Banned;
    } else {
      TORCH_CHECK(false, "unknown cast category ", l.cat);
    }
    policy->category[l.dev][id] = static_cast<uint8_t>(c);
  }

  bool any_emulated = false, any_category = false;
  for (uint8_t v : policy->emulate) any_emulated = any_emulated || v != 0;
  for (int dev = 0; dev < kDevices; ++dev) {
    for (uint8_t v : policy->category[dev]) any_category = any_category || v != 0;
  }
  if (any_emulated && !any_category) {
    policy->emulation_only = true;
  } else if (any_emulated) {
    auto inner = std::make_shared<Policy>();
    for (int dev = 0; dev < kDevices; ++dev) inner->category[dev].assign(n, 0);
    inner->emulate = policy->emulate;
    inner->emulation_only = true;
    policy->inner = std::move(inner);
  }

  // Commit: keep the new libraries and count the install.
  for (int dev = 0; dev < kDevices; ++dev) {
    if (libs[dev]) e.libraries.push_back(std::move(libs[dev]));
  }
  for (const auto& a : added) e.registered.insert(a);
  e.installs += 1;
  *out = new PolicyBox{std::move(policy)};
}

}  // namespace
}  // namespace tch_amp::cast

using namespace tch_amp::cast;

extern "C" {

// Lists the overloads of aten::<name> that a cast list may name: every overload without an
// `out=` argument, one per line ("" for the unnamed overload). *count = how many.
char* tch_amp_aten_overloads(const char* name, int* count, char** out) {
  TCH_AMP_PROTECT({
    *count = 0;
    *out = nullptr;
    const std::string full = std::string("aten::") + name;
    std::vector<std::string> overloads;
    for (const auto& op_name : c10::Dispatcher::singleton().getAllOpNames()) {
      if (op_name.name != full) continue;
      auto op = c10::Dispatcher::singleton().findOp(op_name);
      if (!op.has_value() || !op->hasSchema() || has_out_argument(op->schema())) continue;
      overloads.push_back(op_name.overload_name);
    }
    std::sort(overloads.begin(), overloads.end());
    std::ostringstream s;
    for (size_t i = 0; i < overloads.size(); ++i) s << (i ? "\n" : "") << overloads[i];
    *count = static_cast<int>(overloads.size());
    *out = dup_string(s.str());
  })
}

// The aten ops libtorch itself registers at the Autocast key of `device_type` (c10 code: 0 CPU,
// 1 CUDA), one "name[.overload]" per line, sorted. While tch-amp is installed this is the list
// captured before tch-amp registered its own kernels.
char* tch_amp_libtorch_autocast_ops(int device_type, char** out) {
  TCH_AMP_PROTECT({
    *out = nullptr;
    TORCH_CHECK(device_type == 0 || device_type == 1, "device type must be CPU (0) or CUDA (1)");
    const int dev = device_type == 0 ? kCpu : kCuda;
    std::vector<c10::OperatorName> ops;
    {
      auto& e = engine();
      std::lock_guard<std::mutex> lock(e.mu);
      ops = e.installs > 0 ? e.native_ops[dev] : enumerate_native(dev);
    }
    std::vector<std::string> names;
    for (const auto& n : ops) names.push_back(op_display(n));
    std::sort(names.begin(), names.end());
    std::ostringstream s;
    for (size_t i = 0; i < names.size(); ++i) s << (i ? "\n" : "") << names[i];
    *out = dup_string(s.str());
  })
}

// Installs a policy. `spec` has one op per line: "<cpu|cuda>\t<low|fp32|promote|banned|emulate>\t
// <name>\t<overload>" (overload may be empty). The first install registers tch-amp's kernels
// for every listed op and every op libtorch registers at AutocastCPU/AutocastCUDA; later
// installs add kernels for ops not registered yet. *out receives the policy handle.
char* tch_amp_cast_policy_install(const char* spec, int allow_banned, void** out) {
  TCH_AMP_PROTECT(install(spec, allow_banned != 0, out))
}

// Drops an installed policy. The last one unregisters every tch-amp kernel (libtorch's own
// autocast kernels are in force again) and invalidates every thread's cast cache.
char* tch_amp_cast_policy_remove(void* handle) {
  TCH_AMP_PROTECT({
    delete static_cast<PolicyBox*>(handle);
    auto& e = engine();
    std::lock_guard<std::mutex> lock(e.mu);
    if (e.installs > 0 && --e.installs == 0) {
      SilentWarnings silent;
      c10::WarningUtils::WarningHandlerGuard guard(&silent);
      e.libraries.clear();
      e.registered.clear();
      cache_generation.fetch_add(1, std::memory_order_acq_rel);
      tls_cache.entries.clear();
    }
  })
}

// Whether at least one policy is installed.
char* tch_amp_cast_policy_installed(int* installed) {
  TCH_AMP_PROTECT({
    auto& e = engine();
    std::lock_guard<std::mutex> lock(e.mu);
    *installed = e.installs > 0 ? 1 : 0;
  })
}

// Makes `handle`'s policy (NULL: none) the calling thread's policy. *saved receives the previous
// state, to be handed to tch_amp_cast_policy_restore exactly once.
char* tch_amp_cast_policy_activate(void* handle, void** saved) {
  TCH_AMP_PROTECT({
    *saved = new PolicyBox{tls_policy};
    tls_policy = handle != nullptr ? static_cast<PolicyBox*>(handle)->policy : nullptr;
  })
}

// Restores the state saved by tch_amp_cast_policy_activate; *none_active = 1 when the thread is
// left with no policy.
char* tch_amp_cast_policy_restore(void* saved, int* none_active) {
  TCH_AMP_PROTECT({
    auto* box = static_cast<PolicyBox*>(saved);
    tls_policy = box->policy;
    delete box;
    *none_active = tls_policy ? 0 : 1;
  })
}

// Whether the calling thread has a tch-amp policy active.
char* tch_amp_cast_policy_active(int* active) { TCH_AMP_PROTECT(*active = tls_policy ? 1 : 0) }

// Empties the calling thread's weight-cast cache.
char* tch_amp_cast_cache_clear() { TCH_AMP_PROTECT(cache().entries.clear()) }

// Number of entries in the calling thread's weight-cast cache.
char* tch_amp_cast_cache_len(size_t* len) { TCH_AMP_PROTECT(*len = cache().entries.size()) }

}  // extern "C"
