// LoRA (include/mixprec/lora/): PEFT's names, initialisation and freezing; merge and unmerge
// with their bound; the frozen base in bf16 and fp8 under the policies, with checkpointing; the
// Errors; and parity with PEFT (tests/nn/parity_lora.py, in the Python of MIXPREC_PYTHON):
// losses and adapters after AdamW steps in fp32 and under bf16 autocast, PEFT's files both ways.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <tuple>
#include <string>
#include <vector>

namespace test_lora {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// Debian's python3 (torch 1.13) has no peft.
constexpr bool kNoPeftPython = TORCH_VERSION_MAJOR < 2;

// Three linear layers of type L: mixprec::nn::Linear, or Float8Linear (an nn::Linear under
// every policy but MixedFP8).
template <class L>
struct NetOf : torch::nn::Module {
  NetOf() {
    fc1 = register_module("fc1", L(16, 32));
    fc2 = register_module("fc2", L(32, 32));
    head = register_module("head", L(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) {
    return head(torch::relu(fc2(torch::relu(fc1(x)))));
  }
  L fc1{nullptr}, fc2{nullptr}, head{nullptr};
};
using Net = NetOf<mp::nn::Linear>;
using Net8 = NetOf<mp::nn::Float8Linear>;

struct MlpImpl : torch::nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", mp::nn::Linear(16, 32));
    fc2 = register_module("fc2", mp::nn::Linear(32, 4));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  mp::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(Mlp);

std::shared_ptr<Net> make_net(std::uint64_t seed = 1) {
  torch::manual_seed(static_cast<std::int64_t>(seed));
  return std::make_shared<Net>();
}

std::pair<at::Tensor, at::Tensor> make_data() {
  torch::manual_seed(7);
  const auto x = torch::randn({128, 16});
  const auto y = x.matmul(torch::randn({16, 4})).argmax(1);
  return {x, y};
}

struct Setup {
  std::int64_t steps = 8, batch = 16, rank = 4, seed = 3;
  double lr = 1e-2, weight_decay = 0.01, alpha = 8, dropout = 0.0;
};

template <class P, class Model>
std::vector<double> train(const std::shared_ptr<Model>& model, const at::Tensor& x, const at::Tensor& y,
                          const Setup& s) {
  torch::optim::AdamW optimizer(mp::trainable_parameters(*model),
                                torch::optim::AdamWOptions(s.lr).weight_decay(s.weight_decay));
  mp::Trainer<P> trainer(model, optimizer);
  torch::manual_seed(s.seed + 1);  // the dropout masks'
  std::vector<double> losses;
  for (std::int64_t step = 0; step < s.steps; ++step) {
    const auto xb = x.slice(0, step * s.batch, (step + 1) * s.batch);
    const auto yb = y.slice(0, step * s.batch, (step + 1) * s.batch);
    const auto report = trainer.step([&] {
      return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(xb)), yb);
    });
    losses.push_back(report.loss.template item<double>());
  }
  return losses;
}

mp::LoraOptions options_of(const Setup& s) {
  return mp::LoraOptions().rank(s.rank).alpha(s.alpha).dropout(s.dropout)
      .seed(static_cast<std::uint64_t>(s.seed)).trainable({"head"});
}

std::vector<std::string> keys_of(const torch::nn::Module& model) {
  std::vector<std::string> keys;
  for (const auto& item : model.named_parameters()) keys.push_back(item.key());
  for (const auto& item : model.named_buffers()) keys.push_back(item.key());
  return keys;
}

}  // namespace

