// Loading weights into a model by name (io/load_state_dict.hpp) and into a trained one
// (Trainer::load_weights, trainer/load_weights.hpp): PyTorch's strict semantics, dtype
// conversion, tied weights, buffers, one Error listing every problem and nothing changed; a
// model trained by the Python of MIXPREC_PYTHON (tests/io/weights.py trained) gives its outputs
// in C++ bit for bit, and PyTorch's load_state_dict(strict=False) reports the same keys.
#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace test_load_state_dict {  // one namespace a file: unity groups (tests/CMakeLists.txt)

namespace mp = mixprec;

namespace {

// Debian's python3 (torch 1.13, the system build's Python) has no safetensors.
constexpr bool kNoSafetensorsPython = TORCH_VERSION_MAJOR < 2;

struct Net : test::LinearNormNet {
  Net() : LinearNormNet(4) {}
};

// tests/io/weights.py's Tied: the output layer is the embedding's weight, registered as
// "head.weight" too (LibTorch lists it under both names, as Python's state_dict() does).
struct Tied : torch::nn::Module {
  Tied() {
    embed = register_module("embed", torch::nn::Embedding(11, 8));
    fc = register_module("fc", torch::nn::Linear(8, 16));
    norm = register_module("norm", torch::nn::BatchNorm1d(16));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({16})));
    proj = register_module("proj", torch::nn::Linear(16, 8));
    head = register_module("head", std::make_shared<torch::nn::Module>());
    head->register_parameter("weight", embed->weight);
  }
  at::Tensor forward(const at::Tensor& ids) {
    auto x = embed->forward(ids).reshape({-1, 8});
    x = ln->forward(torch::relu(norm->forward(fc->forward(x))));
    return torch::nn::functional::linear(proj->forward(x), embed->weight);
  }
  torch::nn::Embedding embed{nullptr};
  torch::nn::Linear fc{nullptr}, proj{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  std::shared_ptr<torch::nn::Module> head;
};

// New values for every tensor of `model`, by name (tied ones under each name): what a file
// would hold. Floating ones from the generator, integer ones counted up.
mp::StateDict fresh_values(const torch::nn::Module& model) {
  mp::StateDict dict;
  for (const auto& item : model.named_parameters()) dict.insert(item.key(), torch::randn_like(item.value()));
  for (const auto& item : model.named_buffers()) {
    const auto& b = item.value();
    dict.insert(item.key(), b.is_floating_point() ? torch::rand_like(b) + 0.5 : b + 7);
  }
  return dict;
}

std::vector<at::Tensor> everything(const torch::nn::Module& model) {
  auto all = test::snapshot(model.parameters());
  for (auto& t : test::snapshot(model.buffers())) all.push_back(t);
  return all;
}

// `weights` with its key `from` renamed `to` (the same tensor).
mp::StateDict without(const mp::StateDict& weights, const std::vector<std::string>& drop) {
  mp::StateDict out;
  for (const auto& item : weights) {
    if (std::find(drop.begin(), drop.end(), item.key()) == drop.end()) out.insert(item.key(), item.value());
  }
  return out;
}

// The files of `weights.py trained`, written once per process: one Python run for this file.
const std::string& trained_files() {
  static const std::string directory = [] {
    const auto dir = test::temp_path("weights_trained");
    std::filesystem::remove_all(dir);
    const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_WEIGHTS_SCRIPT +
                         " trained " + dir;
    if (std::system(command.c_str()) != 0) throw std::runtime_error("failed: " + command);
    return dir;
  }();
  return directory;
}

mp::detail::Json trained_manifest() {
  std::ifstream in(trained_files() + "/manifest.json");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return mp::detail::JsonParser::parse(text, "manifest");
}

std::vector<std::string> strings(const mp::detail::Json& array) {
  std::vector<std::string> out;
  for (const auto& item : array.items) out.push_back(item.text);
  return out;
}

// One thread for a forward pass: the Python side computed with one (weights.py).
template <class F>
auto one_thread(F&& f) {
  const auto threads = at::get_num_threads();
  at::set_num_threads(1);
  auto result = f();
  at::set_num_threads(threads);
  return result;
}

}  // namespace

