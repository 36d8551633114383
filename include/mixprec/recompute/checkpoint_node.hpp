#pragma once
// The autograd machinery of an activation checkpoint (checkpoint.hpp is the API): a block runs
// once with grad on its inputs' detached aliases, the graph it built is walked for the leaves it
// reached (its parameters) and then dropped, with every activation it saved; its outputs join
// the caller's graph through one CheckpointNode whose edges lead to the inputs and those
// parameters. In backward the node replays the block (recorded_state.hpp) and backpropagates
// through the fresh graph, capturing the gradients at the inputs and parameters; the engine then
// hands the parameters' to their gradient accumulators, so that their hooks (data parallel's
// buckets) fire as without the checkpoint.
//
// LibTorch's C++ API has no saved-tensor hooks for C++ code (Python's non-reentrant checkpoint
// is built on them), and a torch::autograd::Function fixes its edges before its forward runs,
// when the parameters the block reaches are not known yet: hence a Node of our own.

#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/recompute_state.hpp>
#include <mixprec/recompute/recorded_state.hpp>

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <ATen/record_function.h>
#include <c10/util/irange.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/variable.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <unordered_set>
#include <utility>
#include <vector>

namespace mixprec::detail {

using torch::autograd::Edge;
using torch::autograd::edge_list;
using torch::autograd::variable_list;

/// Where a block's graph ends at its inputs: their aliases for one run are outputs of this node,
/// and the gradients that reach it are captured there. It has no edges (the block's backward
/// cannot run on into the caller's graph), but for a double backward, whose second pass must
/// reach the inputs: then it leads to them and passes the gradients on.
struct CheckpointInputs final : torch::autograd::Node {
  explicit CheckpointInputs(edge_list edges = {}) : torch::autograd::Node(std::move(edges)) {}
  variable_list apply(variable_list&& grads) override {
    return num_outputs() == grads.size() ? std::move(grads) : variable_list(num_outputs());
  }
  std::string name() const override { return "mixprec::CheckpointInputs"; }
};

/// Whether each of `tensors` requires grad (an undefined one does not).
inline std::vector<bool> requiring_grad(const variable_list& tensors) {
  std::vector<bool> flags;
  for (const auto& t : tensors) flags.push_back(t.defined() && t.requires_grad());
  return flags;
}

/// One run's inputs: an alias of each of `originals` (undefined stays undefined) that shares its
/// data and version counter, those flagged in `grad` ending the graph at a new CheckpointInputs
/// node, so that the block's graph never reaches past its inputs.
struct BlockInputs {
  variable_list tensors;
  AutogradNodePtr node;

  static BlockInputs alias(const variable_list& originals, const std::vector<bool>& grad,
                           bool connected = false) {
    edge_list edges;
    for (std::size_t i = 0; connected && i < originals.size(); ++i) {
      if (grad[i]) edges.push_back(torch::autograd::impl::gradient_edge(originals[i]));
    }
    BlockInputs inputs{{}, make_autograd_node<CheckpointInputs>(std::move(edges))};
    for (std::size_t i = 0; i < originals.size(); ++i) {
      auto alias = originals[i].defined() ? originals[i].detach() : at::Tensor();
      if (grad[i]) torch::autograd::set_history(alias, inputs.node);
      inputs.tensors.push_back(std::move(alias));
    }
    return inputs;
  }

  /// The edges at which the inputs' gradients are captured, for those that require grad.
  edge_list edges() const {
    edge_list result;
    for (const auto& t : tensors) {
      if (t.defined() && t.requires_grad()) result.push_back(torch::autograd::impl::gradient_edge(t));
    }
    return result;
  }
};

/// Which graph nodes one run of a block made: those this thread created since `first` (the
/// sequence number when the block began).
struct BlockSpan {
  std::uint64_t first = at::sequence_number::peek();
  std::uint64_t thread = at::RecordFunction::currentThreadId();

