// Trainers whose Adam moments are kept in a block format (Moments8bit, Moments4bit,
// MomentsFp8; core/state_storage.hpp): the state they keep, the masters' storages against each
// other, accumulation, a precision map, checkpoints (resumed bit for bit, loaded into a plain
// trainer and back), and the inputs they refuse.
#include <mixprec/mixprec.hpp>

#include "quantized_support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace test_quantized_trainer {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;
using mp::MomentCoding;
using mp::MomentFormat;

namespace {

using Q8Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<mp::Moments8bit<>>>;
using Q8Masters = mp::MixedO2<at::BFloat16, mp::Fp32Masters<mp::Moments8bit<>>>;
using Q8Stochastic = mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::Moments8bit<>>>;
using Q4Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<mp::Moments4bit<>>>;
using Q4Masters = mp::MixedO2<at::BFloat16, mp::Fp32Masters<mp::Moments4bit<>>>;
using Fp8Remainder = mp::MixedO2<at::BFloat16, mp::RemainderMasters<mp::MomentsFp8<>>>;
using Fp8Masters = mp::MixedO2<at::BFloat16, mp::Fp32Masters<mp::MomentsFp8<>>>;
using Q4Stochastic = mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::Moments4bit<>>>;
using Fp8Stochastic = mp::PureHalf<at::BFloat16, mp::StochasticRounding<mp::MomentsFp8<>>>;
using PlainO2 = mp::MixedO2<at::BFloat16>;

// Tensors of each kind a block format treats apart: fc1.weight (4096: quantized in every
// format), fc2.weight (5120 = 20 blocks of 256), fc3.weight (4224: 33 blocks of 128, no
// multiple of 256: quantized in 4 bits only), the rest under 4096 (plain), LayerNorm's
// included.
// fc2 may be kept fp32 by a precision map (a Mappable).
struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(32, 128))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({128})))),
        fc2(register_module("fc2", mp::nn::Mappable<torch::nn::Linear>(128, 40))),
        fc3(register_module("fc3", torch::nn::Linear(40, 4))),
        fc4(register_module("fc4", torch::nn::Linear(128, 33))) {}
  at::Tensor forward(const at::Tensor& x) {
    const auto h = ln(torch::relu(fc1(x)));
    return fc3(torch::relu(fc2(h))) + fc4(h).narrow(1, 0, 4);
  }
  torch::nn::Linear fc1;
  torch::nn::LayerNorm ln;
  mp::nn::Mappable<torch::nn::Linear> fc2;
  torch::nn::Linear fc3, fc4;
};
TORCH_MODULE(Net);

Net make_net() {
  torch::manual_seed(7);
  return Net();
}

std::pair<at::Tensor, at::Tensor> batch(int s) {
  auto g = at::make_generator<at::CPUGeneratorImpl>(900 + static_cast<std::uint64_t>(s));
  return {at::randn({16, 32}, g), at::randint(0, 4, {16}, g)};
}

template <class P>
mp::StepReport train_step(mp::Trainer<P>& trainer, Net& net, int s) {
  const auto [x, y] = batch(s);
  return trainer.step([&] {
    return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)).to(at::kFloat), y);
  });
}

std::vector<at::Tensor> values(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

bool same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (a[i].scalar_type() != b[i].scalar_type() || !torch::equal(a[i], b[i])) return false;
  }
  return true;
}

// Every Adam moment the optimizer holds, in its param order (exp_avg, exp_avg_sq of each).
std::vector<at::Tensor> moments(torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  auto& states = optimizer.state();
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) {
      const auto it = states.find(mp::detail::state_key<std::decay_t<decltype(states)>>(p));
      if (it == states.end()) continue;
      const auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
    }
  }
  return out;
}

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<at::Tensor>& params) {
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(1e-2).weight_decay(0.05));
}

}  // namespace

static_assert(mp::PrecisionPolicy<Q8Remainder> && mp::PrecisionPolicy<Q8Stochastic> &&
              mp::PrecisionPolicy<Q4Masters> && mp::PrecisionPolicy<Fp8Remainder>);
static_assert(mp::detail::quantized_moments<Q8Masters> && mp::detail::lean_state<Q8Masters> &&
              !mp::detail::quantized_moments<PlainO2>);

