// Activation checkpointing (recompute/): mixprec::checkpoint and nn::Checkpointed give the same
// outputs, gradients and training runs as without them, bit for bit, under every policy; the
// recompute replays autocast, random state and precision regions; buffers update once; bad
// input is an Error; and against Python's torch.utils.checkpoint(use_reentrant=False).
#include <mixprec/mixprec.hpp>

#include "scaled_policy.hpp"
#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace test_recompute {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;
using test::identical;

namespace {

// A block as users write one: Linear, BatchNorm, ReLU, dropout, Linear, then a residual and
// LayerNorm. Float8Linear computes as mixprec::nn::Linear (F.linear) but under MixedFP8.
struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(std::int64_t d = 32)
      : fc1(register_module("fc1", mp::nn::Float8Linear(d, d))),
        norm(register_module("norm", torch::nn::BatchNorm1d(d))),
        drop(register_module("drop", torch::nn::Dropout(0.25))),
        fc2(register_module("fc2", mp::nn::Float8Linear(d, d))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})))) {}
  at::Tensor forward(const at::Tensor& x) {
    return ln(x + fc2(drop(torch::relu(norm(fc1(x))))));
  }
  mp::nn::Float8Linear fc1;
  torch::nn::BatchNorm1d norm;
  torch::nn::Dropout drop;
  mp::nn::Float8Linear fc2;
  torch::nn::LayerNorm ln;
};
TORCH_MODULE(Block);

// Two blocks that apply_checkpointing can checkpoint, between an input layer and a head.
// tests/recompute/parity_checkpoint.py has its twin.
struct NetImpl : torch::nn::Module {
  NetImpl() : in(register_module("in", mp::nn::Float8Linear(16, 32))),
              head(register_module("head", mp::nn::Float8Linear(32, 4))) {
    blocks = register_module("blocks", torch::nn::ModuleList());
    for (int i = 0; i < 2; ++i) blocks->push_back(mp::nn::Checkpointed<Block>(32));
  }
  at::Tensor forward(const at::Tensor& x) {
    auto h = in(x);
    for (const auto& block : *blocks) h = block->as<mp::nn::CheckpointedImpl<Block>>()->forward(h);
    return head(h);
  }
  mp::nn::Float8Linear in;
  torch::nn::ModuleList blocks;
  mp::nn::Float8Linear head;
};
TORCH_MODULE(Net);

// Every tensor a run leaves: parameters, buffers, and (given) masters and fp8 scaling state.
std::vector<at::Tensor> state_of(torch::nn::Module& model) {
  std::vector<at::Tensor> tensors;
  for (const auto& p : model.parameters()) tensors.push_back(p.detach().clone());
  for (const auto& b : model.buffers()) tensors.push_back(b.clone());
  return tensors;
}

double largest_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double m = 0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) {
    m = std::max(m, (a[i].to(at::kDouble) - b[i].to(at::kDouble)).abs().max().item<double>());
  }
  return m;
}

struct Outcome {
  std::vector<at::Tensor> tensors;
  double scale = 0;
  std::int64_t skipped = 0;
  std::vector<double> losses;
};

// Trainer<P> on Net, `steps` optimizer steps of `accumulation` micro-batches each, with the two
// blocks checkpointed or not; the same weights, data and dropout stream either way.
template <class P>
Outcome train(bool checkpointed, int steps = 3, int accumulation = 2) {
  torch::manual_seed(3);
  Net net;
  if (checkpointed) CHECK(mp::apply_checkpointing(net, {"blocks.*"}).size() == 2);
  torch::optim::AdamW adamw(net->parameters(), torch::optim::AdamWOptions(1e-2));
  auto options = mp::TrainerOptions().accumulation_steps(accumulation).max_grad_norm(1.0);
  if constexpr (std::is_same_v<typename P::scaler_type, mp::GradScaler>) {
    // fp16 overflows at first: the steps skipped and the scale's backoffs must agree too. (bf16
    // has fp32's range: its scale grows, which must agree.)
    options.scaler(mp::GradScalerOptions().init_scale(std::ldexp(1.0, 40)).growth_interval(2));
  }
  mp::Trainer<P> trainer(net, adamw, options);
  torch::manual_seed(5);
  const auto x = torch::randn({steps * accumulation * 16, 16});
  const auto y = torch::randint(0, 4, {steps * accumulation * 16}, torch::kLong);
  torch::manual_seed(11);  // dropout's stream
  Outcome outcome;
  for (int k = 0; k < steps * accumulation; ++k) {
    const auto xb = x.narrow(0, k * 16, 16), yb = y.narrow(0, k * 16, 16);
    const auto report = trainer.step([&] {
      auto out = net->forward(trainer.cast_input(xb));
      return torch::nn::functional::cross_entropy(out.to(at::kFloat), yb);
    });
    outcome.losses.push_back(report.loss.template item<double>());
  }
  outcome.tensors = state_of(*net);
  for (const auto& m : trainer.master_weights()) outcome.tensors.push_back(m.clone());
  for (const auto& module : net->modules()) {
    auto* layer = dynamic_cast<mp::nn::Float8LinearImpl*>(module.get());
    if (layer == nullptr || !layer->computes_fp8() || !layer->fp8_state()->delayed()) continue;
    for (const auto role : {mp::Fp8Role::input, mp::Fp8Role::weight, mp::Fp8Role::grad_output}) {
      outcome.tensors.push_back(layer->fp8_state()->slot(role).history.clone());
      outcome.tensors.push_back(layer->fp8_state()->slot(role).scale.clone());
    }
  }
  outcome.scale = trainer.stats().scale;
  outcome.skipped = trainer.stats().skipped_steps;
  return outcome;
}

template <class P>
void check_policy_bitwise() {
  const auto plain = train<P>(false);
  const auto checkpointed = train<P>(true);
  REQUIRE(plain.tensors.size() == checkpointed.tensors.size());
  std::size_t differing = 0;
  for (std::size_t i = 0; i < plain.tensors.size(); ++i) {
    if (!identical(plain.tensors[i], checkpointed.tensors[i])) ++differing;
  }
  MESSAGE(P::name << ": " << plain.tensors.size() << " tensors (parameters, buffers, masters, "
          "fp8 histories) after 3 steps x 2 micro-batches; " << differing << " differ, largest "
          "difference " << largest_difference(plain.tensors, checkpointed.tensors) << "; "
          << plain.skipped << " steps skipped, scale " << plain.scale);
  CHECK(differing == 0);
  CHECK(plain.losses == checkpointed.losses);
  CHECK(plain.scale == checkpointed.scale);
  CHECK(plain.skipped == checkpointed.skipped);
  if constexpr (std::is_same_v<typename P::scaler_type, mp::GradScaler>) {
    // The scaler's path was taken: fp16 skipped steps, bf16's scale grew.
    CHECK((P::low_dtype == at::kHalf ? plain.skipped > 0 : plain.scale > std::ldexp(1.0, 40)));
  }
}

}  // namespace