TEST_CASE("load_state_dict: every parameter and buffer by name, each converted to its dtype as copy_ converts") {
  torch::manual_seed(1);
  Net net;
  auto weights = fresh_values(net);
  weights["fc1.weight"] = weights["fc1.weight"].to(at::kBFloat16);  // exact in fp32
  weights["fc1.bias"] = weights["fc1.bias"].to(at::kDouble);        // rounded to fp32
  weights["norm.num_batches_tracked"] = weights["norm.num_batches_tracked"].to(at::kInt);
  const auto report = mp::load_state_dict(net, weights);
  CHECK(report.missing_keys.empty());
  CHECK(report.unexpected_keys.empty());
  for (const auto& item : net.named_parameters()) {
    CAPTURE(item.key());
    CHECK(test::identical(item.value(), weights[item.key()].to(at::kFloat)));
  }
  for (const auto& item : net.named_buffers()) {
    CAPTURE(item.key());
    CHECK(test::identical(item.value(), weights[item.key()].to(item.value().scalar_type())));
  }
  CHECK(net.norm->num_batches_tracked.scalar_type() == at::kLong);
  CHECK(net.fc1->weight.requires_grad());  // parameters stay parameters
  CHECK_FALSE(net.fc1->weight.grad().defined());

  // LibTorch registers a bias-free Linear's bias as an undefined tensor; Python's state_dict()
  // has no key for it (a None parameter), and none is missing.
  torch::nn::Linear no_bias(torch::nn::LinearOptions(2, 3).bias(false));
  mp::StateDict weight_only;
  weight_only.insert("weight", torch::ones({3, 2}));
  CHECK(mp::load_state_dict(*no_bias, weight_only).missing_keys.empty());
  CHECK(torch::equal(no_bias->weight, torch::ones({3, 2})));
}

TEST_CASE("load_state_dict: missing and unexpected keys are one Error under strict, nothing loaded; "
          "strict(false) loads the rest and reports them, as PyTorch's strict=False") {
  torch::manual_seed(2);
  Net net;
  const auto before = everything(net);
  auto weights = without(fresh_values(net), {"fc2.bias", "norm.running_var"});
  weights.insert("head.weight", torch::zeros({2, 8}));
  CHECK_THROWS_WITH_AS(mp::load_state_dict(net, weights),
                       doctest::Contains("cannot load the state dict into the model: 2 of the model's tensors "
                                         "have no key (missing keys: 'fc2.bias', 'norm.running_var'); 1 key "
                                         "names no tensor of the model (unexpected keys: 'head.weight'). Nothing "
                                         "was loaded (LoadOptions().strict(false) loads"),
                       mp::Error);
  CHECK(test::identical(everything(net), before));
  const auto report = mp::load_state_dict(net, weights, mp::LoadOptions().strict(false));
  CHECK(report.missing_keys == std::vector<std::string>{"fc2.bias", "norm.running_var"});
  CHECK(report.unexpected_keys == std::vector<std::string>{"head.weight"});
  CHECK(test::identical(net.fc1->weight, weights["fc1.weight"]));
  CHECK(test::identical(net.norm->running_mean, weights["norm.running_mean"]));
  CHECK(test::identical(net.fc2->bias, before[5]));  // fc1.w, fc1.b, norm.w, norm.b, fc2.w, fc2.b
}

