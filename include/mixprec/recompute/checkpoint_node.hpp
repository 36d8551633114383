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
// when the parameters the block reaches are not known yet: hence a Node of our own. Before and
// after the recompute it checks that the block takes the first run's path (same_run.hpp).

#include <mixprec/core/autograd_function.hpp>
#include <mixprec/core/error.hpp>
#include <mixprec/core/recompute_state.hpp>
#include <mixprec/recompute/recorded_state.hpp>
#include <mixprec/recompute/same_run.hpp>

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
/// run of a block reaches from `outputs`, each once, in the order found; the nodes the block made
/// go into `shape`. An Error for a node the block did not make that is not its inputs' either: a
/// tensor with a gradient history from outside the block, read by it without being one of its
/// inputs.
inline edge_list reached_leaves(const variable_list& outputs, const BlockInputs& inputs,
                                const BlockSpan& span, GraphShape& shape) {
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
    shape.add(*node);
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
  GraphShape graph;
};

/// Those of `outputs` that require grad: the checkpoint node's inputs, in order.
inline variable_list requiring_grad_only(const variable_list& outputs) {
  variable_list kept;
  for (const auto& out : outputs) {
    if (out.defined() && out.requires_grad()) kept.push_back(out);
  }
  return kept;
}

/// Runs the block of a checkpoint; `run(inputs)` calls it on one run's input aliases and
/// returns its outputs flattened.
using BlockFunction = std::function<variable_list(const variable_list&)>;

/// The checkpoint's node in the caller's graph: one input per output of the block that requires
/// grad, one output per edge: the block's inputs that require grad, then the leaves it reached.
class CheckpointNode final : public torch::autograd::Node {
 public:
  /// `inputs` as the block was given them, with their versions then and whether each needs a
  /// gradient; the leaves of its first run and what that run leaves to check the recompute
  /// against (`first`; `modes`: a Checkpointed module's); `buffers`: the buffers the block may
  /// update in place, put back after the recompute as they were before it.
  CheckpointNode(BlockFunction block, variable_list inputs, std::vector<std::int64_t> versions,
                 std::vector<bool> grad, RecordedState state, edge_list leaves, RunRecord first,
                 std::vector<at::Tensor> buffers, BlockName name, ModuleModes modes)
      : block_(std::move(block)),
        inputs_(std::move(inputs)),
        versions_(std::move(versions)),
        grad_(std::move(grad)),
        state_(std::move(state)),
        leaves_(std::move(leaves)),
        first_(std::move(first)),
        buffers_(std::move(buffers)),
        name_(std::move(name)),
        modes_(std::move(modes)) {
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
    check_unchanged();
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
      run.graph.reserve_like(first_.graph);
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
      run.leaves = reached_leaves(run.outputs, inputs, span, run.graph);
    }
    check_same_run(run);
    // A block may update a parameter in place itself (an embedding's max_norm): what it left is
    // what a second recompute (retain_graph) starts from.
    first_.versions = leaf_versions(leaves_);
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
  // Before the recompute: what it reads is as the first run left it (its inputs, the parameters
  // it reached, a Checkpointed module's modes).
  void check_unchanged() const {
    for (std::size_t i = 0; i < inputs_.size(); ++i) {
      const auto& t = inputs_[i];
      MIXPREC_CHECK(!t.defined() || t._version() == versions_[i], "input ", i, " (shape ",
                    t.sizes(), ") of checkpointed ", name_.describe(), " was modified in place "
                    "after the block ran (its version went from ", versions_[i], " to ",
                    t._version(), "): the recompute in backward would read the new values. "
                    "Modify a copy (x.clone()), or do it before the block");
    }
    const auto versions = leaf_versions(leaves_);
    for (std::size_t i = 0; i < versions.size(); ++i) {
      if (versions[i] == first_.versions[i]) continue;
      const auto& p =
          static_cast<const torch::autograd::AccumulateGrad&>(*leaves_[i].function).variable;
      const auto path = modes_.parameter_name(p);
      fail("parameter ", path.empty() ? "" : "'" + path + "' ", "(shape ", p.sizes(), ", ",
           p.scalar_type(), ") of checkpointed ", name_.describe(), " was modified in place "
           "between the forward pass and backward (its version went from ", first_.versions[i],
           " to ", versions[i], "; an optimizer step, a weight update): the recompute would read "
           "the new values and the gradients be those of another computation. Call backward() "
           "before changing the parameters, as without checkpointing (where autograd refuses "
           "it for a weight it saved)");
    }
    const auto changed = modes_.changes();
    MIXPREC_CHECK(changed.empty(), "checkpointed ", name_.describe(), ": ", changed, ". The "
                  "recompute in backward would run in the new mode (Dropout, BatchNorm and any "
                  "forward that reads is_training() compute otherwise) and the gradients be "
                  "those of another computation. Switch modes after backward() (train() again "
                  "before backward, or eval() after it)");
  }

  // After it: the recompute took the first run's path (the same outputs, parameters and graph)
  // and computed the same values where they were sampled.
  void check_same_run(const BlockRun& run) const {
    const auto outputs = requiring_grad_only(run.outputs);
    bool same = outputs.size() == first_.outputs.size() && run.leaves.size() == leaves_.size();
    for (std::size_t i = 0; same && i < outputs.size(); ++i) {
      same = TensorMeta::of(outputs[i]) == first_.outputs[i];
    }
    for (std::size_t i = 0; same && i < leaves_.size(); ++i) {
      same = run.leaves[i].function == leaves_[i].function;
    }
    MIXPREC_CHECK(same, "checkpointed ", name_.describe(), " computed something else when "
                  "recomputed in backward than in its forward pass (", outputs.size(), " outputs "
                  "that require grad and ", run.leaves.size(), " parameters reached, against ",
                  first_.outputs.size(), " and ", leaves_.size(), ", or other shapes or dtypes): "
                  "what it computes must depend only on its inputs, its modules and the random "
                  "state, which the recompute replays; not on state that changes between the two "
                  "runs");
    MIXPREC_CHECK(run.graph == first_.graph, "checkpointed ", name_.describe(), " took another "
                  "path when recomputed in backward than in its forward pass: ",
                  first_.graph.difference(run.graph), ". The common cause is a module switched "
                  "to eval() or train() between the forward pass and backward (Dropout, "
                  "BatchNorm): switch modes after backward(). Otherwise the block depends on "
                  "state that changed between the two runs (a flag, a size it reads), which it "
                  "must not: the gradients would be those of another computation");
    const auto values = first_.sample.difference(outputs);
    MIXPREC_CHECK(values.empty(), "checkpointed ", name_.describe(), " computed other values "
                  "when recomputed in backward than in its forward pass (", values, "), with the "
                  "same ops on the same shapes: it reads something that changed between the two "
                  "runs, such as a module switched to eval() or train() (BatchNorm), a number it "
                  "captured by reference or reads from a module (a scale, a temperature), a "
                  "tensor it captured that was modified since, or a random generator of its own. "
                  "The gradients would be those of the new values. Change such state after "
                  "backward(); capture by value, pass tensors as arguments");
  }

  BlockFunction block_;
  variable_list inputs_;
  std::vector<std::int64_t> versions_;
  std::vector<bool> grad_;
  RecordedState state_;
  edge_list leaves_;
  RunRecord first_;
  std::vector<at::Tensor> buffers_;
  BlockName name_;
  ModuleModes modes_;
};

}  // namespace mixprec::detail
