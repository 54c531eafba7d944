// The CPU emulation of one fp16/bf16 op (a GEMM, a convolution, attention): computed in fp32 on
// exact fp32 copies of its 16-bit inputs, each floating output rounded once, so that backward
// keeps the 16-bit inputs, not the fp32 copies: the bytes libtorch's native 16-bit kernel
// keeps (docs/cpu_emulation.md).
//
// The graph autograd records is the graph of the casts written out, with one node for the op:
//   16-bit input --(fp32 copy: autograd's own cast node)--> x32 --[EmulatedBackward]--> 16-bit output
// so backward has the casts' rounding points (incoming gradients converted to fp32, the fp32 op's
// own autograd formulas, each input's fp32 gradient rounded once by the cast node, where the
// gradients of all uses of that copy add up first). What differs: the fp32 copies x32 that this
// file makes (not a 16-bit weight's, which the cast cache shares between uses) lose their
// storage once the forward is done, and get it back, converted again from the kept 16-bit
// inputs (exact, so the same values), while backward needs them. EmulatedBackward's backward:
// - replay (GEMMs, convolutions): the forward recorded the fp32 op's autograd graph on aliases
//   of the fp32 copies; backward runs that graph, the gradient of the input with the largest
//   copy last and alone (these ops are linear in each input, so that copy stays empty
//   meanwhile). Nothing is computed twice.
// - recompute (attention, matmul, whose fp32 graphs keep fp32 intermediates of their own): the
//   forward recorded nothing; backward reruns the fp32 op under autograd and differentiates it.
//   A random call (a nonzero dropout_p) replays instead.
// A backward that records a graph itself (create_graph) recomputes on the fp32 copies
// themselves, which then keep their storage, so that double backward reaches the same cast
// nodes as the first-order gradients (their fp32 sums are rounded once, as without emulation).
#include "cast_policy.h"

#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace tch_amp::cast {
namespace {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::Node;
using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// libtorch holds autograd nodes in c10::intrusive_ptr (2.13) or std::shared_ptr (earlier).
using NodePtr = decltype(Edge::function);
template <class T, class... A>
NodePtr make_node(A&&... args) {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    return std::make_shared<T>(std::forward<A>(args)...);
  } else {
    return c10::make_intrusive<T>(std::forward<A>(args)...);
  }
}

// One defined tensor argument of the emulated op, as the op sees it: an fp32 copy of a 16-bit
// tensor, or any other tensor (a mask) unchanged.
struct Input {
  size_t position = 0;     // its index among the op's arguments
  bool requires_grad = false;
  SavedVariable saved;     // what the op received (the fp32 copy, or the tensor itself)
  // An fp32 copy this file made (`owned`): the 16-bit tensor it was made from, and whether its
  // storage holds its data now.
  bool owned = false;
  SavedVariable source;
  at::Tensor copy;         // the copy itself, kept to refill its storage
  bool filled = true;
  // Replay: the alias of the copy the forward's graph was recorded on, and the edge by which a
  // gradient leaves that graph.
  Edge inner_edge;
};

class EmulatedBackward final : public Node {
 public:
  EmulatedBackward(c10::OperatorHandle op, bool recompute, bool per_input)
      : op_(std::move(op)), recompute_(recompute), per_input_(per_input) {}

  std::string name() const override { return "tch_amp::EmulatedBackward(" + op_display(op_.operator_name()) + ")"; }