TEST_CASE("load_state_dict: a shape, a kind of dtype, a value beyond the model's dtype are Errors even "
          "with strict(false), all in one message, nothing loaded") {
  torch::manual_seed(3);
  Net net;
  const auto before = everything(net);
  auto weights = without(fresh_values(net), {"fc1.bias"});
  weights["fc1.weight"] = torch::zeros({8, 3});
  weights["norm.num_batches_tracked"] = torch::zeros({}, at::kFloat);
  weights["fc2.bias"] = torch::tensor({0.5, 1e39, 2.0}, at::kDouble);
  weights["norm.weight"] = torch::ones({8}, at::kComplexFloat);
  const auto message = [&] {
    try {
      mp::load_state_dict(net, weights, mp::LoadOptions().strict(false));
    } catch (const mp::Error& e) {
      return std::string(e.what());
    }
    return std::string("no Error");
  }();
  CAPTURE(message);
  CHECK(message.find("'fc1.weight' has shape [8, 3] in the state dict and [8, 4] in the model") != std::string::npos);
  CHECK(message.find("'norm.weight' is ComplexFloat in the state dict and Float in the model (values "
                     "convert between floating-point dtypes, and between integer ones where they fit, "
                     "not across kinds)") != std::string::npos);
  CHECK(message.find("'norm.num_batches_tracked' is Float in the state dict and Long in the model") != std::string::npos);
  CHECK(message.find("'fc2.bias' holds 1e+39 (element 1), beyond the range of Float, the dtype of the "
                     "model: it would load as inf") != std::string::npos);
  CHECK(message.find("Nothing was loaded") != std::string::npos);
  CHECK(message.find("fc1.bias") == std::string::npos);  // strict(false): missing is no problem
  CHECK(test::identical(everything(net), before));

  // Integers convert where they fit, and wrap nowhere.
  torch::nn::Module counts;
  counts.register_buffer("count", torch::zeros({2}, at::kInt));
  mp::StateDict fits;
  fits.insert("count", torch::tensor({5, -3}, at::kLong));
  mp::load_state_dict(counts, fits);
  CHECK(torch::equal(counts.named_buffers()["count"], torch::tensor({5, -3}, at::kInt)));
  fits["count"] = torch::tensor({std::int64_t{5}, std::int64_t{1} << 40}, at::kLong);
  CHECK_THROWS_WITH_AS(mp::load_state_dict(counts, fits),
                       doctest::Contains("'count' holds values that Int, the dtype of the model, cannot hold (they would wrap around)"),
                       mp::Error);
  CHECK(torch::equal(counts.named_buffers()["count"], torch::tensor({5, -3}, at::kInt)));
  // Across signedness a round trip restores the bits of a value that changed sign: uint8 200
  // would load into int8 as -56, int8 -1 into uint8 as 255. Errors both.
  torch::nn::Module bytes;
  bytes.register_buffer("signed", torch::zeros({2}, at::kChar));
  bytes.register_buffer("unsigned", torch::zeros({2}, at::kByte));
  mp::StateDict flips;
  flips.insert("signed", torch::tensor({7, 200}, at::kByte));
  flips.insert("unsigned", torch::tensor({7, -1}, at::kChar));
  const auto flip_message = [&] {
    try {
      mp::load_state_dict(bytes, flips);
    } catch (const mp::Error& e) {
      return std::string(e.what());
    }
    return std::string("no Error");
  }();
  CAPTURE(flip_message);
  CHECK(flip_message.find("'signed' holds values that Char, the dtype of the model, cannot hold") != std::string::npos);
  CHECK(flip_message.find("'unsigned' holds values that Byte, the dtype of the model, cannot hold") != std::string::npos);
  CHECK(torch::equal(bytes.named_buffers()["signed"], torch::zeros({2}, at::kChar)));
  flips["signed"] = torch::tensor({7, 100}, at::kByte);
  flips["unsigned"] = torch::tensor({7, 100}, at::kChar);
  mp::load_state_dict(bytes, flips);  // values that fit load across signedness
  CHECK(torch::equal(bytes.named_buffers()["signed"], torch::tensor({7, 100}, at::kChar)));
  CHECK(torch::equal(bytes.named_buffers()["unsigned"], torch::tensor({7, 100}, at::kByte)));

  // fp16 holds up to 65504: 70000 would be inf in an fp16 model.
  torch::nn::Linear half(2, 2);
  half->to(at::kHalf);
  mp::StateDict big;
  big.insert("weight", torch::tensor({{1.0F, 2.0F}, {70000.0F, 3.0F}}));
  big.insert("bias", torch::zeros({2}));
  CHECK_THROWS_WITH_AS(mp::load_state_dict(*half, big),
                       doctest::Contains("'weight' holds 70000 (element 2), beyond the range of Half, the dtype of the model"),
                       mp::Error);
  big["weight"][1][0] = 60000.0F;
  mp::load_state_dict(*half, big);
  CHECK(half->weight[1][0].item<float>() == 60000.0F);
}