// ---- Training under every policy: nothing changes but memory.

TEST_CASE_TEMPLATE("checkpointed blocks train bitwise as without checkpointing, every policy", P,
                   mp::FullPrecision, mp::MixedO2<at::BFloat16>, test::ScaledO2,
                   mp::PureHalf<at::BFloat16>) {
  check_policy_bitwise<P>();
}

// Under MixedO1 the block's BatchNorm and LayerNorm read bf16 activations with fp32 weights,
// which LibTorch 1.13's CPU kernels refuse (with or without checkpointing).
TEST_CASE("... and MixedO1<BFloat16>" * doctest::skip(!mp::mixed_dtype_norms)) {
  check_policy_bitwise<mp::MixedO1<at::BFloat16>>();
}

TEST_CASE("... and the fp16 policies with their GradScaler" * doctest::skip(!mp::cpu_half_math)) {
  if constexpr (mp::cpu_half_math) {
    check_policy_bitwise<mp::MixedO1<at::Half>>();
    check_policy_bitwise<mp::MixedO2<at::Half>>();
  }
}

TEST_CASE("... and MixedFP8 with each recipe: delayed scaling's histories take each step once" *
          doctest::skip(!mp::has_fp8)) {
  test::with_fp8_recipes<mp::TensorwiseScaling, mp::DelayedScaling<4>, mp::RowwiseScaling,
                         mp::RowwiseScalingWithGwHp>([](auto... recipes) {
    (check_policy_bitwise<mp::MixedFP8<decltype(recipes)>>(), ...);
  });
}

// ---- The functional form: the same numbers, what flows where.

namespace {

// Forward and backward of `forward(x)` (a block of code) with an upstream gradient of ones;
// returns the output, x's gradient and the parameters' gradients, cleared after.
template <class Forward>
std::vector<at::Tensor> forward_backward(torch::nn::Module& model, const at::Tensor& x,
                                         Forward&& forward) {
  auto input = x.detach().requires_grad_(x.requires_grad());
  auto out = forward(input);
  out.to(at::kFloat).pow(2).sum().backward();
  std::vector<at::Tensor> result{out.detach()};
  if (input.requires_grad()) result.push_back(input.grad().clone());
  for (auto& p : model.parameters()) {
    result.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
    p.mutable_grad() = at::Tensor();
  }
  return result;
}

bool same_results(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].defined() != b[i].defined()) return false;
    if (a[i].defined() && !identical(a[i], b[i])) return false;
  }
  return true;
}

}  // namespace

// A block of `seed`'s weights whose BatchNorm has seen one batch (its statistics not the initial ones).
Block seeded_block(std::uint64_t seed) {
  torch::manual_seed(static_cast<std::int64_t>(seed));
  Block block(32);
  return block;
}

TEST_CASE("checkpoint(fn, x): the output and every gradient bitwise as fn(x), with dropout and BatchNorm") {
  const auto x = (torch::manual_seed(2), torch::randn({8, 32})).requires_grad_();
  auto plain = seeded_block(0);
  torch::manual_seed(1);
  const auto expected = forward_backward(*plain, x, [&](const at::Tensor& in) { return plain(in); });
  const auto next_plain = torch::rand({4});  // the random stream after the step

  auto block = seeded_block(0);
  torch::manual_seed(1);
  at::Tensor out;
  const auto got = forward_backward(*block, x, [&](const at::Tensor& in) {
    out = mp::checkpoint(mp::CheckpointOptions().keep_buffers(*block),
                         [block](const at::Tensor& h) mutable { return block(h); }, in);
    return out;
  });
  CHECK(out.grad_fn()->name() == "mixprec::CheckpointBackward");
  CHECK(same_results(expected, got));
  MESSAGE("largest difference, output and gradients: " << largest_difference(expected, got));
  // BatchNorm's running statistics: updated by the forward, not again by the recompute.
  CHECK(identical(state_of(*plain), state_of(*block)));
  // The random stream goes on as without the checkpoint: the recompute drew nothing from it.
  CHECK(identical(torch::rand({4}), next_plain));
}

TEST_CASE("checkpoint: a block that throws in its recompute leaves BatchNorm's statistics as the forward pass left them") {
  const auto x = (torch::manual_seed(2), torch::randn({8, 32})).requires_grad_();
  auto block = seeded_block(0);
  const auto fail = std::make_shared<bool>(false);
  torch::manual_seed(1);
  const auto out = mp::checkpoint(mp::CheckpointOptions().keep_buffers(*block),
                                  [block, fail](const at::Tensor& h) mutable {
                                    auto y = block(h);
                                    if (*fail) throw std::runtime_error("a test's failure in the recompute");
                                    return y;
                                  },
                                  x);
  const auto after_forward = state_of(*block);
  *fail = true;  // as an out-of-memory error in the recompute, which a run may catch and go on from
  CHECK_THROWS_WITH(out.sum().backward(), doctest::Contains("a test's failure in the recompute"));
  CHECK(identical(state_of(*block), after_forward));
}

TEST_CASE("checkpoint without keep_buffers updates BatchNorm's statistics again, as Python's checkpoint does") {
  const auto x = (torch::manual_seed(2), torch::randn({8, 32})).requires_grad_();
  auto twice = seeded_block(0);
  for (int k = 0; k < 2; ++k) {  // two forward passes from the same random state
    torch::manual_seed(1);
    forward_backward(*twice, x, [&](const at::Tensor& in) { return twice(in); });
  }
  auto block = seeded_block(0);
  torch::manual_seed(1);
  forward_backward(*block, x, [&](const at::Tensor& in) {
    return mp::checkpoint([block](const at::Tensor& h) mutable { return block(h); }, in);
  });
  CHECK(identical(block->norm->running_mean, twice->norm->running_mean));
  CHECK(identical(block->norm->running_var, twice->norm->running_var));
  CHECK(block->norm->num_batches_tracked.item<std::int64_t>() == 2);
}

TEST_CASE("checkpoint: parameters reached only inside the block get their gradients, also when no input requires grad") {
  auto block = seeded_block(4);
  block->eval();  // no dropout, BatchNorm's statistics: the block is a function of x
  const auto x = torch::randn({6, 32});  // requires no grad
  const auto expected = forward_backward(*block, x, [&](const at::Tensor& in) { return block(in); });
  const auto got = forward_backward(*block, x, [&](const at::Tensor& in) {
    return mp::checkpoint([block](const at::Tensor& h) mutable { return block(h); }, in);
  });
  REQUIRE(got.size() == block->parameters().size() + 1);
  for (std::size_t i = 1; i < got.size(); ++i) CHECK(got[i].defined());
  CHECK(same_results(expected, got));
}