  bool contains(const torch::autograd::Node& node) const {
    return node.thread_id() == thread && node.sequence_nr() >= first &&
           node.sequence_nr() != std::numeric_limits<std::uint64_t>::max();
  }
};

/// The gradient accumulators (of parameters, or of any leaf that requires grad) the graph of one
/// run of a block reaches from `outputs`, each once, in the order found. An Error for a node the
/// block did not make that is not its inputs' either: a tensor with a gradient history from
/// outside the block, read by it without being one of its inputs.
inline edge_list reached_leaves(const variable_list& outputs, const BlockInputs& inputs,
                                const BlockSpan& span) {
  edge_list leaves;
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<torch::autograd::Node*> stack;
  const auto follow = [&](const Edge& edge) {
    auto* node = edge.function.get();
    if (node == nullptr || node == inputs.node.get() || !seen.insert(node).second) return;
    if (dynamic_cast<torch::autograd::AccumulateGrad*>(node) != nullptr) {
      leaves.push_back(edge);
    } else if (span.contains(*node)) {
      stack.push_back(node);
    } else {
      fail("the checkpointed block reads a tensor computed outside it that requires grad (its "
           "grad_fn is ", node->name(), ") without taking it as an input: its gradient could "
           "not flow back through the recompute. Pass it to the block as an argument "
           "(mixprec::checkpoint(fn, x, that_tensor), or a forward argument of a Checkpointed "
           "module)");
    }
  };
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad()) follow(torch::autograd::impl::gradient_edge(out));
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    for (const auto& edge : node->next_edges()) follow(edge);
  }
  return leaves;
}

/// Whether the graph behind `tensors` reaches one of `leaves`: a block input computed from a
/// parameter the block also uses (a tied weight).
inline bool history_reaches(const variable_list& tensors, const edge_list& leaves) {
  std::unordered_set<const torch::autograd::Node*> targets, seen;
  for (const auto& leaf : leaves) targets.insert(leaf.function.get());
  std::vector<torch::autograd::Node*> stack;
  for (const auto& t : tensors) {
    if (t.defined() && t.requires_grad()) {
      stack.push_back(torch::autograd::impl::gradient_edge(t).function.get());
    }
  }
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (targets.count(node) != 0) return true;
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
  return false;
}

/// What one run of the block produced: its outputs (flattened) with their graph.
struct BlockRun {
  variable_list outputs;
  edge_list leaves;
};

/// Runs the block of a checkpoint; `run(inputs)` calls it on one run's input aliases and
/// returns its outputs flattened.
using BlockFunction = std::function<variable_list(const variable_list&)>;

/// The checkpoint's node in the caller's graph: one input per output of the block that requires
/// grad, one output per edge: the block's inputs that require grad, then the leaves it reached.
class CheckpointNode final : public torch::autograd::Node {
 public:
  struct Output {
    std::vector<std::int64_t> sizes;
    c10::ScalarType dtype;
    c10::Device device;
  };