TEST_CASE("load_state_dict: a tied tensor takes either of its keys; keys of one tied tensor that disagree are an Error") {
  torch::manual_seed(4);
  Tied model;
  REQUIRE(model.head->named_parameters()["weight"].is_same(model.embed->weight));
  const auto weights = fresh_values(model);
  // safetensors' save_model keeps one name of a tied pair: either one does.
  for (const auto* dropped : {"head.weight", "embed.weight"}) {
    CAPTURE(dropped);
    Tied fresh;
    const auto report = mp::load_state_dict(fresh, without(weights, {dropped}));
    CHECK(report.missing_keys.empty());
    CHECK(test::identical(fresh.embed->weight, weights[dropped == std::string("head.weight") ? "embed.weight" : "head.weight"]));
  }
  mp::StateDict both = weights;
  both["head.weight"] = weights["embed.weight"].clone();
  CHECK(mp::load_state_dict(model, both).missing_keys.empty());
  CHECK(test::identical(model.embed->weight, weights["embed.weight"]));
  const auto before = everything(model);
  both["head.weight"] = weights["embed.weight"] + 1;
  CHECK_THROWS_WITH_AS(mp::load_state_dict(model, both),
                       doctest::Contains("'embed.weight' and 'head.weight' name one tied tensor of the model "
                                         "but hold different values"),
                       mp::Error);
  CHECK(test::identical(everything(model), before));
  const auto report = mp::load_state_dict(model, without(weights, {"embed.weight", "head.weight"}),
                                          mp::LoadOptions().strict(false));
  CHECK(report.missing_keys == std::vector<std::string>{"embed.weight", "head.weight"});
}

TEST_CASE("LoadOptions::submodule loads into a part of the model, as model.part.load_state_dict does") {
  torch::manual_seed(5);
  Net net;
  const auto before = everything(net);
  mp::StateDict fc1;
  fc1.insert("weight", torch::randn({8, 4}));
  fc1.insert("bias", torch::randn({8}));
  mp::load_state_dict(net, fc1, mp::LoadOptions().submodule("fc1"));
  CHECK(test::identical(net.fc1->weight, fc1["weight"]));
  CHECK(test::identical(net.fc2->weight, before[4]));
  CHECK_THROWS_WITH_AS(mp::load_state_dict(net, fc1, mp::LoadOptions().submodule("fc2")),
                       doctest::Contains("into submodule 'fc2': 'weight' has shape [8, 4] in the state dict and [3, 8] in submodule 'fc2'"),
                       mp::Error);
  CHECK_THROWS_WITH_AS(mp::load_state_dict(net, fc1, mp::LoadOptions().submodule("fc9")),
                       doctest::Contains("the model has no submodule 'fc9' (its submodules: 'fc1', 'norm', 'fc2')"),
                       mp::Error);
}

TEST_CASE("load_weights: a model trained in Python gives its outputs in C++ bit for bit; strict=False reports what PyTorch's does") {
  const auto manifest = trained_manifest();
  torch::manual_seed(6);  // other initial values than Python's: all of them must be loaded
  Tied model;
  const auto report = mp::load_weights(model, trained_files() + "/trained.pt");
  CHECK(report.missing_keys.empty());
  model.eval();
  const auto io = mp::read_torch_save(trained_files() + "/outputs.pt");
  const auto logits = one_thread([&] {
    at::NoGradGuard no_grad;
    return model.forward(io["ids"]);
  });
  const auto diff = (logits - io["logits"]).abs().max().item<double>();
  MESSAGE("Python-trained model (loss ", manifest.find("loss")->text, "), outputs in C++: largest "
          "difference ", diff, " over ", logits.numel(), " logits");
  CHECK(test::identical(logits, io["logits"]));
  const auto partial = mp::load_weights(model, trained_files() + "/partial.pt", mp::LoadOptions().strict(false));
  CHECK(partial.missing_keys == strings(*manifest.find("missing_keys")));
  CHECK(partial.unexpected_keys == strings(*manifest.find("unexpected_keys")));
}