TEST_CASE("checkpoint: nested checkpoints, a block used twice, and several inputs and outputs of any kind") {
  auto a = seeded_block(5), b = seeded_block(6);
  const auto x = (torch::manual_seed(2), torch::randn({8, 32})).requires_grad_();
  torch::nn::Module both;
  both.register_module("a", a);
  both.register_module("b", b);
  const auto body = [](Block first, Block second, const at::Tensor& h, bool inner) {
    const auto run = [inner](Block m, const at::Tensor& t) {
      return inner ? mp::checkpoint(mp::CheckpointOptions().keep_buffers(*m),
                                    [m](const at::Tensor& u) mutable { return m(u); }, t)
                   : m(t);
    };
    return run(second, run(first, run(first, h)));  // the first twice in one forward pass
  };
  torch::manual_seed(1);
  const auto expected = forward_backward(both, x, [&](const at::Tensor& in) { return body(a, b, in, false); });
  const auto state = state_of(both);
  for (const bool inner : {false, true}) {
    CAPTURE(inner);
    auto a2 = seeded_block(5), b2 = seeded_block(6);
    torch::nn::Module both2;
    both2.register_module("a", a2);
    both2.register_module("b", b2);
    torch::manual_seed(1);
    const auto got = forward_backward(both2, x, [&](const at::Tensor& in) {
      return mp::checkpoint(mp::CheckpointOptions().keep_buffers(both2),
                            [a2, b2, inner, body](const at::Tensor& h) mutable { return body(a2, b2, h, inner); }, in);
    });
    CHECK(same_results(expected, got));
    CHECK(identical(state_of(both2), state));
  }
  SUBCASE("tuples and vectors in and out, numbers and integer tensors passed as they are") {
    auto block = seeded_block(7);
    block->eval();
    const auto mask = torch::tensor({1, 0, 1, 1, 0, 1, 1, 1}, torch::kLong);
    auto fn = [block](const std::vector<at::Tensor>& hs, const at::Tensor& keep, double scale) mutable {
      const auto h = block(hs[0]) * scale + hs[1];
      return std::make_tuple(h * keep.unsqueeze(1).to(h.scalar_type()), keep.sum(), h.sum(1));
    };
    const auto y = torch::randn({8, 32}).requires_grad_();
    const std::vector<at::Tensor> hs{x, y};
    const auto [p, n, s] = fn(hs, mask, 0.5);
    (p.sum() + s.sum()).backward();
    const auto gx = x.grad().clone(), gy = y.grad().clone();
    x.mutable_grad() = at::Tensor();
    y.mutable_grad() = at::Tensor();
    const auto [p2, n2, s2] = mp::checkpoint(fn, hs, mask, 0.5);
    CHECK(!n2.requires_grad());  // an integer result: no gradient, as without the checkpoint
    CHECK(n2.item<std::int64_t>() == n.item<std::int64_t>());
    (p2.sum() + s2.sum()).backward();
    CHECK(identical(p.detach(), p2.detach()));
    CHECK(identical(gx, x.grad()));
    CHECK(identical(gy, y.grad()));
  }
}

TEST_CASE("checkpoint: a block that returns its input, one whose outputs need no gradient, and no grad mode") {
  const auto x = torch::randn({4, 3}).requires_grad_();
  auto same = mp::checkpoint([](const at::Tensor& h) { return h; }, x);
  (same * 3).sum().backward();
  CHECK(identical(x.grad(), torch::full({4, 3}, 3.0)));
  // Nothing that requires grad in, nothing out: as without the checkpoint, no graph at all.
  auto block = seeded_block(8);
  const auto x32 = torch::randn({4, 32}).requires_grad_();
  const auto detached = mp::checkpoint([block](const at::Tensor& h) mutable { return block(h).detach(); }, x32);
  CHECK(!detached.requires_grad());
  CHECK(!detached.grad_fn());
  for (const auto& p : block->parameters()) CHECK(!p.grad().defined());
  {
    torch::NoGradGuard no_grad;
    const auto out = mp::checkpoint([block](const at::Tensor& h) mutable { return block(h); }, x32);
    CHECK(!out.requires_grad());
  }
}

TEST_CASE("checkpoint: retain_graph lets backward recompute twice; double backward flows through the recompute") {
  auto block = seeded_block(9);
  block->eval();
  const auto x = (torch::manual_seed(3), torch::randn({5, 32})).requires_grad_();
  auto out = mp::checkpoint([block](const at::Tensor& h) mutable { return block(h); }, x);
  auto loss = out.sum();  // a sum keeps no tensors: a third backward reaches the checkpoint
  loss.backward({}, /*retain_graph=*/true);
  const auto first = x.grad().clone();
  loss.backward();
  CHECK(identical(x.grad(), first * 2));
  CHECK_THROWS_WITH_AS(loss.backward(), doctest::Contains("retain_graph=true"), mp::Error);
  // A gradient penalty |d loss/d x|^2, differentiated for the weights and x (the loss weighs
  // the outputs: LayerNorm's output has a fixed norm, its squares' sum would not depend on x).
  const auto weights = torch::randn({5, 32});
  const auto penalty = [&](bool checkpointed) {
    for (auto& p : block->parameters()) p.mutable_grad() = at::Tensor();
    auto input = x.detach().requires_grad_();
    auto y = checkpointed ? mp::checkpoint([block](const at::Tensor& h) mutable { return block(h); }, input)
                          : block(input);
    auto g = torch::autograd::grad({(y * weights).sum()}, {input}, {}, /*retain_graph=*/true,
                                   /*create_graph=*/true)[0];
    g.pow(2).sum().backward();
    return std::vector<at::Tensor>{block->fc1->weight.grad().clone(), input.grad().clone()};
  };
  const auto expected = penalty(false), got = penalty(true);
  MESSAGE("double backward (a gradient penalty), the weight's and the input's gradients: largest "
          "difference " << largest_difference(expected, got));
  CHECK(identical(expected[0], got[0]));
  CHECK(identical(expected[1], got[1]));
  // ... which cannot stop at the block's input where that came from a weight the block uses.
  auto input = x.detach().requires_grad_();
  auto tied = mp::checkpoint([block](const at::Tensor& h) mutable { return block(h); }, block->fc1(input));
  CHECK_THROWS_WITH_AS(torch::autograd::grad({tied.pow(2).sum()}, {input}, {}, true, true),
                       doctest::Contains("tied weight"), mp::Error);
}

// ---- Precision: the recompute computes in the dtypes of the first run.

TEST_CASE("the recompute replays autocast, an Fp32Region and a mapped module, though backward runs outside them") {
  using O1 = mp::MixedO1<at::BFloat16>;
  const auto make = [] {
    torch::manual_seed(12);
    return torch::nn::Sequential(mp::nn::Linear(16, 32), torch::nn::ReLU(),
                                 mp::nn::Checkpointed<mp::nn::Linear>(32, 32), torch::nn::Dropout(0.5),
                                 mp::nn::Linear(32, 32));
  };
  const auto x = (torch::manual_seed(13), torch::randn({8, 16})).requires_grad_();
  // The model's forward, then a block of code with an Fp32Region: softmax in fp32 inside bf16.
  const auto run = [&](torch::nn::Sequential model, bool checkpointed) {
    mp::apply_precision_map<O1>(model, mp::PrecisionMap().keep_fp32("2"));
    if (checkpointed) mp::apply_checkpointing(model, {"2"});
    auto code = [model](const at::Tensor& h) mutable {
      const auto y = model->forward(h);
      mp::Fp32Region fp32;
      return fp32.out(at::softmax(fp32.in(y), -1)) * y;
    };
    torch::manual_seed(14);
    return forward_backward(*model, x, [&](const at::Tensor& in) {
      const auto guard = mp::autocast<O1>();
      return checkpointed ? mp::checkpoint(code, in) : code(in);
    });
  };
  const auto expected = run(make(), false);
  const auto got = run(make(), true);
  CHECK(expected[0].scalar_type() == at::kBFloat16);
  CHECK(same_results(expected, got));
  MESSAGE("MixedO1<BFloat16>, a module mapped fp32 and an Fp32Region: largest difference "
          << largest_difference(expected, got));
}