TEST_CASE("block formats: the policies' names, as messages and checkpoints print them") {
  CHECK(Q8Remainder::name == "MixedO2<BFloat16, RemainderMasters<Moments8bit>>");
  CHECK(Q8Stochastic::name == "PureHalf<BFloat16, StochasticRounding<Moments8bit>>");
  CHECK(mp::MixedO2<at::BFloat16, mp::Fp32Masters<mp::Moments4bit<64>>>::name ==
        "MixedO2<BFloat16, Fp32Masters<Moments4bit<64>>>");
  CHECK(Fp8Masters::name == "MixedO2<BFloat16, Fp32Masters<MomentsFp8>>");
  CHECK(mp::detail::moment_coding_name(mp::detail::moment_coding_of<Q4Remainder>) == "Moments4bit<128>");
  for (const auto coding : {MomentCoding{MomentFormat::dynamic8, 256}, MomentCoding{MomentFormat::dynamic4, 2},
                            MomentCoding{MomentFormat::fp8, 65536}, MomentCoding{}}) {
    CHECK(mp::detail::moment_coding_named(mp::detail::moment_coding_name(coding)) == coding);
  }
  for (const char* bad : {"Moments8bit<0>", "Moments4bit<3>", "Moments8bit<65537>", "MomentsFp8<>",
                          "Moments8bit<12a>", "Moments16bit<8>"}) {
    CHECK_FALSE(mp::detail::moment_coding_named(bad).has_value());
  }
}

// RemainderMasters keeps the fp32 master exactly, so that its trainer is Fp32Masters' bit for
// bit, in every block format: the same weights, moments (rows) and masters after every step.
TEST_CASE_TEMPLATE("block formats: RemainderMasters trains as Fp32Masters, bit for bit, and "
                   "keeps rows of the format", Pair,
                   std::pair<Q8Remainder, Q8Masters>, std::pair<Q4Remainder, Q4Masters>,
                   std::pair<Fp8Remainder, Fp8Masters>) {
  using PA = typename Pair::first_type;
  using PB = typename Pair::second_type;
  constexpr auto coding = mp::detail::moment_coding_of<PA>;
  auto a = make_net();
  auto b = make_net();
  auto oa = make_adamw(a->parameters());
  auto ob = make_adamw(b->parameters());
  mp::Trainer<PA> ta(a, *oa, mp::TrainerOptions().max_grad_norm(1.0));
  mp::Trainer<PB> tb(b, *ob, mp::TrainerOptions().max_grad_norm(1.0));
  for (int s = 0; s < 6; ++s) {
    const auto ra = train_step(ta, a, s);
    const auto rb = train_step(tb, b, s);
    REQUIRE(ra.status == mp::StepStatus::stepped);
    CHECK(torch::equal(ra.loss, rb.loss));
    INFO("step ", s);
    CHECK(same_bits(a->parameters(), b->parameters()));
    CHECK(same_bits(moments(*oa), moments(*ob)));
  }
  CHECK(same_bits(ta.master_weights(), tb.master_weights()));
  // Which tensors are rows: the 4096- and 5120-element weights in every format, the 4224 one
  // in 4 bits; the others plain fp32.
  const auto held = moments(*oa);
  std::int64_t rows = 0, plain = 0, row_bytes = 0;
  for (const auto& m : held) {
    if (m.scalar_type() == at::kByte) {
      ++rows;
      row_bytes += m.numel();
      CHECK(m.size(1) == mp::detail::row_bytes(coding.format, coding.block));
    } else {
      ++plain;
      CHECK(m.scalar_type() == at::kFloat);
    }
  }
  const std::int64_t quantized = coding.format == MomentFormat::dynamic4 ? 3 : 2;
  CHECK(rows == 2 * quantized);
  CHECK(plain == 2 * (10 - quantized));
  const std::int64_t elements = 4096 + 5120 + (quantized == 3 ? 4224 : 0);
  CHECK(row_bytes == 2 * (elements / coding.block) * mp::detail::row_bytes(coding.format, coding.block));
  MESSAGE(PA::name, ": ", rows, " moments in rows (", row_bytes, " bytes for ", 2 * elements,
          " values), ", plain, " plain; 6 steps bit for bit as ", PB::name);
}