TEST_CASE("apply_lora: PEFT's names and initialisation, the base frozen, the output unchanged "
          "at the start") {
  auto model = make_net();
  const auto x = torch::randn({5, 16});
  const auto before = model->forward(x);
  const auto base_fc1 = model->fc1->weight.clone();
  const auto layers = mp::apply_lora(model, {"fc*"}, mp::LoraOptions().rank(4).seed(9).trainable({"head"}));
  CHECK(layers == std::vector<std::string>{"fc1", "fc2"});
  CHECK(keys_of(*model) == std::vector<std::string>{
            "fc1.weight", "fc1.bias", "fc1.lora_A.weight", "fc1.lora_B.weight", "fc2.weight",
            "fc2.bias", "fc2.lora_A.weight", "fc2.lora_B.weight", "head.weight", "head.bias"});
  // PEFT's draws after torch.manual_seed(9): per layer A, B (nn.Linear's own), A again.
  auto generator = at::detail::createCPUGenerator(9);
  for (const auto& [in, out, layer] : {std::tuple{16, 32, model->fc1.ptr()}, std::tuple{32, 32, model->fc2.ptr()}}) {
    auto a = torch::empty({4, in}), b = torch::empty({out, 4});
    const auto bound_a = std::sqrt(3.0) * (std::sqrt(2.0 / 6.0) / std::sqrt(double(in)));
    const auto bound_b = std::sqrt(3.0) * (std::sqrt(2.0 / 6.0) / std::sqrt(4.0));
    a.uniform_(-bound_a, bound_a, generator);
    b.uniform_(-bound_b, bound_b, generator);
    a.uniform_(-bound_a, bound_a, generator);
    const auto params = layer->named_parameters();
    CHECK(test::identical(params["lora_A.weight"], a));
    CHECK(params["lora_B.weight"].eq(0).all().item<bool>());
  }
  CHECK(mp::trainable_parameters(*model).size() == 6);  // 4 adapters, the head's 2
  CHECK_FALSE(model->fc1->weight.requires_grad());
  CHECK(model->head->weight.requires_grad());
  CHECK(test::identical(model->fc1->weight, base_fc1));
  CHECK(test::identical(model->forward(x), before));  // B = 0: the base's own output, bit for bit
  // The default generator when no seed is given, as PEFT uses it.
  auto other = make_net();
  torch::manual_seed(9);
  mp::apply_lora(other, {"fc1", "fc2"}, mp::LoraOptions().rank(4));
  CHECK(test::identical(other->fc2->named_parameters()["lora_A.weight"],
                        model->fc2->named_parameters()["lora_A.weight"]));
}

TEST_CASE("apply_lora adapts a Float8Linear as it adapts a mixprec::nn::Linear: the same "
          "adapters, losses bit for bit under each policy but MixedFP8") {
  const auto [x, y] = make_data();
  Setup s;
  s.steps = 4;
  const auto run = [&]<class P>(P) {
    CAPTURE(P::name);
    auto plain = make_net();
    torch::manual_seed(1);
    auto fp8 = std::make_shared<Net8>();  // Linear's init from the same seed
    REQUIRE(test::identical(fp8->fc1->weight, plain->fc1->weight));
    CHECK(mp::apply_lora(plain, {"fc1", "fc2"}, options_of(s)) ==
          mp::apply_lora(fp8, {"fc1", "fc2"}, options_of(s)));
    CHECK(keys_of(*fp8) == keys_of(*plain));
    CHECK(mp::lora_layers(*fp8).size() == 2);
    const auto a = train<P>(plain, x, y, s), b = train<P>(fp8, x, y, s);
    CHECK(a == b);
    CHECK(test::identical(fp8->fc2->named_parameters()["lora_B.weight"],
                          plain->fc2->named_parameters()["lora_B.weight"]));
    CHECK(plain->fc2->named_parameters()["lora_B.weight"].ne(0).any().item<bool>());
  };
  run(mp::FullPrecision{});
  run(mp::MixedO1<at::BFloat16>{});
  run(mp::MixedO2<at::BFloat16>{});
}