TEST_CASE_TEMPLATE("a module both mapped and checkpointed trains as mapped alone, bitwise", P,
                   mp::MixedO1<at::BFloat16>, mp::MixedO2<at::BFloat16>) {
  const auto train_mapped = [](bool checkpointed) {
    torch::manual_seed(15);
    torch::nn::Sequential model(mp::nn::Linear(16, 32), torch::nn::ReLU(),
                                mp::nn::Checkpointed<mp::nn::Linear>(32, 32), torch::nn::ReLU(),
                                mp::nn::Checkpointed<torch::nn::BatchNorm1d>(32),
                                mp::nn::Linear(32, 4));
    mp::apply_precision_map<P>(model, mp::PrecisionMap().keep_fp32("2"));
    if (checkpointed) CHECK(mp::apply_checkpointing(model, {"2", "4"}).size() == 2);
    torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    mp::Trainer<P> trainer(model, sgd);
    CHECK(model->named_parameters()["2.weight"].scalar_type() == at::kFloat);
    torch::manual_seed(16);
    for (int k = 0; k < 3; ++k) {
      const auto x = torch::randn({8, 16});
      trainer.step([&] { return model->forward(trainer.cast_input(x)).to(at::kFloat).pow(2).mean(); });
    }
    auto tensors = state_of(*model);
    for (const auto& m : trainer.master_weights()) tensors.push_back(m.clone());
    return tensors;
  };
  CHECK(identical(train_mapped(false), train_mapped(true)));
}

// ---- The module form and its patterns.

TEST_CASE("Checkpointed<M> keeps M's names, state_dict, forward and modes; apply_checkpointing turns it on by path") {
  torch::manual_seed(17);
  Net net;
  Block plain(32);
  std::vector<std::string> wrapped, expected;
  for (const auto& item : net->blocks[0]->named_parameters()) wrapped.push_back(item.key());
  for (const auto& item : net->blocks[0]->named_buffers()) wrapped.push_back(item.key());
  for (const auto& item : plain->named_parameters()) expected.push_back(item.key());
  for (const auto& item : plain->named_buffers()) expected.push_back(item.key());
  CHECK(wrapped == expected);
  CHECK(net->named_parameters().contains("blocks.1.fc2.weight"));
  auto* first = net->blocks[0]->as<mp::nn::CheckpointedImpl<Block>>();
  CHECK(!first->checkpointing());
  net->eval();
  CHECK(!first->inner()->is_training());
  net->train();
  CHECK(first->inner()->drop->is_training());
  std::ostringstream text;
  text << *net;
  CHECK(text.str().find("mixprec::nn::Checkpointed(") != std::string::npos);
  // A Sequential holds one whose forward takes one tensor.
  torch::nn::Sequential seq(mp::nn::Checkpointed<torch::nn::Linear>(4, 4), torch::nn::ReLU());
  CHECK(mp::apply_checkpointing(seq, {"0"}) == std::vector<std::string>{"0"});
  CHECK(seq->forward(torch::randn({2, 4}).requires_grad_()).grad_fn()->next_edges()[0]
            .function->name() == "mixprec::CheckpointBackward");
  // A Sequential (its forward a template) wrapped: called through its holder, as M is.
  mp::nn::Checkpointed<torch::nn::Sequential> stack(torch::nn::Linear(4, 4), torch::nn::ReLU());
  CHECK(stack->named_parameters().contains("0.weight"));
  stack->set_checkpointing(true);
  CHECK(stack(torch::randn({2, 4})).grad_fn()->name() == "mixprec::CheckpointBackward");
  CHECK(mp::apply_checkpointing(net, {"blocks.*"}) == std::vector<std::string>{"blocks.0", "blocks.1"});
  CHECK(first->checkpointing());
  std::ostringstream on;
  on << *net;
  CHECK(on.str().find("checkpointing)") != std::string::npos);
}

TEST_CASE("a Checkpointed module called twice in one forward pass: as the plain module, bitwise") {
  const auto run = [](bool checkpointed) {
    torch::manual_seed(18);
    mp::nn::Checkpointed<Block> block(32);
    block->set_checkpointing(checkpointed);
    const auto x = (torch::manual_seed(19), torch::randn({8, 32})).requires_grad_();
    auto result = forward_backward(*block, x, [&](const at::Tensor& in) { return block(block(in)); });
    for (const auto& b : block->buffers()) result.push_back(b.clone());
    return result;
  };
  CHECK(same_results(run(false), run(true)));
}