// Micro-batches accumulated in the fp32 master gradients; a module kept fp32 by a precision map
// (fc2: its own master, stepped as an fp32 tensor with moments in rows); clipping: the
// storages still train alike, bit for bit.
TEST_CASE("block formats: accumulation and a precision map, RemainderMasters as Fp32Masters") {
  const auto run = [](auto policy, int accumulation) {
    using P = decltype(policy);
    auto net = make_net();
    mp::apply_precision_map<P>(net.ptr(), mp::PrecisionMap().keep_fp32("fc2"));
    auto optimizer = make_adamw(net->parameters());
    mp::Trainer<P> trainer(net, *optimizer,
                           mp::TrainerOptions().accumulation_steps(accumulation).max_grad_norm(0.5));
    for (int s = 0; s < 6; ++s) train_step(trainer, net, s);
    CHECK(net->named_parameters()["fc2.weight"].scalar_type() == at::kFloat);
    return std::make_pair(values(net->parameters()), moments(*optimizer));
  };
  for (const int accumulation : {1, 3}) {
    INFO("accumulation_steps ", accumulation);
    const auto [wa, ma] = run(Q8Remainder{}, accumulation);
    const auto [wb, mb] = run(Q8Masters{}, accumulation);
    CHECK(same_bits(wa, wb));
    CHECK(same_bits(ma, mb));
    // fc2's weight (5120 fp32 values) keeps rows too.
    std::int64_t rows = 0;
    for (const auto& m : ma) rows += m.scalar_type() == at::kByte ? 1 : 0;
    CHECK(rows == 4);
  }
}

// A run saved after 3 steps and resumed in a new trainer steps as the uninterrupted run, bit
// for bit; its checkpoint loads into a trainer of plain moments (MixedO2<BFloat16>: fp32 moments
// decoded from the rows), and that one's checkpoint back into a block format (coded anew), or
// into another block format.
TEST_CASE("block formats: checkpoints resume bit for bit, load into plain moments and back") {
  const auto dir = test::temp_path("quantized_checkpoints");
  std::filesystem::create_directories(dir);
  const auto path = dir + "/q8.ckpt";
  auto straight = make_net();
  auto so = make_adamw(straight->parameters());
  mp::Trainer<Q8Remainder> ts(straight, *so);
  auto resumed = make_net();
  auto ro = make_adamw(resumed->parameters());
  {
    auto first = make_net();
    auto fo = make_adamw(first->parameters());
    mp::Trainer<Q8Remainder> tf(first, *fo);
    for (int s = 0; s < 3; ++s) {
      train_step(ts, straight, s);
      train_step(tf, first, s);
    }
    tf.save(path);
  }
  mp::Trainer<Q8Remainder> tr(resumed, *ro);
  tr.load(path);
  CHECK(same_bits(moments(*ro), moments(*so)));
  for (int s = 3; s < 6; ++s) {
    train_step(ts, straight, s);
    train_step(tr, resumed, s);
    CHECK(same_bits(resumed->parameters(), straight->parameters()));
  }
  CHECK(same_bits(moments(*ro), moments(*so)));

  // Into plain moments: fp32, the rows decoded; the masters and model as saved.
  auto plain = make_net();
  auto po = make_adamw(plain->parameters());
  mp::Trainer<PlainO2> tp(plain, *po);
  tp.load(path);
  auto coded = make_net();
  auto co = make_adamw(coded->parameters());
  mp::Trainer<Q8Remainder> tc(coded, *co);
  tc.load(path);  // the rows as saved
  const auto saved = moments(*co), decoded = moments(*po);
  REQUIRE(saved.size() == decoded.size());
  constexpr auto q8 = mp::detail::moment_coding_of<Q8Remainder>;
  std::int64_t rows = 0;
  for (std::size_t i = 0; i < saved.size(); ++i) {
    CHECK(decoded[i].scalar_type() == at::kFloat);
    if (saved[i].scalar_type() != at::kByte) {
      CHECK(torch::equal(decoded[i], saved[i]));
      continue;
    }
    ++rows;
    const auto values = mp::detail::dequantize_blocks(saved[i], q8, /*is_signed=*/i % 2 == 0);
    CHECK(torch::equal(decoded[i].reshape({-1}), values));
  }
  CHECK(rows == 4);
  CHECK(same_bits(tp.master_weights(), tc.master_weights()));
  CHECK(same_bits(plain->parameters(), coded->parameters()));
  // And back, into 8 bits and into 4 bits: each moment coded from the plain one's values.
  const auto plain_path = dir + "/plain.ckpt";
  tp.save(plain_path);
  const auto back = [&](auto policy) {
    using P = decltype(policy);
    auto net = make_net();
    auto o = make_adamw(net->parameters());
    mp::Trainer<P> t(net, *o);
    t.load(plain_path);
    constexpr auto coding = mp::detail::moment_coding_of<P>;
    const auto held = moments(*o);
    REQUIRE(held.size() == decoded.size());
    for (std::size_t i = 0; i < held.size(); ++i) {
      if (held[i].scalar_type() != at::kByte) {
        CHECK(torch::equal(held[i], decoded[i]));
        continue;
      }
      CHECK(torch::equal(held[i], mp::detail::quantize_blocks(decoded[i], coding, i % 2 == 0)));
    }
    CHECK(same_bits(t.master_weights(), tp.master_weights()));
    train_step(t, net, 6);  // and trains on
  };
  back(Q8Remainder{});
  back(Q4Masters{});
  // One block format's checkpoint into another: decoded, then coded.
  auto q4 = make_net();
  auto q4o = make_adamw(q4->parameters());
  mp::Trainer<Q4Remainder> t4(q4, *q4o);
  t4.load(path);
  const auto held = moments(*q4o);
  constexpr auto c4 = mp::detail::moment_coding_of<Q4Remainder>;
  for (std::size_t i = 0; i < held.size(); ++i) {
    if (held[i].scalar_type() == at::kByte) {
      CHECK(torch::equal(held[i], mp::detail::quantize_blocks(decoded[i], c4, i % 2 == 0)));
    }
  }
  std::filesystem::remove_all(dir);
}