TEST_CASE("merge_lora and unmerge_lora: W + (alpha / r) B A and back within the stated bound") {
  for (const auto base : {mp::LoraBase::as_is, mp::LoraBase::bf16}) {
    CAPTURE(std::string(mp::detail::lora_base_name(base)));
    auto model = make_net();
    mp::apply_lora(model, {"fc1", "fc2"}, mp::LoraOptions().rank(4).alpha(16).seed(1).base(base));
    {
      at::NoGradGuard no_grad;
      for (auto& p : model->parameters()) {
        if (p.requires_grad()) p.normal_(0, 0.5);  // adapters that change the layer
      }
    }
    const auto x = torch::randn({6, 16});
    const auto unmerged = model->forward(x);
    const auto w = model->fc1->weight.clone();
    const auto delta = model->fc1->adapter
                           ? dynamic_cast<mp::detail::LoraAdapter&>(*model->fc1->adapter).delta_weight()
                           : at::Tensor();
    mp::merge_lora(*model);
    const auto merged = model->forward(x);
    const double u = base == mp::LoraBase::bf16 ? std::ldexp(1.0, -8) : std::ldexp(1.0, -24);
    MESSAGE("merged forward vs adapters: max |diff| " << (merged - unmerged).abs().max().item<double>());
    CHECK((merged - unmerged).abs().max().item<double>() < (base == mp::LoraBase::bf16 ? 0.2 : 1e-4));
    CHECK_THROWS_WITH_AS(mp::merge_lora(*model), doctest::Contains("is merged already"), mp::Error);
    mp::unmerge_lora(*model);
    const auto back = model->fc1->weight.to(at::kFloat), w32 = w.to(at::kFloat);
    // |W' - W| <= (u + 2^-24) (|W + D| + |W|), D the adapter's update.
    const auto bound = (u + std::ldexp(1.0, -24)) * ((w32 + delta).abs() + w32.abs()) * 1.0001;
    MESSAGE("unmerge: max |W' - W| " << (back - w32).abs().max().item<double>() << ", "
            << (back - w32).ne(0).sum().item<std::int64_t>() << " of " << w.numel() << " differ");
    CHECK((back - w32).abs().le(bound).all().item<bool>());
  }
}

TEST_CASE("the frozen base in bf16 or fp8 under FullPrecision, MixedO1, MixedO2 and the lean "
          "storages: no masters, moments or gradients for it, its bytes in state_bytes(), the "
          "base unchanged") {
  const auto [x, y] = make_data();
  std::vector<mp::LoraBase> bases{mp::LoraBase::bf16};
  if (mp::has_fp8) bases.insert(bases.end(), {mp::LoraBase::fp8_rowwise, mp::LoraBase::fp8_tensorwise});
  Setup s;
  s.steps = 4;
  for (const auto base : bases) {
    CAPTURE(std::string(mp::detail::lora_base_name(base)));
    // masters, moments: bytes per trained value under P.
    const auto run = [&]<class P>(P, std::int64_t masters, std::int64_t moments) {
      CAPTURE(P::name);
      auto model = make_net();
      mp::apply_lora(model, {"fc1", "fc2"}, options_of(s).base(base));
      const auto stored = model->fc1->weight.clone();
      const auto dtype = stored.scalar_type();
      CHECK(dtype == (base == mp::LoraBase::bf16 ? at::kBFloat16 : mp::detail::float8_e4m3));
      torch::optim::AdamW optimizer(mp::trainable_parameters(*model), torch::optim::AdamWOptions(1e-2));
      mp::Trainer<P> trainer(model, optimizer);
      double first = 0, last = 0;
      for (std::int64_t step = 0; step < s.steps; ++step) {
        const auto r = trainer.step([&] {
          return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
        });
        (step == 0 ? first : last) = r.loss.template item<double>();
      }
      CHECK(std::isfinite(last));
      CHECK(last < first);
      CHECK(model->fc1->weight.scalar_type() == dtype);  // no cast took it
      CHECK(test::identical(model->fc1->weight, stored));
      CHECK_FALSE(model->fc1->weight.grad().defined());
      const auto bytes = trainer.state_bytes();
      std::int64_t expected = 0;
      for (const auto& p : model->parameters()) expected += p.numel() * static_cast<std::int64_t>(p.element_size());
      CHECK(bytes.weights == expected);
      // Masters and moments for the 6 trained tensors only: 4 adapters and the head.
      std::int64_t trained = 0;
      for (const auto& p : mp::trainable_parameters(*model)) trained += p.numel();
      // A lean storage's master between steps: a one-element fp32 placeholder per tensor.
      constexpr bool lean = mp::detail::lean_pass_storage<P>;
      CHECK(bytes.masters == masters * trained + (lean ? 4 * 6 : 0));
      CHECK(bytes.optimizer == moments * trained);
    };
    run(mp::FullPrecision{}, 0, 8);
    run(mp::MixedO1<at::BFloat16>{}, 0, 8);
    run(mp::MixedO2<at::BFloat16>{}, 4, 8);
    // The lean storages: bf16 remainders as masters, bf16 moments, stochastic rounding.
    run(mp::MixedO2<at::BFloat16, mp::RemainderMasters<>>{}, 2, 8);
    run(mp::MixedO2<at::BFloat16, mp::RemainderMasters<at::BFloat16>>{}, 2, 4);
    run(mp::PureHalf<at::BFloat16, mp::StochasticRounding<>>{}, 0, 4);
  }
}