  void release_variables() override {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& in : inputs_) {
      in.saved.reset_data();
      in.source.reset_data();
      in.copy = at::Tensor();
      in.inner_edge = Edge();
    }
    roots_.clear();
    released_ = true;
  }

  variable_list apply(variable_list&& grads) override {
    std::lock_guard<std::mutex> lock(mu_);
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    variable_list out(inputs_.size());
    bool wanted = false;
    for (size_t i = 0; i < inputs_.size(); ++i) wanted |= inputs_[i].requires_grad && task_should_compute_output(i);
    bool any_grad = false;
    for (const auto& g : grads) any_grad |= g.defined();
    if (!wanted || !any_grad) return out;
    TORCH_CHECK(!released_, torch::autograd::ERR_BACKWARD_TWICE);
    // The outputs were rounded from fp32: their gradients go back to fp32 (as a cast's do).
    variable_list g32(grads.size());
    for (size_t j = 0; j < grads.size(); ++j) {
      if (grads[j].defined()) g32[j] = grads[j].to(at::kFloat);
      grads[j] = at::Tensor();  // the engine hands its reference over: the 16-bit gradient goes
    }
    const bool create_graph = c10::GradMode::is_enabled();
    if (create_graph) pinned_ = true;  // the gradients' graph reads the copies from now on
    struct Empty {
      EmulatedBackward& node;
      ~Empty() {
        if (!node.pinned_) {
          for (auto& in : node.inputs_) node.empty(in);
        }
      }
    } empty_again{*this};
    if (!create_graph && !recompute_) return replay(g32);
    for (auto& in : inputs_) refill(in);
    return recompute(g32, create_graph);
  }

  // Builds the node for the op's arguments (the top `nargs` entries of `stack`, every eligible
  // floating one of type `low`), runs the op in fp32 and leaves its outputs, rounded to `low`
  // and attached to the node, on the stack.
  static void run(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack, size_t nargs,
                  at::ScalarType low, bool recompute, bool per_input) {
    auto first = stack->end() - static_cast<std::ptrdiff_t>(nargs);
    std::vector<c10::IValue> args(first, stack->end());
    torch::jit::drop(*stack, nargs);
    std::vector<Input> inputs;
    edge_list next;
    for (size_t i = 0; i < nargs; ++i) {
      c10::IValue& v = args[i];
      if (!v.isTensor() || !v.toTensor().defined()) continue;
      const at::Tensor t = v.toTensor();
      Input in;
      in.position = i;
      at::Tensor x = t;
      if (eligible(t, kCpu) && t.scalar_type() == low) {
        // A 16-bit weight's copy comes from the cast cache, shared by its uses in this forward
        // (and kept by the cache); any other's is made here, recorded by autograd as a cast.
        in.owned = !cacheable_weight(t);
        x = cast_tensor(t, at::kFloat, kCpu);
        if (in.owned) {
          in.source = SavedVariable(t, /*is_output=*/false);
          in.copy = x;
        }
      }
      in.requires_grad = x.requires_grad();
      next.push_back(in.requires_grad ? torch::autograd::impl::gradient_edge(x) : Edge());
      in.saved = SavedVariable(x, /*is_output=*/false);
      v = x;
      inputs.push_back(std::move(in));
    }
    NodePtr node_ptr = make_node<EmulatedBackward>(op, recompute, per_input);
    auto* node = static_cast<EmulatedBackward*>(node_ptr.get());
    node->set_next_edges(std::move(next));
    node->inputs_ = std::move(inputs);

    // The op on aliases of its inputs: leaves, so that the graph it records (replay) ends at
    // them; none is recorded for recompute.
    {
      std::optional<at::NoGradGuard> no_grad;
      if (recompute) no_grad.emplace();
      for (auto& in : node->inputs_) {
        at::Tensor alias = args[in.position].toTensor().detach();
        if (!recompute && in.requires_grad) {
          alias.requires_grad_(true);
          in.inner_edge = torch::autograd::impl::gradient_edge(alias);
        }
        args[in.position] = alias;
      }
      for (const c10::IValue& v : args) stack->push_back(v);
      op.redispatchBoxed(below, stack);
    }
    // Only the non-tensor arguments stay; the tensors are saved variables.
    for (const auto& in : node->inputs_) args[in.position] = c10::IValue();
    node->args_ = std::move(args);
    for (auto& in : node->inputs_) node->empty(in);

    const size_t nret = op.schema().returns().size();
    auto ret = stack->end() - static_cast<std::ptrdiff_t>(nret);
    for (size_t j = 0; j < nret; ++j) {
      c10::IValue& v = ret[static_cast<std::ptrdiff_t>(j)];
      if (!v.isTensor() || !v.toTensor().defined() || v.toTensor().scalar_type() != at::kFloat) continue;
      const at::Tensor y32 = v.toTensor();
      node->roots_.push_back(y32.requires_grad() ? torch::autograd::impl::gradient_edge(y32) : Edge());
      at::Tensor y;
      {
        at::NoGradGuard no_grad;
        y = y32.detach().to(low);
      }
      torch::autograd::set_history(y, node_ptr);
      v = y;
    }
  }

 private:
  // The bytes of an fp32 copy this file made go (the forward's graph keeps aliases and views of
  // the same storage, so they all lose them); `refill` brings them back. The storage keeps its
  // size, so that views can still be made of it (a 1-d convolution's backward views its input
  // as 2-d); reading its data meanwhile is libtorch's "data is not allocated" error.
  void empty(Input& in) {
    if (!in.owned || !in.filled || !in.copy.defined()) return;
    c10::StorageImpl* s = in.copy.storage().unsafeGetStorageImpl();
    s->set_data_ptr_noswap(c10::DataPtr(nullptr, s->device()));
    in.filled = false;
  }

  void refill(Input& in) {
    if (!in.owned || in.filled) return;
    at::Tensor fresh;
    {
      at::NoGradGuard no_grad;
      fresh = in.source.unpack().detach().to(at::kFloat);
    }
    c10::StorageImpl* s = in.copy.storage().unsafeGetStorageImpl();
    c10::StorageImpl* f = fresh.storage().unsafeGetStorageImpl();
    TORCH_INTERNAL_ASSERT(fresh.strides() == in.copy.strides() && fresh.storage_offset() == in.copy.storage_offset() &&
                              f->nbytes() == s->nbytes(),
                          "tch-amp emulation: the fp32 copy of a kept input changed layout");
    s->set_data_ptr_noswap(std::move(f->mutable_data_ptr()));
    in.filled = true;
  }

  // The forward's graph, run again on the refilled copies. For ops linear in each input (GEMMs,
  // convolutions: `per_input_`), the gradient of one input never reads that input, so the
  // gradient of the input with the largest copy is computed last, alone, with that copy empty:
  // its fp32 copy and its fp32 gradient never take memory at once. Otherwise (a random
  // attention call) one run computes all.
  variable_list replay(const variable_list& g32) {
    variable_list out(inputs_.size());
    edge_list roots;
    variable_list root_grads;
    for (size_t j = 0; j < roots_.size(); ++j) {
      if (g32[j].defined() && roots_[j].is_valid()) {
        roots.push_back(roots_[j]);
        root_grads.push_back(g32[j]);
      }
    }
    std::vector<size_t> wanted;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      if (inputs_[i].requires_grad && task_should_compute_output(i) && inputs_[i].inner_edge.is_valid()) {
        wanted.push_back(i);
      }
    }
    if (roots.empty() || wanted.empty()) return out;
    auto run = [&](const std::vector<size_t>& which) {
      edge_list edges;
      for (size_t i : which) edges.push_back(inputs_[i].inner_edge);
      variable_list grads = torch::autograd::Engine::get_default_engine().execute(
          roots, root_grads, /*keep_graph=*/true, /*create_graph=*/false, /*accumulate_grad=*/false, edges);
      for (size_t k = 0; k < which.size(); ++k) out[which[k]] = grads[k];
    };
    // The largest copy's gradient last, alone, with that copy empty.
    auto bytes = [&](size_t i) { return inputs_[i].owned ? inputs_[i].copy.storage().nbytes() : size_t{0}; };
    const auto largest = std::max_element(wanted.begin(), wanted.end(), [&](size_t a, size_t b) { return bytes(a) < bytes(b); });
    if (!per_input_ || bytes(*largest) == 0) {
      for (auto& in : inputs_) refill(in);
      run(wanted);
      return out;
    }
    const size_t last = *largest;
    wanted.erase(largest);
    for (auto& in : inputs_) refill(in);
    if (!wanted.empty()) run(wanted);
    empty(inputs_[last]);
    run({last});
    return out;
  }

  // The fp32 op run again (its inputs refilled) under autograd, and differentiated. With
  // `create_graph`, on the inputs themselves, so that the gradients' graph reaches them.
  variable_list recompute(const variable_list& g32, bool create_graph) {
    at::AutoGradMode grad_on(true);
    variable_list leaves(inputs_.size());
    torch::jit::Stack stack(args_.begin(), args_.end());
    for (size_t i = 0; i < inputs_.size(); ++i) {
      Input& in = inputs_[i];
      at::Tensor x = in.saved.unpack();
      if (!create_graph) {
        x = x.detach();
        if (in.requires_grad && task_should_compute_output(i)) x.requires_grad_(true);
      }
      leaves[i] = x;
      stack[in.position] = x;
    }
    op_.callBoxed(&stack);
    variable_list outputs, grad_outputs;
    size_t j = 0;
    for (const c10::IValue& v : stack) {
      if (!v.isTensor() || !v.toTensor().defined() || v.toTensor().scalar_type() != at::kFloat) continue;
      const at::Tensor& y32 = v.toTensor();
      if (j < g32.size() && g32[j].defined() && y32.requires_grad()) {
        outputs.push_back(y32);
        grad_outputs.push_back(g32[j]);
      }
      ++j;
    }
    variable_list out(inputs_.size());
    variable_list wrt;
    std::vector<size_t> index;
    for (size_t i = 0; i < inputs_.size(); ++i) {
      if (inputs_[i].requires_grad && task_should_compute_output(i) && leaves[i].requires_grad()) {
        wrt.push_back(leaves[i]);
        index.push_back(i);
      }
    }
    if (outputs.empty() || wrt.empty()) return out;
    variable_list grads = torch::autograd::grad(outputs, wrt, grad_outputs, /*retain_graph=*/create_graph, create_graph,
                                                /*allow_unused=*/true);
    for (size_t k = 0; k < index.size(); ++k) out[index[k]] = grads[k];
    return out;
  }

  std::mutex mu_;
  c10::OperatorHandle op_;
  bool recompute_;
  bool per_input_;  // linear in each input: replay computes one input's gradient at a time
  bool released_ = false;
  bool pinned_ = false;  // a create_graph backward ran: the copies keep their storage
  // The op's arguments; its tensor arguments (the inputs) are left out, kept as saved variables.
  std::vector<c10::IValue> args_;
  std::vector<Input> inputs_;
  std::vector<Edge> roots_;  // replay: one per floating output, in output order
};

}  // namespace