TEST_CASE("block formats: an optimizer whose moments they cannot keep is an Error that "
          "changes nothing") {
  auto net = make_net();
  std::vector<at::Tensor> copies = values(net->parameters());
  const auto refused = [&](torch::optim::Optimizer& optimizer, const char* message) {
    CHECK_THROWS_WITH_AS(mp::Trainer<Q8Remainder>(net, optimizer), doctest::Contains(message),
                         mp::Error);
    CHECK_THROWS_WITH_AS(mp::Trainer<Q8Stochastic>(net, optimizer), doctest::Contains(message),
                         mp::Error);
    CHECK(same_bits(net->parameters(), copies));  // still fp32, untouched
    CHECK(optimizer.state().empty());
  };
  torch::optim::Adagrad adagrad(net->parameters(), torch::optim::AdagradOptions(1e-2));
  // Adagrad makes its state when built: it must stay as it was.
  adagrad.state().clear();
  refused(adagrad, "which only torch::optim::Adam and AdamW keep");
  torch::optim::RMSprop rmsprop(net->parameters(), torch::optim::RMSpropOptions(1e-3));
  refused(rmsprop, "this optimizer is torch::optim::RMSprop");
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  refused(sgd, "which only torch::optim::Adam and AdamW keep");
  struct MyAdamW : torch::optim::AdamW {  // a user's optimizer: it could step otherwise
    using torch::optim::AdamW::AdamW;
  };
  MyAdamW mine(net->parameters(), torch::optim::AdamWOptions(1e-3));
  refused(mine, "MyAdamW");
  torch::optim::AdamW amsgrad(net->parameters(), torch::optim::AdamWOptions(1e-3).amsgrad(true));
  refused(amsgrad, "AMSGrad's max_exp_avg_sq has no format");
  // A param group with AMSGrad added later: the step refuses it before anything changes.
  auto other = make_net();
  std::vector<at::Tensor> first, second;
  for (const auto& item : other->named_parameters()) {
    (item.key().rfind("fc3", 0) == 0 ? second : first).push_back(item.value());
  }
  torch::optim::AdamW optimizer(first, torch::optim::AdamWOptions(1e-2));
  mp::Trainer<Q8Remainder> trainer(other, optimizer);
  train_step(trainer, other, 0);
  const auto weights = values(other->parameters());
  const auto held = moments(optimizer);
  optimizer.add_param_group(torch::optim::OptimizerParamGroup(
      second, std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(1e-2).amsgrad(true))));
  CHECK_THROWS_WITH_AS(train_step(trainer, other, 1), doctest::Contains("has amsgrad(true)"),
                       mp::Error);
  CHECK(same_bits(other->parameters(), weights));
  CHECK(same_bits(moments(optimizer), held));
}