  /// `inputs` as the block was given them, with their versions then and whether each needs a
  /// gradient; the leaves and outputs (those that require grad) of its first run; `buffers`: the
  /// buffers the block may update in place, put back after the recompute as they were before it.
  CheckpointNode(BlockFunction block, variable_list inputs, std::vector<std::int64_t> versions,
                 std::vector<bool> grad, RecordedState state, edge_list leaves,
                 std::vector<Output> outputs, std::vector<at::Tensor> buffers)
      : block_(std::move(block)),
        inputs_(std::move(inputs)),
        versions_(std::move(versions)),
        grad_(std::move(grad)),
        state_(std::move(state)),
        leaves_(std::move(leaves)),
        outputs_(std::move(outputs)),
        buffers_(std::move(buffers)) {
    edge_list edges;
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      if (grad_[i]) edges.push_back(torch::autograd::impl::gradient_edge(inputs_[i]));
    }
    edges.insert(edges.end(), leaves_.begin(), leaves_.end());
    set_next_edges(std::move(edges));
  }

  std::string name() const override { return "mixprec::CheckpointBackward"; }

  void release_variables() override {
    block_ = nullptr;
    inputs_.clear();
    buffers_.clear();
  }

  variable_list apply(variable_list&& grads) override {
    MIXPREC_CHECK(block_ != nullptr, "backward through a checkpointed block a second time: its "
                  "inputs were released after the first backward; pass retain_graph=true to "
                  "the first, as without the checkpoint");
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      const auto& t = inputs_[i];
      MIXPREC_CHECK(!t.defined() || t._version() == versions_[i], "input ", i, " (shape ",
                    t.sizes(), ") of a checkpointed block was modified in place after the "
                    "block ran (its version went from ", versions_[i], " to ", t._version(),
                    "): the recompute in backward would read the new values. Modify a copy "
                    "(x.clone()), or do it before the block");
    }
    // A double backward (create_graph): the gradients returned carry the recomputed graph, and
    // its second pass must reach the inputs through their aliases; the recompute's own backward
    // must still stop at them, which it cannot where the inputs' history reaches a parameter
    // the block uses (the engine would run on into it).
    const bool create_graph = at::GradMode::is_enabled();
    MIXPREC_CHECK(!create_graph || !history_reaches(inputs_, leaves_), "a double backward "
                  "(create_graph=true) through a checkpointed block whose input was computed "
                  "from a parameter the block also uses (a tied weight) is not supported: "
                  "take that part out of the block, or do not checkpoint it");
    auto inputs = BlockInputs::alias(inputs_, grad_, /*connected=*/create_graph);
    BlockRun run;
    {
      const CheckpointPassGuard pass(CheckpointPass::recompute);
      const Replay replay(state_);
      std::vector<at::Tensor> saved;
      for (const auto& b : buffers_) saved.push_back(b.clone());
      const at::AutoGradMode grad(true);
      const BlockSpan span;
      try {
        run.outputs = block_(inputs.tensors);
      } catch (...) {  // a run that catches this and goes on keeps one update of the statistics
        const at::AutoDispatchBelowADInplaceOrView below_autograd;
        for (std::size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved[i]);
        throw;
      }
      // Put back as BatchNorm's kernels update them: without bumping the version counter, which
      // the recomputed graph (and any other holding these buffers) has saved and checks.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      for (std::size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved[i]);
      run.leaves = reached_leaves(run.outputs, inputs, span);
    }
    check_same_run(run);
    // Backpropagate the gradients of the outputs that have one, through the fresh graph only.
    edge_list roots;
    variable_list root_grads;
    std::size_t k = 0;
    for (const auto& out : run.outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      if (k < grads.size() && grads[k].defined()) {
        roots.push_back(torch::autograd::impl::gradient_edge(out));
        root_grads.push_back(grads[k]);
      }
      ++k;
    }
    if (roots.empty()) return variable_list(num_outputs());
    auto captured = inputs.edges();
    captured.insert(captured.end(), leaves_.begin(), leaves_.end());
    return torch::autograd::Engine::get_default_engine().execute(
        roots, root_grads, /*keep_graph=*/create_graph, create_graph, /*accumulate_grad=*/false,
        captured);
  }

 private:
  // The recompute must take the first run's path: the same outputs and parameters.
  void check_same_run(const BlockRun& run) const {
    std::vector<Output> outputs;
    for (const auto& out : run.outputs) {
      if (out.defined() && out.requires_grad()) {
        outputs.push_back({out.sizes().vec(), out.scalar_type(), out.device()});
      }
    }
    bool same = outputs.size() == outputs_.size() && run.leaves.size() == leaves_.size();
    for (std::size_t i = 0; same && i < outputs.size(); ++i) {
      same = outputs[i].sizes == outputs_[i].sizes && outputs[i].dtype == outputs_[i].dtype &&
             outputs[i].device == outputs_[i].device;
    }
    for (std::size_t i = 0; same && i < leaves_.size(); ++i) {
      same = run.leaves[i].function == leaves_[i].function;
    }
    MIXPREC_CHECK(same, "a checkpointed block computed something else when recomputed in "
                  "backward than in its forward pass (", outputs.size(), " outputs that require "
                  "grad and ", run.leaves.size(), " parameters reached, against ",
                  outputs_.size(), " and ", leaves_.size(), ", or other shapes or dtypes): what "
                  "it computes must depend only on its inputs, its modules and the random state, "
                  "which the recompute replays; not on state that changes between the two runs");
  }

  BlockFunction block_;
  variable_list inputs_;
  std::vector<std::int64_t> versions_;
  std::vector<bool> grad_;
  RecordedState state_;
  edge_list leaves_;
  std::vector<Output> outputs_;
  std::vector<at::Tensor> buffers_;
};

}  // namespace mixprec::detail