TEST_CASE("the module form's bad inputs: Errors that name the fix, nothing changed") {
  torch::manual_seed(20);
  Net net;
  const auto none_on = [&] {
    for (const auto& m : net->modules()) {
      auto* c = dynamic_cast<mp::detail::CheckpointedBase*>(m.get());
      if (c != nullptr && c->checkpointing()) return false;
    }
    return true;
  };
  CHECK_THROWS_WITH_AS(mp::apply_checkpointing(std::shared_ptr<torch::nn::Module>(), {"x"}),
                       doctest::Contains("null model"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::apply_checkpointing(net, {}), doctest::Contains("no patterns"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::apply_checkpointing(net, {"blocks.*", "block.*"}),
                       doctest::Contains("checkpointing pattern 'block.*' matches no module"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::apply_checkpointing(net, {"blocks.*", "blocks.0"}),
                       doctest::Contains("decides no module"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::apply_checkpointing(net, {"blocks.0", "blocks.**"}),
                       doctest::Contains("names module 'blocks.0.fc1' (mixprec::nn::Float8LinearImpl), which is "
                                        "not declared as mixprec::nn::Checkpointed<mixprec::nn::Float8Linear>"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::apply_checkpointing(net, {"head"}),
                       doctest::Contains("not declared as mixprec::nn::Checkpointed"), mp::Error);
  CHECK(none_on());
  CHECK_THROWS_WITH_AS(mp::nn::Checkpointed<mp::nn::Mappable<torch::nn::Linear>>(4, 4),
                       doctest::Contains("wrapper already"), mp::Error);
  CHECK_THROWS_WITH_AS(mp::nn::Checkpointed<mp::nn::Float8Linear>(4, 4),
                       doctest::Contains("wrapper already"), mp::Error);
}

TEST_CASE("checkpoint's bad inputs: a block that modifies its input, reads a tensor it was not given, or changes its path") {
  auto block = seeded_block(21);
  block->eval();
  const auto base = torch::randn({4, 32}).requires_grad_();
  SUBCASE("modifies its input in place") {
    const auto x = base * 1;
    CHECK_THROWS_WITH_AS(mp::checkpoint([](at::Tensor h) { return h.mul_(2); }, x),
                         doctest::Contains("modifies its input 0 (shape [4, 32]) in place"), mp::Error);
  }
  SUBCASE("its input modified in place after it ran") {
    auto x = base * 1;
    auto y = mp::checkpoint([block](const at::Tensor& h) mutable { return block(h); }, x);
    x.add_(1);
    CHECK_THROWS_WITH_AS(y.sum().backward(), doctest::Contains("modified in place after the block ran"),
                         mp::Error);
  }
  SUBCASE("reads a tensor with a gradient history that is not one of its inputs") {
    const auto outside = base * 2;
    CHECK_THROWS_WITH_AS(mp::checkpoint([block, outside](const at::Tensor& h) mutable { return block(h) + outside; },
                                        torch::randn({4, 32})),
                         doctest::Contains("Pass it to the block as an argument"), mp::Error);
  }
  SUBCASE("computes something else when recomputed") {
    auto calls = std::make_shared<int>(0);
    auto y = mp::checkpoint([block, calls](const at::Tensor& h) mutable {
      return ++*calls == 1 ? block(h) : block->fc1(h);
    }, base);
    CHECK_THROWS_WITH_AS(y.sum().backward(), doctest::Contains("computed something else when recomputed"),
                         mp::Error);
  }
}

// ---- The recompute takes the first run's path, or an Error names the block and what differs
// (issue 59): state that changes between the forward pass and backward (a module's mode, a
// number or tensor the block reads, a parameter) gave the gradients of another computation.

namespace {

// What backward gave after a change between a checkpointed block's forward pass and backward:
// the Error's message, or (none) how far the gradients are from those of the unchanged run.
struct Misuse {
  std::string error;
  double off = 0;
};

// forward(x, checkpointed) runs a block on x; run once without checkpointing and without the
// change (the gradients of what the forward pass computed), then checkpointed with change()
// after the forward pass and undo() after backward. Upstream gradient 2y, as Python's
// parity_checkpoint.py misuse cases.
template <class Forward, class Change, class Undo>
Misuse misuse(torch::nn::Module& model, const at::Tensor& x0, Forward forward, Change change,
              Undo undo) {
  const auto gradients = [&](const at::Tensor& x) {
    std::vector<at::Tensor> grads;
    if (x.grad().defined()) grads.push_back(x.grad().clone());
    for (auto& p : model.parameters()) {
      if (p.grad().defined()) grads.push_back(p.grad().clone());
      p.mutable_grad() = at::Tensor();
    }
    return grads;
  };
  auto x = x0.clone().requires_grad_();
  torch::manual_seed(32);
  forward(x, false).pow(2).sum().backward();
  const auto expected = gradients(x);
  x = x0.clone().requires_grad_();
  torch::manual_seed(32);
  const auto y = forward(x, true);
  change();
  Misuse result;
  try {
    y.pow(2).sum().backward();
  } catch (const mp::Error& e) {
    result.error = e.what();
  }
  undo();
  if (result.error.empty()) {
    const auto got = gradients(x);
    result.off = got.size() == expected.size() ? largest_difference(expected, got) : INFINITY;
  } else {
    gradients(x);
  }
  return result;
}

std::string outcome_of(const Misuse& m) {
  if (!m.error.empty()) return "Error: " + m.error;
  std::ostringstream words;
  words << "no Error, gradients off by " << m.off;
  return words.str();
}

// Models users build: an encoder layer with dropout ([seq, batch, 16]), a conv block with
// BatchNorm ([4, 3, 6, 6]), Linear layers ([4, 16]).
torch::nn::TransformerEncoderLayerOptions encoder_options() {
  return torch::nn::TransformerEncoderLayerOptions(16, 2).dim_feedforward(32).dropout(0.1);
}
torch::nn::Sequential conv_block() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)),
                               torch::nn::BatchNorm2d(8), torch::nn::ReLU());
}
torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(16, 16), torch::nn::GELU(), torch::nn::Linear(16, 16));
}

// A module's mode switched (to eval() or to train()) between forward and backward, the module
// checkpointed as a Checkpointed<M> (`module`) ...
template <class Module>
Misuse module_mode_misuse(Module module, const at::Tensor& x0, bool to_eval) {
  module->train(to_eval);
  return misuse(*module, x0, [&](const at::Tensor& x, bool checkpointed) {
    module->set_checkpointing(checkpointed);
    return module->forward(x);
  }, [&] { module->train(!to_eval); }, [&] { module->train(to_eval); });
}

// ... or through mixprec::checkpoint, naming the module in keep_buffers or not.
template <class Module>
Misuse function_mode_misuse(Module plain, const at::Tensor& x0, bool to_eval, bool keep = false) {
  plain->train(to_eval);
  return misuse(*plain, x0, [&](const at::Tensor& x, bool checkpointed) {
    auto fn = [plain](const at::Tensor& h) mutable { return plain->forward(h); };
    if (!checkpointed) return fn(x);
    return keep ? mp::checkpoint(mp::CheckpointOptions().keep_buffers(*plain), fn, x) : mp::checkpoint(fn, x);
  }, [&] { plain->train(!to_eval); }, [&] { plain->train(to_eval); });
}

}  // namespace