TEST_CASE("a LoRA base in bf16 computes under bf16 autocast what the fp32 base does, and "
          "checkpointing recomputes it bit for bit") {
  const auto [x, y] = make_data();
  const auto gradients = [&](mp::LoraBase base, bool checkpointed) {
    struct Block : torch::nn::Module {
      Block() { inner = register_module("inner", mp::nn::Checkpointed<Mlp>()); }
      mp::nn::Checkpointed<Mlp> inner{nullptr};
    };
    torch::manual_seed(1);
    auto model = std::make_shared<Block>();
    {
      at::NoGradGuard no_grad;  // weights on the bf16 grid: both bases hold the same values
      for (auto& p : model->parameters()) p.copy_(p.to(at::kBFloat16).to(at::kFloat));
    }
    mp::apply_lora(model, {"inner.fc1", "inner.fc2"}, mp::LoraOptions().rank(4).seed(2).base(base));
    if (checkpointed) mp::apply_checkpointing(model, {"inner"});
    torch::optim::AdamW optimizer(mp::trainable_parameters(*model), torch::optim::AdamWOptions(1e-2));
    mp::Trainer<mp::MixedO1<at::BFloat16>> trainer(model, optimizer);
    std::vector<at::Tensor> losses;
    for (int step = 0; step < 3; ++step) {
      losses.push_back(trainer.step([&] {
        return torch::nn::functional::cross_entropy(model->inner->forward(x), y);
      }).loss.detach().clone());
    }
    std::vector<at::Tensor> weights;
    for (const auto& p : mp::trainable_parameters(*model)) weights.push_back(p.detach().clone());
    losses.insert(losses.end(), weights.begin(), weights.end());
    return losses;
  };
  const auto fp32 = gradients(mp::LoraBase::as_is, false);
  CHECK(test::identical(gradients(mp::LoraBase::bf16, false), fp32));
  CHECK(test::identical(gradients(mp::LoraBase::bf16, true), fp32));
}