TEST_CASE("load_weights: safetensors' save_model of the Python-trained model (one name of the tied pair) gives the same outputs" *
          doctest::skip(kNoSafetensorsPython)) {
  torch::manual_seed(7);
  Tied model;
  CHECK(mp::read_safetensors(trained_files() + "/trained.safetensors").size() == 12);  // 13 names, one tied
  mp::load_weights(model, trained_files() + "/trained.safetensors");
  model.eval();
  const auto io = mp::read_torch_save(trained_files() + "/outputs.pt");
  const auto logits = one_thread([&] {
    at::NoGradGuard no_grad;
    return model.forward(io["ids"]);
  });
  CHECK(test::identical(logits, io["logits"]));
}

TEST_CASE("Trainer::load_weights under MixedO2: the masters take the file's values, the model their rounding; "
          "Adam's state and the scale stay; into the model alone it is refused") {
  const auto file = trained_files() + "/trained.pt";
  const auto weights = mp::read_torch_save(file);
  torch::manual_seed(8);
  auto model = std::make_shared<Tied>();
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, adam);
  const auto ids = torch::randint(0, 11, {3, 5});
  const auto loss = [&] {
    return torch::nn::functional::cross_entropy(model->forward(ids).to(at::kFloat), ids.reshape({-1}));
  };
  REQUIRE(trainer.step(loss).stepped());
  const auto moments = test::adam_moments(adam);
  const double scale = trainer.scaler().get_scale();
  CHECK_THROWS_WITH_AS(mp::load_weights(*model, file),
                       doctest::Contains("this model is trained by a live Trainer<MixedO2<BFloat16>>: load weights through it"),
                       mp::Error);
  const auto before = trainer.fp32_state_dict();
  mp::StateDict reshaped = weights;
  reshaped["fc.bias"] = torch::zeros({15});
  CHECK_THROWS_WITH_AS(trainer.load_state_dict(reshaped), doctest::Contains("'fc.bias' has shape [15] in the state dict and [16] in the model"), mp::Error);
  for (const auto& item : trainer.fp32_state_dict()) CHECK(test::identical(item.value(), before[item.key()]));

  CHECK(trainer.load_weights(file).missing_keys.empty());
  const auto masters = trainer.fp32_state_dict();
  for (const auto& item : weights) {
    CAPTURE(item.key());
    CHECK(test::identical(masters[item.key()], item.value()));  // exact, not rounded through bf16
  }
  CHECK(model->fc->weight.scalar_type() == at::kBFloat16);
  CHECK(test::identical(model->fc->weight, weights["fc.weight"].to(at::kBFloat16)));
  CHECK(test::identical(model->embed->weight, weights["head.weight"].to(at::kBFloat16)));
  CHECK(test::identical(model->norm->running_var, weights["norm.running_var"]));
  CHECK(test::adam_moments(adam) == moments);
  CHECK(trainer.scaler().get_scale() == scale);
  CHECK(trainer.step(loss).stepped());  // from the loaded weights
}