TEST_CASE("a module switched to eval() or train() between the forward pass and backward: an Error naming the block and the module, both forms") {
  torch::manual_seed(30);
  const auto seq = torch::randn({5, 2, 16}), images = torch::randn({4, 3, 6, 6});
  SUBCASE("an encoder layer with dropout") {
    torch::manual_seed(33);
    mp::nn::Checkpointed<torch::nn::TransformerEncoderLayer> module(encoder_options());
    const auto as_module = module_mode_misuse(module, seq, true);
    MESSAGE("encoder layer, eval() before backward, Checkpointed<M>: " << outcome_of(as_module));
    CHECK(as_module.error.find("checkpointed module mixprec::nn::Checkpointed<torch::nn::TransformerEncoderLayer>: "
                               "module torch::nn::TransformerEncoderLayer was in training mode in the "
                               "forward pass and is in eval mode now") != std::string::npos);
    torch::manual_seed(33);
    const auto as_function = function_mode_misuse(torch::nn::TransformerEncoderLayer(encoder_options()), seq, true);
    MESSAGE("encoder layer, eval() before backward, checkpoint(fn): " << outcome_of(as_function));
    // Dropout in eval mode is no op: the graph has fewer nodes.
    CHECK(as_function.error.find("took another path when recomputed") != std::string::npos);
    CHECK(as_function.error.find("switched to eval() or train()") != std::string::npos);
  }
  SUBCASE("a conv block with BatchNorm, train to eval and eval to train") {
    for (const bool to_eval : {true, false}) {
      const std::string change = to_eval ? "eval()" : "train()";
      CAPTURE(change);
      torch::manual_seed(34);
      mp::nn::Checkpointed<torch::nn::Sequential> module(conv_block());
      const auto as_module = module_mode_misuse(module, images, to_eval);
      MESSAGE("conv block, " << change << " before backward, Checkpointed<M>: " << outcome_of(as_module));
      CHECK(as_module.error.find("module torch::nn::Sequential was in ") != std::string::npos);
      CHECK(as_module.error.find("(4 of its 4 modules changed mode)") != std::string::npos);
      // batch_norm builds the same node in training and in eval mode: the function form sees
      // other values (on the CPU), or the modes where keep_buffers names the module.
      const auto as_function = function_mode_misuse(conv_block(), images, to_eval);
      MESSAGE("conv block, " << change << " before backward, checkpoint(fn): " << outcome_of(as_function));
      CHECK(as_function.error.find("computed other values when recomputed") != std::string::npos);
      CHECK(as_function.error.find("switched to eval() or train() (BatchNorm)") != std::string::npos);
      const auto kept = function_mode_misuse(conv_block(), images, to_eval, /*keep=*/true);
      MESSAGE("conv block, " << change << " before backward, checkpoint(keep_buffers(block), fn): " << outcome_of(kept));
      CHECK(kept.error.find("module torch::nn::Sequential was in ") != std::string::npos);
    }
  }
  SUBCASE("only a submodule switched") {
    torch::manual_seed(34);
    mp::nn::Checkpointed<torch::nn::Sequential> module(conv_block());
    const auto result = misuse(*module, images, [&](const at::Tensor& x, bool checkpointed) {
      module->set_checkpointing(checkpointed);
      return module->forward(x);
    }, [&] { module->inner()[1]->eval(); }, [&] { module->inner()[1]->train(); });
    MESSAGE("the BatchNorm of a conv block, eval() before backward: " << outcome_of(result));
    CHECK(result.error.find("submodule '1' (torch::nn::BatchNorm2d) was in training mode in the "
                            "forward pass and is in eval mode now (1 of its 4 modules changed mode)") !=
          std::string::npos);
  }
  SUBCASE("a block without dropout or BatchNorm: the module form still refuses, the function form computes the same") {
    torch::manual_seed(35);
    const auto rows = torch::randn({4, 16});
    mp::nn::Checkpointed<torch::nn::Sequential> module(mlp());
    const auto as_module = module_mode_misuse(module, rows, true);
    MESSAGE("Linear, GELU, Linear, eval() before backward, Checkpointed<M>: " << outcome_of(as_module));
    CHECK(as_module.error.find("module torch::nn::Sequential was in training mode") != std::string::npos);
    const auto as_function = function_mode_misuse(mlp(), rows, true);
    MESSAGE("Linear, GELU, Linear, eval() before backward, checkpoint(fn): " << outcome_of(as_function));
    CHECK(as_function.error.empty());
    CHECK(as_function.off == 0);  // as Python's checkpoint: the same graph, the same values
  }
  SUBCASE("eval() and back to train() before backward (an evaluation inside the step): no Error, the same gradients") {
    torch::manual_seed(34);
    mp::nn::Checkpointed<torch::nn::Sequential> module(conv_block());
    const auto result = misuse(*module, images, [&](const at::Tensor& x, bool checkpointed) {
      module->set_checkpointing(checkpointed);
      return module->forward(x);
    }, [&] {
      module->eval();
      const torch::NoGradGuard no_grad;
      module->forward(images);
      module->train();
    }, [] {});
    CHECK(result.error.empty());
    CHECK(result.off == 0);
  }
}

TEST_CASE("a number, a tensor or a parameter the block reads, changed between the forward pass and backward: an Error, not the gradients of the new values") {
  torch::manual_seed(36);
  torch::nn::Linear linear(16, 16);
  const auto rows = torch::randn({4, 16});
  auto scale = std::make_shared<double>(3.0);
  const auto scaled = [&](auto compute) {
    return [compute, linear, scale](const at::Tensor& x, bool checkpointed) mutable {
      auto fn = [compute, linear, scale](const at::Tensor& h) mutable { return compute(linear(h), *scale); };
      return checkpointed ? mp::checkpoint(mp::CheckpointOptions().name("scaled"), fn, x) : fn(x);
    };
  };
  const auto to8 = [scale] { *scale = 8.0; };
  const auto to3 = [scale] { *scale = 3.0; };
  SUBCASE("a number read after the block's last op that saves a tensor: y = linear(x) * s") {
    const auto result = misuse(*linear, rows, scaled([](const at::Tensor& y, double s) { return y * s; }), to8, to3);
    MESSAGE("linear(x) * s, s changed: " << outcome_of(result));
    CHECK(result.error.find("checkpointed block 'scaled' computed other values when recomputed") != std::string::npos);
    CHECK(result.error.find("in the forward pass") != std::string::npos);
  }
  SUBCASE("a number read before one: y = gelu(linear(x) * s)") {
    const auto result = misuse(*linear, rows, scaled([](const at::Tensor& y, double s) { return torch::gelu(y * s); }), to8, to3);
    MESSAGE("gelu(linear(x) * s), s changed: " << outcome_of(result));
    CHECK(result.error.find("computed other values") != std::string::npos);
  }
  SUBCASE("a tensor it captured, modified in place") {
    const auto mask = torch::full({16}, 3.0);
    const auto result = misuse(*linear, rows, [&](const at::Tensor& x, bool checkpointed) {
      auto fn = [linear, mask](const at::Tensor& h) mutable { return linear(h) * mask; };
      return checkpointed ? mp::checkpoint(fn, x) : fn(x);
    }, [&] { mask.fill_(8.0); }, [&] { mask.fill_(3.0); });
    MESSAGE("linear(x) * mask, mask.fill_(8): " << outcome_of(result));
    CHECK(result.error.find("computed other values") != std::string::npos);
    CHECK(result.error.find("checkpointed block ") != std::string::npos);  // named by its lambda's type
  }
  SUBCASE("a parameter stepped in place (an optimizer step before backward)") {
    torch::nn::Sequential model{mp::nn::Checkpointed<torch::nn::Sequential>(mlp())};
    REQUIRE(mp::apply_checkpointing(model, {"0"}).size() == 1);
    auto block = model[0]->as<mp::nn::CheckpointedImpl<torch::nn::Sequential>>();
    const auto weight = block->inner()[0]->as<torch::nn::Linear>()->weight;
    const auto result = misuse(*model, rows, [&](const at::Tensor& x, bool checkpointed) {
      block->set_checkpointing(checkpointed);
      return model->forward(x);
    }, [&] {
      const torch::NoGradGuard no_grad;
      weight.add_(0.5);
    }, [&] {
      const torch::NoGradGuard no_grad;
      weight.sub_(0.5);
    });
    MESSAGE("a Linear's weight += 0.5 before backward: " << outcome_of(result));
    CHECK(result.error.find("parameter '0.weight' (shape [16, 16], Float) of checkpointed module '0' "
                            "(mixprec::nn::Checkpointed<torch::nn::Sequential>) was modified in place "
                            "between the forward pass and backward") != std::string::npos);
  }
}