TEST_CASE("LoRA's bad input: Errors that say what to do, nothing changed") {
  const auto unchanged = [](const std::shared_ptr<Net>& model, const std::function<void()>& call,
                            const std::string& message) {
    const auto keys = keys_of(*model);
    const auto values = test::snapshot(model->parameters());
    std::vector<bool> grads;
    for (const auto& p : model->parameters()) grads.push_back(p.requires_grad());
    CHECK_THROWS_WITH_AS(call(), doctest::Contains(message.c_str()), mp::Error);
    CHECK(keys_of(*model) == keys);
    CHECK(test::identical(test::snapshot(model->parameters()), values));
    std::vector<bool> after;
    for (const auto& p : model->parameters()) after.push_back(p.requires_grad());
    CHECK(after == grads);
  };
  auto model = make_net();
  unchanged(model, [&] { mp::apply_lora(model, {"fc1", "head"}, mp::LoraOptions().rank(5)); },
            "rank 5 is larger than layer 'head' (32 -> 4 features) allows");
  unchanged(model, [&] { mp::apply_lora(model, {"fc1"}, mp::LoraOptions().alpha(0)); },
            "alpha 0 scales the adapters' output by alpha / rank = 0");
  unchanged(model, [&] { mp::apply_lora(model, {"fc3"}); }, "LoRA pattern 'fc3' matches no module");
  unchanged(model, [&] { mp::apply_lora(model, {"fc1"}, mp::LoraOptions().trainable({"fc*"})); },
            "is both adapted and left trainable");
  auto plain = std::make_shared<torch::nn::Module>();
  plain->register_module("fc", torch::nn::Linear(8, 8));
  CHECK_THROWS_WITH_AS(mp::apply_lora(plain, {"fc"}), doctest::Contains("declare it as mixprec::nn::Linear"),
                       mp::Error);
  mp::apply_lora(model, {"fc1"}, mp::LoraOptions().rank(2));
  unchanged(model, [&] { mp::apply_lora(model, {"fc1"}); }, "(adapters applied twice)");
  if (mp::has_fp8) {
    auto fp8 = make_net();
    mp::apply_lora(fp8, {"fc1"}, mp::LoraOptions().base(mp::LoraBase::fp8_rowwise));
    unchanged(fp8, [&] { mp::merge_lora(*fp8); }, "stores its base in fp8");
    // An optimizer on every parameter would train the fp8 base.
    torch::optim::AdamW all(fp8->parameters(), torch::optim::AdamWOptions(1e-3));
    unchanged(fp8, [&] { mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(fp8, all); },
              "build the optimizer on mixprec::trainable_parameters(model)");
  }
  unchanged(model, [&] { mp::unmerge_lora(*model); }, "is not merged");
}