// torchao's own recipe: the model in bf16, its AdamW8bit / AdamW4bit / AdamWFp8 with
// bf16_stochastic_round=True, run eagerly in Python on the same weights and batches, its random
// rounding replaced by mixprec's (the same bits for the same key): every loss, weight, code and
// scale of PureHalf<BFloat16, StochasticRounding<format>> equal.
TEST_CASE_TEMPLATE("block formats: PureHalf<BFloat16, StochasticRounding<format>> trains as "
                   "torchao's low-bit AdamW on a bf16 model, bit for bit" * doctest::skip(test::kNoTorchao),
                   P, Q8Stochastic, Q4Stochastic, Fp8Stochastic) {
  // One thread, as the Python side: the model's gradients reduced in one order.
  const test::ThreadsFor threads(1);
  constexpr auto coding = mp::detail::moment_coding_of<P>;
  const char* optimizer_name = coding.format == MomentFormat::dynamic8
                                   ? "AdamW8bit"
                                   : (coding.format == MomentFormat::dynamic4 ? "AdamW4bit" : "AdamWFp8");
  constexpr int kSteps = 8;
  constexpr std::uint64_t kSeed = 11;
  const double lr = 3e-3, weight_decay = 0.02;
  auto net = make_net();
  test::Entries entries = {{"optimizer", std::string(optimizer_name)}, {"lr", lr},
                           {"weight_decay", weight_decay}, {"steps", std::int64_t{kSteps}}};
  for (const auto& item : net->named_parameters()) {
    entries.emplace_back("param." + item.key(), item.value().detach().clone());
  }
  const auto count = static_cast<std::int64_t>(net->parameters().size());
  auto keys = torch::zeros({kSteps, count}, at::kLong);
  for (int s = 0; s < kSteps; ++s) {
    const auto [x, y] = batch(s);
    entries.emplace_back("x." + std::to_string(s), x);
    entries.emplace_back("y." + std::to_string(s), y);
    for (std::int64_t k = 0; k < count; ++k) {
      keys[s][k] = static_cast<std::int64_t>(
          mp::detail::rounding_key(kSeed, static_cast<std::uint64_t>(s), static_cast<std::uint64_t>(k)));
    }
  }
  entries.emplace_back("sr_keys", keys);
  const auto python = test::run_torchao("train", entries);
  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
  mp::Trainer<P> trainer(net, optimizer, mp::TrainerOptions().rounding_seed(kSeed));
  std::int64_t differ = 0, compared = 0;
  double largest = 0;  // the largest weight difference
  for (int s = 0; s < kSteps; ++s) {
    const auto report = train_step(trainer, net, s);
    const at::Tensor theirs = test::entry(python, "loss." + std::to_string(s));
    const at::Tensor mine = report.loss;
    INFO("step ", s, ": loss ", mine.item().toDouble(), ", torchao's ", theirs.item().toDouble());
    CHECK(test::bit_differences(mine.to(at::kFloat), theirs) == 0);
  }
  auto& states = optimizer.state();
  for (const auto& item : net->named_parameters()) {
    const auto& name = item.key();
    const auto off = test::bit_differences(item.value(), test::entry(python, "p." + name));
    if (off != 0) MESSAGE(name, ": ", off, " of ", item.value().numel(), " weights differ");
    largest = std::max(largest, (item.value().to(at::kDouble) -
                                 test::entry(python, "p." + name).to(at::kDouble))
                                    .abs().max().item<double>());
    differ += off;
    compared += item.value().numel();
  }
  // The optimizer steps the masters (lean: their placeholders), in the model's order.
  const auto masters = trainer.optimizer().param_groups().front().params();
  const auto names = net->named_parameters().keys();
  REQUIRE(masters.size() == names.size());
  for (std::size_t k = 0; k < masters.size(); ++k) {
    const auto it = states.find(mp::detail::state_key<std::decay_t<decltype(states)>>(masters[k]));
    REQUIRE(it != states.end());
    const auto& st = static_cast<torch::optim::AdamWParamState&>(*it->second);
    for (const auto& [moment, tensor] : {std::pair{"exp_avg", st.exp_avg()}, std::pair{"exp_avg_sq", st.exp_avg_sq()}}) {
      const auto key = names[k] + "." + moment;
      if (tensor.scalar_type() == at::kByte) {
        const auto [codes, scales] = test::codes_and_scales(tensor, coding);
        differ += test::bit_differences(codes, test::entry(python, key + ".codes"));
        differ += test::bit_differences(scales, test::entry(python, key + ".scale"));
        compared += codes.numel() + scales.numel();
      } else {
        CHECK(tensor.scalar_type() == at::kBFloat16);  // torchao's zeros_like(p)
        differ += test::bit_differences(tensor, test::entry(python, key).view({-1}));
        compared += tensor.numel();
      }
    }
  }
  MESSAGE(P::name, " vs torchao's ", std::string(optimizer_name), "(bf16_stochastic_round=True), ", kSteps,
          " steps: ", compared, " weights, codes, scales and moments compared, ", differ,
          " differ; largest weight difference ", largest);
  CHECK(differ == 0);
}