// ---- What must happen once per forward pass reads the checkpoint's pass (core/).

TEST_CASE("a recompute counts no fp8 operand for advise(), and the forward pass no gradient twice") {
  torch::manual_seed(22);
  mp::nn::Float8Linear layer(8, 8);
  auto watch = std::make_shared<mp::detail::Fp8Watch>();
  mp::detail::Fp8Watch::current() = watch;
  const auto x = torch::randn({4, 8}).requires_grad_();
  {
    const mp::detail::CheckpointPassGuard pass(mp::detail::CheckpointPass::forward);
    layer(x).sum().backward();  // the first run's graph, dropped unused in a checkpoint
  }
  const auto* seen = watch->find(layer.get());
  REQUIRE(seen != nullptr);
  CHECK((*seen)[0].nonzero == 32);
  CHECK((*seen)[2].nonzero == 0);
  {
    const mp::detail::CheckpointPassGuard pass(mp::detail::CheckpointPass::recompute);
    layer(x).sum().backward();
    // Nested: a checkpoint inside a recompute replays too.
    const mp::detail::CheckpointPassGuard inner(mp::detail::CheckpointPass::forward);
    CHECK(mp::detail::recomputing());
  }
  CHECK(!mp::detail::recomputing());
  CHECK((*seen)[0].nonzero == 32);
  CHECK((*seen)[2].nonzero == 32);
  mp::detail::Fp8Watch::current() = nullptr;
}

TEST_CASE("a recompute records no amax for delayed scaling" * doctest::skip(!mp::has_fp8)) {
  torch::manual_seed(23);
  mp::nn::Float8Linear layer(16, 16);
  auto state = c10::make_intrusive<mp::detail::Fp8LayerState>(/*delayed=*/true, 4, 0);
  layer->set_fp8_state(state);
  const auto x = torch::randn({4, 16});
  {
    const mp::detail::CheckpointPassGuard pass(mp::detail::CheckpointPass::recompute);
    layer(x);
  }
  CHECK(!state->slot(mp::Fp8Role::input).pending.defined());
  CHECK(!state->slot(mp::Fp8Role::weight).pending.defined());
  {
    const mp::detail::CheckpointPassGuard pass(mp::detail::CheckpointPass::forward);
    layer(x);
  }
  CHECK(state->slot(mp::Fp8Role::input).pending.defined());
  layer->set_fp8_state({});
}

// ---- Against Python: torch.utils.checkpoint(use_reentrant=False) on the same model and data.

namespace {

using Values = std::map<std::string, std::vector<double>>;  // "mode way name" -> values

Values read_python(const std::string& path) {
  Values values;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream fields(line);
    std::string mode, way, name;
    fields >> mode >> way >> name;
    auto& v = values[mode + " " + way + " " + name];
    for (std::string text; fields >> text;) v.push_back(std::strtod(text.c_str(), nullptr));
  }
  return values;
}

std::vector<double> values_of(const at::Tensor& t) {
  const auto d = t.detach().to(at::kDouble).contiguous().reshape({-1});
  return {d.data_ptr<double>(), d.data_ptr<double>() + d.numel()};
}

// The C++ side of one mode and way: name -> values, as the script writes them.
Values run_cpp(const std::string& mode, const std::string& way, const at::Tensor& x0,
               const at::Tensor& y, std::int64_t seed) {
  torch::manual_seed(24);
  Net net;
  if (way == "checkpoint") mp::apply_checkpointing(net, {"blocks.*"});
  auto x = x0.clone().requires_grad_();
  torch::manual_seed(seed);
  at::Tensor logits;
  {
    std::optional<mp::AutocastGuard> guard;
    if (mode == "bf16") guard.emplace(torch::kCPU, at::kBFloat16);
    logits = net->forward(x);
  }
  const auto loss = torch::nn::functional::cross_entropy(logits.to(at::kFloat), y);
  loss.backward();  // outside autocast, as Python's
  Values values;
  const auto key = [&](const std::string& name) { return mode + " " + way + " " + name; };
  values[key("loss")] = values_of(loss);
  values[key("x.grad")] = values_of(x.grad());
  for (const auto& item : net->named_parameters()) values[key(item.key() + ".grad")] = values_of(item.value().grad());
  for (const auto& item : net->named_buffers()) values[key(item.key())] = values_of(item.value());
  return values;
}

double largest(const std::vector<double>& a, const std::vector<double>& b) {
  double m = a.size() == b.size() ? 0.0 : INFINITY;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::abs(a[i] - b[i]));
  return m;
}

}  // namespace

namespace {

// The model of the parity cases in `modes` (fp32; bf16: CPU autocast), C++ against the script.
void check_against_python(const std::vector<std::string>& modes) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);  // dropout's masks and the kernels as in the single-threaded Python
  torch::manual_seed(24);
  Net net;
  torch::manual_seed(25);
  const auto x = torch::randn({16, 16});
  const auto y = torch::randint(0, 4, {16}, torch::kLong);
  const std::int64_t seed = 26;
  c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
  for (const auto& item : net->named_parameters()) dict.insert("param." + item.key(), item.value().detach().clone());
  for (const auto& item : net->named_buffers()) dict.insert("buffer." + item.key(), item.value().clone());
  dict.insert("x", x);
  dict.insert("y", y);
  dict.insert("seed", seed);
  const auto input = test::temp_path("parity_checkpoint.pt");
  const auto output = test::temp_path("parity_checkpoint.txt");
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(input, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  std::remove(output.c_str());
  const std::filesystem::path script = MIXPREC_CHECKPOINT_SCRIPT;
  std::string mode_list;
  for (const auto& mode : modes) mode_list += (mode_list.empty() ? "" : ",") + mode;
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + script.string() + " " + input +
                       " " + output + " " + mode_list;
  REQUIRE(std::system(command.c_str()) == 0);
  const auto python = read_python(output);
  REQUIRE(!python.empty());
  for (const auto& mode : modes) {
    const auto plain = run_cpp(mode, "plain", x, y, seed);
    const auto checkpointed = run_cpp(mode, "checkpoint", x, y, seed);
    double worst = 0, worst_plain = 0;
    std::size_t compared = 0;
    for (const auto& [key, ours] : checkpointed) {
      CAPTURE(key);
      const auto name = key.substr(key.rfind(' ') + 1);
      const bool buffer = name.find(".grad") == std::string::npos && name != "loss";
      const auto theirs_plain = python.at(mode + " plain " + name);
      const auto theirs = python.at(mode + " checkpoint " + name);
      const auto ours_plain = plain.at(mode + " plain " + name);
      worst_plain = std::max(worst_plain, largest(ours_plain, theirs_plain));
      CHECK(ours_plain == theirs_plain);   // the model itself as Python's
      CHECK(ours == ours_plain);           // mixprec's checkpoint changes nothing
      if (!buffer) {
        CHECK(ours == theirs);             // Python's checkpoint neither, for the gradients
        worst = std::max(worst, largest(ours, theirs));
        ++compared;
      }
    }
    // BatchNorm's running statistics: Python's recompute updates them a second time.
    const auto stats = mode + " checkpoint blocks.0.norm.running_mean";
    const double python_twice = largest(python.at(stats), python.at(mode + " plain blocks.0.norm.running_mean"));
    MESSAGE(mode << ": " << compared << " tensors (loss, x's and every parameter's gradient) against "
            "Python's checkpoint: largest difference " << worst << "; the model without "
            "checkpointing: " << worst_plain << ". BatchNorm's running mean after the step: "
            "mixprec's checkpoint as without it; Python's differs from its own unchecked run by up "
            "to " << python_twice << " (updated twice)");
    CHECK(compared == 2 + net->parameters().size());
    CHECK(python_twice > 0);
  }
  at::set_num_threads(threads);
}

}  // namespace