TEST_CASE("parity with PEFT: losses and adapters after AdamW steps in fp32 and under bf16 "
          "autocast, bit for bit; PEFT's files both ways" * doctest::skip(kNoPeftPython)) {
  const auto dir = test::temp_path("lora_parity");
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  const auto [x, y] = make_data();
  Setup s;
  s.dropout = 0.1;
  const auto base = make_net();
  {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    for (const auto& item : base->named_parameters()) dict.insert("param." + item.key(), item.value().detach().clone());
    dict.insert("x", x);
    dict.insert("y", y);
    dict.insert("steps", s.steps);
    dict.insert("batch", s.batch);
    dict.insert("lr", s.lr);
    dict.insert("weight_decay", s.weight_decay);
    dict.insert("rank", s.rank);
    dict.insert("alpha", s.alpha);
    dict.insert("dropout", s.dropout);
    dict.insert("seed", s.seed);
    const auto bytes = torch::pickle_save(c10::IValue(dict));
    std::ofstream(dir + "/input.pt", std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  }
  const auto fresh = [&] {
    auto model = make_net(99);
    at::NoGradGuard no_grad;
    for (const auto& item : base->named_parameters()) model->named_parameters()[item.key()].copy_(item.value());
    return model;
  };
  std::map<std::string, std::vector<double>> losses;
  std::map<std::string, std::shared_ptr<Net>> trained;
  for (const std::string mode : {"fp32", "bf16"}) {
    auto model = fresh();
    mp::apply_lora(model, {"fc1", "fc2"}, options_of(s));
    losses[mode] = mode == "fp32" ? train<mp::FullPrecision>(model, x, y, s)
                                  : train<mp::MixedO1<at::BFloat16>>(model, x, y, s);
    trained[mode] = model;
  }
  // mixprec's adapter for PeftModel.from_pretrained, its outputs to compare; the merged model.
  auto& fp32_model = *trained["fp32"];
  fp32_model.eval();
  mp::save_lora_adapter(fp32_model, dir + "/mixprec_adapter");
  const auto outputs = fp32_model.forward(x).detach();
  mp::save_merged_safetensors(fp32_model, dir + "/merged.safetensors");

  const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_LORA_SCRIPT + " " +
                       dir + "/input.pt " + dir;
  REQUIRE(std::system(command.c_str()) == 0);

  for (const std::string mode : {"fp32", "bf16"}) {
    CAPTURE(mode);
    std::ifstream in(dir + "/" + mode + "_losses.txt");
    std::vector<double> python;
    for (double v = 0; in >> v;) python.push_back(v);
    REQUIRE(python.size() == losses[mode].size());
    double worst = 0;
    for (std::size_t i = 0; i < python.size(); ++i) worst = std::max(worst, std::abs(python[i] - losses[mode][i]));
    const auto weights = mp::read_safetensors(dir + "/" + mode + "_weights.safetensors");
    std::size_t same = 0;
    for (const auto& item : trained[mode]->named_parameters()) {
      if (!item.value().requires_grad()) continue;
      auto key = "base_model.model." + item.key();
      const auto dot = key.rfind('.');
      key = item.key().rfind("head", 0) == 0
                ? "base_model.model.head.modules_to_save.default" + key.substr(dot)
                : key.substr(0, dot) + ".default" + key.substr(dot);
      REQUIRE(weights.contains(key));
      same += test::identical(weights[key], item.value()) ? 1 : 0;
    }
    MESSAGE(mode << ": " << python.size() << " losses, largest |diff| " << worst << "; " << same
            << " of 6 trained tensors bitwise PEFT's");
    CHECK(worst == 0);
    CHECK(same == 6);
  }
  // PeftModel.from_pretrained of mixprec's adapter computes mixprec's outputs.
  CHECK(test::identical(mp::read_safetensors(dir + "/from_mixprec.safetensors")["out"], outputs));
  // mixprec's merged weights in the plain model: within fp32 rounding of the adapters' output.
  const auto merged = mp::read_safetensors(dir + "/merged_outputs.safetensors")["out"];
  MESSAGE("merged model in Python vs adapters here: max |diff| " << (merged - outputs).abs().max().item<double>());
  CHECK((merged - outputs).abs().max().item<double>() < 1e-5);
  // PEFT's adapter loads into mixprec and computes PEFT's outputs.
  auto loaded = fresh();
  const auto layers = mp::load_lora_adapter(loaded, dir + "/peft_adapter");
  CHECK(layers == std::vector<std::string>{"fc1", "fc2"});
  loaded->eval();
  CHECK(test::identical(loaded->forward(x), mp::read_safetensors(dir + "/peft_outputs.safetensors")["out"]));
  // A config for modules the model does not have: an Error, nothing changed.
  auto other = fresh();
  {
    std::ifstream in(dir + "/peft_adapter/adapter_config.json");
    std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto at = text.find("\"fc1\"");
    REQUIRE(at != std::string::npos);
    text.replace(at, 5, "\"fc9\"");
    std::filesystem::create_directories(dir + "/bad_adapter");
    std::ofstream(dir + "/bad_adapter/adapter_config.json") << text;
    std::filesystem::copy_file(dir + "/peft_adapter/adapter_model.safetensors",
                               dir + "/bad_adapter/adapter_model.safetensors");
  }
  const auto keys = keys_of(*other);
  CHECK_THROWS_WITH_AS(mp::load_lora_adapter(other, dir + "/bad_adapter"),
                       doctest::Contains("target_modules 'fc9'"), mp::Error);
  CHECK(keys_of(*other) == keys);
}

}  // namespace test_lora