void run_emulated_op(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack, size_t nargs,
                     at::ScalarType low, bool recompute) {
  auto first = stack->end() - static_cast<std::ptrdiff_t>(nargs);
  bool needs_graph = false, lists = false;
  for (auto it = first; it != stack->end(); ++it) {
    if (it->isTensor()) {
      const at::Tensor& t = it->toTensor();
      needs_graph |= t.defined() && t.requires_grad();
    } else if (it->isTensorList() || it->isOptionalTensorList()) {
      lists = true;
    }
  }
  if (needs_graph && !lists && c10::GradMode::is_enabled()) {
    // The replayed ops are linear in each input; the recomputed ones are not, and a random one
    // (attention with dropout) cannot be recomputed: it replays all its inputs at once.
    const bool per_input = !recompute;
    const auto& schema_args = op.schema().arguments();
    for (size_t i = 0; i < nargs && i < schema_args.size(); ++i) {
      const c10::IValue& v = first[static_cast<std::ptrdiff_t>(i)];
      if (schema_args[i].name() == "dropout_p" && v.isDouble() && v.toDouble() != 0.0) recompute = false;
    }
    EmulatedBackward::run(op, below, stack, nargs, low, recompute, per_input);
    return;
  }
  // Nothing to differentiate (or tensor lists, which no listed op takes): convert, compute,
  // round, with any graph recorded as it comes.
  for (auto it = first; it != stack->end(); ++it) {
    if (it->isTensor()) {
      *it = cast_tensor(it->toTensor(), at::kFloat, kCpu);
    } else if (it->isTensorList()) {
      c10::List<at::Tensor> out;
      for (const at::Tensor& t : it->toTensorList()) out.push_back(cast_tensor(t, at::kFloat, kCpu));
      *it = std::move(out);
    } else if (it->isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> out;
      for (const std::optional<at::Tensor>& t : it->toOptionalTensorList()) {
        out.push_back(t.has_value() ? std::optional<at::Tensor>(cast_tensor(*t, at::kFloat, kCpu)) : std::nullopt);
      }
      *it = std::move(out);
    }
  }
  op.redispatchBoxed(below, stack);
  const size_t nret = op.schema().returns().size();
  auto ret = stack->end() - static_cast<std::ptrdiff_t>(nret);
  for (size_t j = 0; j < nret; ++j) {
    c10::IValue& v = ret[static_cast<std::ptrdiff_t>(j)];
    if (v.isTensor() && v.toTensor().defined() && v.toTensor().scalar_type() == at::kFloat) v = v.toTensor().to(low);
  }
}

}  // namespace tch_amp::cast
