// The process-wide side of O1's cast engine: the registration of tch-amp's kernels at the
// AutocastCPU / AutocastCUDA keys, and the policies threads activate.
//
// Kernels are registered once per op overload and never unregistered while the process runs:
// libtorch does not synchronise changes of its dispatch tables with ops running on other
// threads, so tch-amp changes them as rarely as possible. The first install registers every
// op it is given (the Rust side adds the standard lists to the first install) and every op
// libtorch registers at the Autocast keys; a later install only registers ops it names that
// are not registered yet (user casts of new ops). Creating or dropping a policy afterwards
// only changes which policy a thread has active: a thread with none gets libtorch's own
// behaviour, exactly.
#include "amp_shim.h"
#include "cast_policy.h"

#include <algorithm>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

namespace tch_amp::cast {

thread_local std::shared_ptr<const Policy> tls_policy;

namespace {

struct Engine {
  std::mutex mu;
  // Op ids only grow for the life of the process, so a policy's tables stay valid.
  std::unordered_map<c10::OperatorName, size_t> ids;
  std::vector<c10::OperatorName> names;
  // Never destroyed: the registrations live as long as the process.
  std::vector<std::unique_ptr<torch::Library>> libraries;
  std::set<std::pair<size_t, int>> registered;  // (op id, device)
  // Ops libtorch (not tch-amp) registers at each Autocast key, captured before the first
  // registration.
  bool natives_captured = false;
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

// Holder handed to Rust for a policy (installed, or saved at activation).
struct PolicyBox {
  std::shared_ptr<const Policy> policy;
};

struct Entry {
  int dev;
  int category;
  c10::OperatorName name;
  uint8_t emulate;
};

// Registers (once) what `entries` and libtorch's own Autocast ops need, then builds the policy.
void install(const tch_amp_cast_entry* raw, int n, bool allow_banned, bool torch_autocast, void** out) {
  *out = nullptr;
  TORCH_CHECK(n >= 0 && (n == 0 || raw != nullptr), "invalid cast-policy entry list");
  std::vector<Entry> entries;
  entries.reserve(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) {
    const auto& r = raw[i];
    TORCH_CHECK(r.device == kCpu || r.device == kCuda, "cast-policy entry ", i, ": unknown device index ", r.device);
    TORCH_CHECK(r.category >= 0 && r.category <= kEmulate, "cast-policy entry ", i, ": unknown category ", r.category);
    TORCH_CHECK(r.name != nullptr && r.overload != nullptr, "cast-policy entry ", i, ": null op name");
    TORCH_CHECK(r.category != kEmulate || r.device == kCpu, "emulation is CPU-only: ", r.name);
    constexpr int all_bits = kEmulateHalf | kEmulateBFloat16 | kEmulateRecompute;
    TORCH_CHECK(r.category == kEmulate ? (r.emulate & (kEmulateHalf | kEmulateBFloat16)) != 0 &&
                                             (r.emulate & ~all_bits) == 0
                                       : r.emulate == 0,
                "cast-policy entry ", i, ": invalid emulation bits ", r.emulate);
    entries.push_back(Entry{r.device, r.category, c10::OperatorName(std::string("aten::") + r.name, r.overload),
                            static_cast<uint8_t>(r.emulate)});
  }

  auto& e = engine();
  std::lock_guard<std::mutex> lock(e.mu);
  if (!e.natives_captured) {
    for (int dev = 0; dev < kDevices; ++dev) e.native_ops[dev] = enumerate_native(dev);
    e.natives_captured = true;
  }

  // What must be registered, per device: the entries' ops and all of libtorch's.
  std::vector<std::pair<c10::OperatorName, int>> wanted;
  for (const auto& en : entries) wanted.emplace_back(en.name, en.dev);
  for (int dev = 0; dev < kDevices; ++dev) {
    for (const auto& nm : e.native_ops[dev]) wanted.emplace_back(nm, dev);
  }
  // Check everything first: a bad entry registers nothing.
  std::vector<std::pair<size_t, int>> missing;
  for (const auto& [name, dev] : wanted) {
    auto op = c10::Dispatcher::singleton().findOp(name);
    TORCH_CHECK(op.has_value() && op->hasSchema(), "unknown aten op ", op_display(name));
    TORCH_CHECK(!has_out_argument(op->schema()), "tch-amp does not cast out= overloads: ", op_display(name));
    const size_t id = e.id_of(name);
    if (e.registered.count({id, dev}) == 0 &&
        std::find(missing.begin(), missing.end(), std::make_pair(id, dev)) == missing.end()) {
      missing.emplace_back(id, dev);
    }
  }
  if (!missing.empty()) {
    SilentWarnings silent;
    c10::WarningUtils::WarningHandlerGuard guard(&silent);
    std::unique_ptr<torch::Library> libs[kDevices];
    for (const auto& [id, dev] : missing) {
      const auto& name = e.names[id];
      auto op = c10::Dispatcher::singleton().findOp(name);
      const auto key = autocast_key_of(dev);
      std::optional<c10::SafeKernelFunction> native;
      if (op->hasKernelForDispatchKey(key)) native.emplace(op->getComputedKernelForDispatchKey(key));
      if (!libs[dev]) {
        libs[dev] = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
      }
      const std::string display = op_display(name);
      libs[dev]->impl(display.c_str(), make_cast_kernel(id, dev, is_inplace(op->schema()), std::move(native)));
      e.registered.insert({id, dev});
    }
    for (auto& lib : libs) {
      if (lib) e.libraries.push_back(std::move(lib));
    }
  }

  auto policy = std::make_shared<Policy>();
  policy->allow_banned = allow_banned;
  policy->torch_autocast = torch_autocast;
  const size_t count = e.names.size();
  for (int dev = 0; dev < kDevices; ++dev) policy->category[dev].assign(count, 0);
  policy->emulate.assign(count, 0);
  bool any_emulated = false, any_category = false;
  for (const auto& en : entries) {
    const size_t id = e.id_of(en.name);
    if (en.category == kEmulate) {
      policy->emulate[id] = en.emulate;
      any_emulated = true;
    } else if (en.category != static_cast<int>(Category::Passthrough)) {
      policy->category[en.dev][id] = static_cast<uint8_t>(en.category);
      any_category = true;
    }
  }
  if (any_emulated && !any_category) {
    policy->emulation_only = true;
  } else if (any_emulated && !torch_autocast) {
    // The inner policy of a cast op's internals. Torch autocast needs none: its composites run
    // libtorch's own kernels, which exclude the Autocast keys inside.
    auto inner = std::make_shared<Policy>();
    for (int dev = 0; dev < kDevices; ++dev) inner->category[dev].assign(count, 0);
    inner->emulate = policy->emulate;
    inner->emulation_only = true;
    policy->inner = std::move(inner);
  }
  *out = new PolicyBox{std::move(policy)};
}

}  // namespace
}  // namespace tch_amp::cast

using namespace tch_amp::cast;

extern "C" {

// Calls `sink` with each overload of aten::<name> that a cast list may name: every overload
// without an `out=` argument ("" for the unnamed overload), sorted.
char* tch_amp_aten_overloads(const char* name, void* ctx, tch_amp_string_sink sink) {
  TCH_AMP_PROTECT({
    const std::string full = std::string("aten::") + name;
    std::vector<std::string> overloads;
    for (const auto& op_name : c10::Dispatcher::singleton().getAllOpNames()) {
      if (op_name.name != full) continue;
      auto op = c10::Dispatcher::singleton().findOp(op_name);
      if (!op.has_value() || !op->hasSchema() || has_out_argument(op->schema())) continue;
      overloads.push_back(op_name.overload_name);
    }
    std::sort(overloads.begin(), overloads.end());
    for (const auto& o : overloads) sink(ctx, o.c_str());
  })
}

// Calls `sink` with each aten op ("name[.overload]") libtorch itself registers at the Autocast
// key of `dev` (kCpu or kCuda), sorted. Once tch-amp has registered, this is the list captured
// before it did.
char* tch_amp_libtorch_autocast_ops(int dev, void* ctx, tch_amp_string_sink sink) {
  TCH_AMP_PROTECT({
    TORCH_CHECK(dev == kCpu || dev == kCuda, "device index must be CPU (0) or CUDA (1)");
    std::vector<c10::OperatorName> ops;
    {
      auto& e = engine();
      std::lock_guard<std::mutex> lock(e.mu);
      ops = e.natives_captured ? e.native_ops[dev] : enumerate_native(dev);
    }
    std::vector<std::string> names;
    names.reserve(ops.size());
    for (const auto& n : ops) names.push_back(op_display(n));
    std::sort(names.begin(), names.end());
    for (const auto& n : names) sink(ctx, n.c_str());
  })
}

// Builds a policy from `n` entries (registering what is not registered yet); `torch_autocast`
// makes it torch.amp's autocast with CPU emulation (Policy::torch_autocast).
// *out receives its handle, to be released with tch_amp_cast_policy_release.
char* tch_amp_cast_policy_install(const tch_amp_cast_entry* entries, int n, int allow_banned, int torch_autocast,
                                  void** out) {
  TCH_AMP_PROTECT(install(entries, n, allow_banned != 0, torch_autocast != 0, out))
}

// Releases a policy handle. The registrations stay (see the top of this file).
char* tch_amp_cast_policy_release(void* handle) { TCH_AMP_PROTECT(delete static_cast<PolicyBox*>(handle)) }

// Whether tch-amp's kernels are registered in this process (they stay once they are).
char* tch_amp_cast_kernels_registered(int* registered) {
  TCH_AMP_PROTECT({
    auto& e = engine();
    std::lock_guard<std::mutex> lock(e.mu);
    *registered = e.libraries.empty() ? 0 : 1;
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

// Which policy the calling thread has active: 0 none, 1 a cast policy (Apex's lists, or the
// emulation of O2/O3), 2 torch.amp's autocast with CPU emulation.
char* tch_amp_cast_policy_active(int* active) {
  TCH_AMP_PROTECT(*active = !tls_policy ? 0 : (tls_policy->torch_autocast ? 2 : 1))
}

// Empties the calling thread's weight-cast cache.
char* tch_amp_cast_cache_clear() { TCH_AMP_PROTECT(cache_clear()) }

// Number of entries in the calling thread's weight-cast cache.
char* tch_amp_cast_cache_len(size_t* len) { TCH_AMP_PROTECT(*len = cache_len()) }

// How many ops the calling thread has emulated in fp32 with fp16 / bf16 inputs.
char* tch_amp_cast_emulated_count(uint64_t* half, uint64_t* bfloat16) {
  TCH_AMP_PROTECT({
    *half = emulated_count(at::kHalf);
    *bfloat16 = emulated_count(at::kBFloat16);
  })
}

// Takes the calling thread's last refusal: *code 0 when there is none; otherwise *op and
// *message are strdup'd strings the caller frees with tch_amp_free_error.
char* tch_amp_cast_take_refusal(int* code, int* dtype, char** op, char** message) {
  TCH_AMP_PROTECT({
    Refusal r = take_refusal();
    *code = static_cast<int>(r.code);
    *dtype = static_cast<int>(r.dtype);
    *op = r.code == RefusalCode::None ? nullptr : strdup(r.op.c_str());
    *message = r.code == RefusalCode::None ? nullptr : strdup(r.message.c_str());
  })
}

}  // extern "C"