TEST_CASE("against torch.utils.checkpoint(use_reentrant=False): the same loss and gradients, bitwise, fp32") {
  check_against_python({"fp32"});
}

// LibTorch 1.13 (and Debian's Python torch 1.13 beside it): the model's norms cannot read bf16
// activations with fp32 weights, so bf16 autocast is compared from LibTorch 2.x on.
TEST_CASE("against torch.utils.checkpoint(use_reentrant=False): the same loss and gradients, bitwise, bf16 autocast" *
          doctest::skip(!mp::mixed_dtype_norms)) {
  check_against_python({"bf16"});
}

// ---- The misuses above against torch.utils.checkpoint(use_reentrant=False) on the same kinds
// of models (parity_checkpoint.py misuse): where Python raises CheckpointError, where it returns
// the gradients of what the forward pass computed, and where those of the changed state.

namespace {

// Debian's Python torch 1.13 beside LibTorch 1.13 has no recompute check: its eval() case raises
// an unrelated RuntimeError and its BatchNorm case crashes the interpreter.
constexpr bool kNoPythonCheck = TORCH_VERSION_MAJOR < 2;

}  // namespace

TEST_CASE("against torch.utils.checkpoint: an Error wherever Python raises CheckpointError or returns the gradients of the changed state" *
          doctest::skip(kNoPythonCheck)) {
  const auto output = test::temp_path("parity_checkpoint_misuse.txt");
  std::remove(output.c_str());
  const std::filesystem::path script = MIXPREC_CHECKPOINT_SCRIPT;
  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + script.string() + " - " + output + " misuse";
  REQUIRE(std::system(command.c_str()) == 0);
  // case -> (Python's outcome, its gradients' difference from the unchanged run's)
  std::map<std::string, std::pair<std::string, double>> python;
  for (const auto& [key, values] : read_python(output)) {
    std::istringstream fields(key);
    std::string misuse, name, outcome;
    fields >> misuse >> name >> outcome;
    python[name] = {outcome, values.empty() ? NAN : values[0]};
  }
  torch::manual_seed(30);
  const auto seq = torch::randn({5, 2, 16}), images = torch::randn({4, 3, 6, 6}), rows = torch::randn({4, 16});
  torch::nn::Linear linear(16, 16);
  auto scale = std::make_shared<double>(3.0);
  const auto mask = torch::full({16}, 3.0);
  const auto block_of = [&](auto fn) {
    return [fn](const at::Tensor& x, bool checkpointed) mutable { return checkpointed ? mp::checkpoint(fn, x) : fn(x); };
  };
  auto step = mlp();
  const auto weight = step[0]->as<torch::nn::Linear>()->weight;
  const auto add = [weight](double v) {
    return [weight, v] {
      const torch::NoGradGuard no_grad;
      weight.add_(v);
    };
  };
  const std::map<std::string, std::function<Misuse()>> ours{
      {"encoder_eval", [&] { return module_mode_misuse(mp::nn::Checkpointed<torch::nn::TransformerEncoderLayer>(encoder_options()), seq, true); }},
      {"conv_bn_eval", [&] { return module_mode_misuse(mp::nn::Checkpointed<torch::nn::Sequential>(conv_block()), images, true); }},
      {"conv_bn_train", [&] { return module_mode_misuse(mp::nn::Checkpointed<torch::nn::Sequential>(conv_block()), images, false); }},
      {"mlp_eval", [&] { return module_mode_misuse(mp::nn::Checkpointed<torch::nn::Sequential>(mlp()), rows, true); }},
      {"scalar_after", [&] {
         return misuse(*linear, rows, block_of([linear, scale](const at::Tensor& h) mutable { return linear(h) * *scale; }),
                       [scale] { *scale = 8.0; }, [scale] { *scale = 3.0; });
       }},
      {"scalar_before", [&] {
         return misuse(*linear, rows, block_of([linear, scale](const at::Tensor& h) mutable { return torch::gelu(linear(h) * *scale); }),
                       [scale] { *scale = 8.0; }, [scale] { *scale = 3.0; });
       }},
      {"captured_tensor", [&] {
         return misuse(*linear, rows, block_of([linear, mask](const at::Tensor& h) mutable { return linear(h) * mask; }),
                       [mask] { mask.fill_(8.0); }, [mask] { mask.fill_(3.0); });
       }},
      {"parameter_step", [&] { return misuse(*step, rows, block_of([step](const at::Tensor& h) mutable { return step->forward(h); }), add(0.5), add(-0.5)); }},
  };
  REQUIRE(python.size() == ours.size());
  for (const auto& [name, run] : ours) {
    CAPTURE(name);
    REQUIRE(python.count(name) == 1);
    const auto& [outcome, off] = python.at(name);
    const auto mine = run();
    MESSAGE(name << ": Python " << outcome << (outcome == "gradient" ? " off by " + std::to_string(off) : "")
                 << "; mixprec " << outcome_of(mine).substr(0, 160));
    CHECK(!mine.error.empty());  // mixprec: an Error in every case
  }
  // Python's outcomes, as docs/guide.md states them: CheckpointError where the mode changes
  // what the block saves; the right gradients where nothing it saves changes (another mode of a
  // block without dropout or BatchNorm, a number read after its last saving op: its graph keeps
  // the first run's number); the gradients of the new values where a saved tensor changes.
  for (const auto* name : {"encoder_eval", "conv_bn_eval", "conv_bn_train"}) CHECK(python.at(name).first == "CheckpointError");
  for (const auto* name : {"mlp_eval", "scalar_after"}) CHECK(python.at(name) == std::make_pair(std::string("gradient"), 0.0));
  for (const auto* name : {"scalar_before", "captured_tensor", "parameter_step"}) {
    CHECK(python.at(name).first == "gradient");
    CHECK(python.at(name).second > 1);
  }
}

}  // namespace test_recompute