// Bytes per parameter between steps, summed from the tensors (Trainer::state_bytes): a model
// of quantized tensors alone (two 16384-element weights) holds its bf16 weights (2 bytes), the
// rows (8 bits: 2 x (256 + 4) / 256 = 2.03 bytes; 4 bits: 2 x (64 + 4) / 128 = 1.06; fp8 as
// 8 bits), no gradient, and what the storage keeps of the masters (StochasticRounding: one
// float per tensor; RemainderMasters: 2 bytes a parameter, and 8 bytes per tie that rounded
// down).
TEST_CASE("block formats: bytes per parameter between steps, from the tensors") {
  constexpr std::int64_t kWidth = 128, kTensors = 2, kParams = kTensors * kWidth * kWidth;
  const auto measure = [](auto policy_tag) {
    using P = decltype(policy_tag);
    torch::manual_seed(3);
    torch::nn::Sequential net(torch::nn::Linear(torch::nn::LinearOptions(kWidth, kWidth).bias(false)),
                              torch::nn::ReLU(),
                              torch::nn::Linear(torch::nn::LinearOptions(kWidth, kWidth).bias(false)));
    torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-3));
    mp::Trainer<P> trainer(net, optimizer);
    for (int s = 0; s < 2; ++s) {
      auto g = at::make_generator<at::CPUGeneratorImpl>(40 + static_cast<std::uint64_t>(s));
      const auto x = at::randn({4, kWidth}, g);
      const auto y = at::randn({4, kWidth}, g);
      trainer.step([&] { return torch::mse_loss(net->forward(trainer.cast_input(x)).to(at::kFloat), y); });
    }
    const auto bytes = trainer.state_bytes();
    CHECK(bytes.optimizer_known);
    CHECK(bytes.gradients == 0);
    CHECK(bytes.weights == 2 * kParams);
    return bytes;
  };
  const auto rows = [](MomentCoding coding) {
    return 2 * (kParams / coding.block) * mp::detail::row_bytes(coding.format, coding.block);
  };
  const auto per_param = [](std::int64_t b) { return static_cast<double>(b) / kParams; };
  const auto q8 = measure(Q8Stochastic{});
  const auto q4 = measure(Q4Stochastic{});
  const auto fp8 = measure(Fp8Stochastic{});
  const auto rem = measure(Q8Remainder{});
  CHECK(q8.optimizer == rows(mp::detail::moment_coding_of<Q8Stochastic>));
  CHECK(q4.optimizer == rows(mp::detail::moment_coding_of<Q4Stochastic>));
  CHECK(fp8.optimizer == rows(mp::detail::moment_coding_of<Fp8Stochastic>));
  CHECK(rem.optimizer == q8.optimizer);
  CHECK(per_param(q8.optimizer) == doctest::Approx(2.03125));
  CHECK(per_param(q4.optimizer) == doctest::Approx(1.0625));
  for (const auto& b : {q8, q4, fp8}) CHECK(b.masters == 4 * kTensors);
  const auto ties = rem.masters - (2 * kParams + 4 * kTensors);
  CHECK(ties >= 0);
  CHECK(ties % 8 == 0);
  CHECK(ties < kParams / 100);
  MESSAGE("training state between steps, bytes per parameter (AdamW, bf16 weights): "
          "StochasticRounding<Moments8bit> ", per_param(q8.total()), " (moments ",
          per_param(q8.optimizer), "), <Moments4bit> ", per_param(q4.total()), " (",
          per_param(q4.optimizer), "), <MomentsFp8> ", per_param(fp8.total()), " (",
          per_param(fp8.optimizer), "); RemainderMasters<Moments8bit> ", per_param(rem.total()));
}

}  // namespace test_quantized_trainer