TEST_CASE("Trainer::load_weights: between optimizer steps only; FullPrecision and PureHalf load into the model itself") {
  const auto file = trained_files() + "/trained.pt";
  const auto weights = mp::read_torch_save(file);
  torch::manual_seed(9);
  auto model = std::make_shared<Tied>();
  torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::FullPrecision> trainer(model, sgd, mp::TrainerOptions().accumulation_steps(2));
  const auto ids = torch::randint(0, 11, {3, 5});
  const auto loss = [&] {
    return torch::nn::functional::cross_entropy(model->forward(ids), ids.reshape({-1}));
  };
  REQUIRE(trainer.step(loss).status == mp::StepStatus::accumulating);
  const auto before = everything(*model);
  CHECK_THROWS_WITH_AS(trainer.load_weights(file),
                       doctest::Contains("load_weights() in the middle of an accumulation (1 of 2 micro-batches)"),
                       mp::Error);
  CHECK(test::identical(everything(*model), before));
  REQUIRE(trainer.step(loss).stepped());
  trainer.load_weights(file);
  CHECK(test::identical(model->proj->weight, weights["proj.weight"]));

  torch::manual_seed(10);
  auto low = std::make_shared<Tied>();
  torch::optim::SGD low_sgd(low->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::PureHalf<at::BFloat16>> pure(low, low_sgd);
  pure.load_weights(file);
  CHECK(test::identical(low->proj->weight, weights["proj.weight"].to(at::kBFloat16)));
}

TEST_CASE("Trainer::save_fp32 (LibTorch's pickle of (name, tensor) pairs) loads back into a model") {
  torch::manual_seed(11);
  auto model = std::make_shared<Net>();
  torch::optim::Adam adam(model->parameters(), torch::optim::AdamOptions(1e-2));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(model, adam);
  const auto x = torch::randn({6, 4});
  const auto y = torch::randint(0, 3, {6}, at::kLong);
  REQUIRE(trainer.step([&] {
    return torch::nn::functional::cross_entropy(model->forward(trainer.cast_input(x)), y);
  }).stepped());
  const auto path = test::temp_path("save_fp32_reload.pt");
  trainer.save_fp32(path, mp::WeightsFormat::pickle);
  Net fresh;
  mp::load_weights(fresh, path);
  const auto expected = trainer.fp32_state_dict();
  for (const auto& item : fresh.named_parameters()) CHECK(test::identical(item.value(), expected[item.key()]));
  for (const auto& item : fresh.named_buffers()) CHECK(test::identical(item.value(), expected[item.key()]));
}

TEST_CASE("load_weights: a state dict without a norm layer's num_batches_tracked loads as PyTorch's load_state_dict: "
          "present where the file gives the module no version (a plain dict, safetensors) or version 1, missing at 2") {
  // weights.py trained: the trained state dict without norm.num_batches_tracked, as a plain dict,
  // as state_dict()'s OrderedDict (its _metadata: BatchNorm version 2), with version 1 instead,
  // and as safetensors; with what PyTorch's load_state_dict (load_model for safetensors) did
  // with each into a Tied() whose counter was 5.
  const auto manifest = trained_manifest();
  const auto* cases = manifest.find("batchnorm");
  REQUIRE(cases != nullptr);
  const auto weights = mp::read_torch_save(trained_files() + "/trained.pt");
  std::size_t files = 0;
  for (const auto& [file, python] : cases->members) {
    CAPTURE(file);
    const auto path = trained_files() + "/" + file;
    torch::manual_seed(12);
    Tied model;
    model.norm->num_batches_tracked.fill_(5);
    const auto before = everything(model);
    if (python.find("strict")->text == "loaded") {
      mp::LoadReport report;
      REQUIRE_NOTHROW(report = mp::load_weights(model, path));
      CHECK(report.missing_keys.empty());
      CHECK(report.unexpected_keys.empty());
      CHECK(test::identical(model.norm->running_var, weights["norm.running_var"]));
    } else {
      CHECK(python.find("strict")->text == "Missing key(s) in state_dict: \"norm.num_batches_tracked\".");
      CHECK_THROWS_WITH_AS(mp::load_weights(model, path),
                           doctest::Contains("1 of the model's tensors has no key (missing keys: "
                                             "'norm.num_batches_tracked'). Nothing was loaded"),
                           mp::Error);
      CHECK(test::identical(everything(model), before));
    }
    torch::manual_seed(12);
    Tied loose;
    loose.norm->num_batches_tracked.fill_(5);
    const auto report = mp::load_weights(loose, path, mp::LoadOptions().strict(false));
    CHECK(report.missing_keys == strings(*python.find("missing_keys")));
    CHECK(report.unexpected_keys == strings(*python.find("unexpected_keys")));
    CHECK(test::identical(loose.fc->weight, weights["fc.weight"]));
    // The counter keeps its value, as torch >= 2.2 keeps it (pytorch#110850); torch <= 2.1 put a 0.
    CHECK(loose.norm->num_batches_tracked.item<std::int64_t>() == 5);
    const auto& version = python.find("torch")->text;  // "2.13.0+cpu"
    const auto major = std::stoi(version), minor = std::stoi(version.substr(version.find('.') + 1));
    const bool filled = python.find("missing_keys")->items.empty();
    const bool keeps = major > 2 || (major == 2 && minor >= 2);
    CHECK(std::stoll(python.find("num_batches_tracked")->text) == (filled && !keeps ? 0 : 5));
    ++files;
  }
  MESSAGE(files, " state dicts without num_batches_tracked: the same keys reported as the Python of ",
          "MIXPREC_PYTHON (torch ", cases->members.front().second.find("torch")->text, ")");
  CHECK(files == (kNoSafetensorsPython ? 3U : 4U));

  // Through the Trainer, the same rules: version 2 refused, no version loaded.
  auto trained = std::make_shared<Tied>();
  torch::optim::SGD sgd(trained->parameters(), torch::optim::SGDOptions(0.1));
  mp::Trainer<mp::MixedO2<at::BFloat16>> trainer(trained, sgd);
  CHECK_THROWS_WITH_AS(trainer.load_weights(trained_files() + "/no_nbt_v2.pt"),
                       doctest::Contains("missing keys: 'norm.num_batches_tracked'"), mp::Error);
  CHECK(trainer.load_weights(trained_files() + "/no_nbt_plain.pt").missing_keys.empty());
  CHECK(test::identical(trainer.fp32_state_dict()["fc.weight"], weights["fc.weight"]));
}

TEST_CASE("load_state_dict: num_batches_tracked may be absent for every norm layer with running statistics "
          "(BatchNorm, InstanceNorm, a Mappable one); another module's buffer of that name is missing") {
  // An in-memory state dict has no module versions: Python's plain dict.
  struct Norms : torch::nn::Module {
    Norms() {
      batch = register_module("batch", torch::nn::BatchNorm2d(3));
      instance = register_module("instance", torch::nn::InstanceNorm1d(
                                                 torch::nn::InstanceNorm1dOptions(3).track_running_stats(true)));
      mapped = register_module("mapped", mp::nn::Mappable<torch::nn::BatchNorm1d>(3));
      counter = register_module("counter", std::make_shared<torch::nn::Module>());
      counter->register_buffer("num_batches_tracked", torch::tensor(4, at::kLong));
    }
    torch::nn::BatchNorm2d batch{nullptr};
    torch::nn::InstanceNorm1d instance{nullptr};
    mp::nn::Mappable<torch::nn::BatchNorm1d> mapped{nullptr};
    std::shared_ptr<torch::nn::Module> counter;
  };
  torch::manual_seed(13);
  Norms norms;
  norms.batch->num_batches_tracked.fill_(7);
  auto weights = fresh_values(norms);
  weights = without(weights, {"batch.num_batches_tracked", "instance.num_batches_tracked",
                              "mapped.num_batches_tracked"});
  const auto report = mp::load_state_dict(norms, weights);
  CHECK(report.missing_keys.empty());
  CHECK(norms.batch->num_batches_tracked.item<std::int64_t>() == 7);
  CHECK(test::identical(norms.batch->running_mean, weights["batch.running_mean"]));
  CHECK(norms.counter->named_buffers()["num_batches_tracked"].item<std::int64_t>() == 11);  // 4 + 7
  CHECK_THROWS_WITH_AS(mp::load_state_dict(norms, without(weights, {"counter.num_batches_tracked"})),
                       doctest::Contains("missing keys: 'counter.num_batches_tracked'"), mp::Error);
  mp::StateDict batch_only;
  for (const auto& item : weights) {
    if (item.key().rfind("batch.", 0) == 0) batch_only.insert(item.key().substr(6), item.value());
  }
  CHECK(mp::load_state_dict(norms, batch_only, mp::LoadOptions().submodule("batch")).missing_keys.empty());
}

}  // namespace test_load_state_dict
