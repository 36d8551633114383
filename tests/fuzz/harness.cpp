// The fuzz targets' bodies, in one translation unit (LibTorch's headers cost ~25 s each);
// each target_*.cpp is a two-line libFuzzer entry point that calls one of them.
//
// The contract every target checks: an input either loads (is computed) or throws
// mixprec::Error with the state unchanged, bit for bit. Any other exception, a changed state, a
// non-finite result of finite input, aborts: libFuzzer reports it as a crash and keeps the input.
#include "harness.hpp"
#include "../scaled_policy.hpp"

#include <mixprec/io/checkpoint_file.hpp>
#include <mixprec/mixprec.hpp>

#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/in_memory_adapter.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/import_read.h>
#include <torch/serialize.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <unistd.h>

namespace mp = mixprec;
namespace fs = std::filesystem;

namespace {

[[noreturn]] void violation(const std::string& what) {
  std::cerr << "mixprec fuzz: CONTRACT VIOLATION: " << what << std::endl;
  std::abort();
}

// Bitwise copies and comparisons: NaN weights (a mutated byte may load as one) equal themselves.
std::vector<at::Tensor> copies(const std::vector<at::Tensor>& tensors) {
  std::vector<at::Tensor> out;
  for (const auto& t : tensors) out.push_back(t.detach().clone().contiguous());
  return out;
}

bool same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i) {
    const auto x = a[i].contiguous();
    const auto y = b[i].contiguous();
    if (x.scalar_type() != y.scalar_type() || x.sizes() != y.sizes()) return false;
    if (x.nbytes() > 0 && std::memcmp(x.data_ptr(), y.data_ptr(), x.nbytes()) != 0) return false;
  }
  return true;
}

std::string scaler_text(const c10::impl::GenericDict& dict) {
  std::ostringstream out;
  out << std::hexfloat;
  for (const auto& item : dict) {
    out << item.key().toStringRef() << "=";
    if (item.value().isDouble()) {
      out << item.value().toDouble();
    } else if (item.value().isInt()) {
      out << item.value().toInt();
    }
    out << " ";
  }
  return out.str();
}

std::string scratch_path(const std::string& name) {
  // Memory-backed where there is /dev/shm: a load per execution must not wait on a disk.
  const fs::path dir = fs::exists("/dev/shm") ? fs::path("/dev/shm") : fs::temp_directory_path();
  return (dir / (name + "." + std::to_string(::getpid()))).string();
}

void write_file(const std::string& path, const void* data, std::size_t size) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(size));
}

// Where LLVMFuzzerInitialize writes the seeds: $MIXPREC_FUZZ_SEEDS, if set.
std::optional<fs::path> seed_dir() {
  const char* dir = std::getenv("MIXPREC_FUZZ_SEEDS");
  if (dir == nullptr || *dir == '\0') return std::nullopt;
  fs::create_directories(dir);
  return fs::path(dir);
}

// ---------------------------------------------------------------------------------------------
// Trainer::load

using test::ScaledO2;

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 8));
    norm = register_module("norm", torch::nn::BatchNorm1d(8));
    fc2 = register_module("fc2", torch::nn::Linear(8, 2));
  }
  at::Tensor forward(const at::Tensor& x) {
    return fc2->forward(torch::relu(norm->forward(fc1->forward(x))));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d norm{nullptr};
};

struct LoadRig {
  std::shared_ptr<Net> net;
  torch::optim::Adam adam;
  mp::Trainer<ScaledO2> trainer;
  LoadRig()
      : net((torch::manual_seed(3), std::make_shared<Net>())),
        adam(net->parameters(), torch::optim::AdamOptions(1e-2)),
        trainer(net, adam, mp::TrainerOptions().scaler(mp::GradScalerOptions().init_scale(64))) {
    const auto x = torch::randn({8, 4});
    const auto y = torch::randint(0, 2, {8}, at::kLong);
    for (int i = 0; i < 2; ++i) {
      trainer.step([&] {
        return torch::nn::functional::cross_entropy(net->forward(trainer.cast_input(x)), y);
      });
    }
  }
  std::vector<at::Tensor> state() {
    auto all = copies(net->parameters());
    for (auto& t : copies(net->buffers())) all.push_back(t);
    for (auto& t : copies(trainer.master_weights())) all.push_back(t);
    for (auto& entry : adam.state()) {
      const auto& s = static_cast<const torch::optim::AdamParamState&>(*entry.second);
      all.push_back(s.exp_avg().clone());
      all.push_back(s.exp_avg_sq().clone());
      all.push_back(torch::tensor({static_cast<std::int64_t>(s.step())}));
    }
    all.push_back(at::detail::getDefaultCPUGenerator().get_state());
    return all;
  }
  std::string text() {
    const auto stats = trainer.stats();
    std::ostringstream out;
    out << std::hexfloat << stats.steps << " " << stats.skipped_steps << " " << stats.micro_batches
        << " " << adam.state().size() << " " << adam.param_groups()[0].options().get_lr() << " "
        << scaler_text(trainer.scaler().state_dict());
    return out.str();
  }
};

// Whether every pickle of a zip archive asks LibTorch's unpickler for memory its bytes can
// justify. The unpickler trusts what it reads: a memo index (LONG_BINPUT) of 2^31 grows its memo
// table to 32 GB, a string length of 2^32 reserves 4 GB, before anything is checked. An
// allocation beyond the machine's memory aborts AddressSanitizer itself (operator new reports
// out-of-memory even with allocator_may_return_null), which libFuzzer must count as a crash.
// That is LibTorch's unpickler (docs/reliability.md), not mixprec's code, so such inputs are
// passed over, in the harness: a memo index or a length larger than the pickle itself. An
// archive LibTorch cannot open, or a pickle that stops at an opcode the walk does not know,
// passes: LibTorch refuses it before it allocates.
bool pickle_fits(const std::uint8_t* p, std::size_t size) {
  std::size_t i = 0;
  auto number = [&](std::size_t bytes) {  // little-endian; nullopt past the end
    std::optional<std::uint64_t> value;
    if (size - i < bytes) return value;
    std::uint64_t v = 0;
    for (std::size_t k = 0; k < bytes; ++k) v |= std::uint64_t{p[i + k]} << (8 * k);
    i += bytes;
    value = v;
    return value;
  };
  auto skip_line = [&] {
    while (i < size && p[i] != '\n') ++i;
    if (i < size) ++i;
  };
  while (i < size) {
    const std::uint8_t op = p[i++];
    std::size_t fixed = 0;     // argument bytes
    std::size_t length = 0;    // bytes of a length prefix, followed by that many bytes
    switch (op) {
      case 'r': {  // LONG_BINPUT: the memo table grows to the index
        const auto id = number(4);
        if (!id) return true;
        if (*id > size) return false;
        continue;
      }
      case '.':
        return true;  // STOP: the end of the pickle
      case '(': case '0': case '1': case '2': case 'N': case 'Q': case 'R': case 'a':
      case 'b': case 'd': case '}': case 'e': case 'l': case ']': case 'o': case 's': case 't':
      case ')': case 'u': case 0x81: case 0x85: case 0x86: case 0x87: case 0x88: case 0x89:
      case 0x8f: case 0x90: case 0x91: case 0x92: case 0x93: case 0x94: case 0x97: case 0x98:
        break;
      case 0x80: case 'K': case 'h': case 'q': case 0x82: fixed = 1; break;
      case 'M': case 0x83: fixed = 2; break;
      case 'J': case 'j': case 0x84: fixed = 4; break;
      case 'G': case 0x95: fixed = 8; break;
      case 'U': case 'C': case 0x8a: case 0x8c: length = 1; break;
      case 'T': case 'X': case 'B': case 0x8b: length = 4; break;
      case 0x8d: case 0x8e: case 0x96: length = 8; break;
      case 'F': case 'I': case 'L': case 'P': case 'S': case 'V': case 'g': case 'p':
        skip_line();
        break;
      case 'c': case 'i':
        skip_line();
        skip_line();
        break;
      default:
        return true;  // the unpickler stops here too: "unknown opcode"
    }
    if (fixed > 0 && !number(fixed)) return true;
    if (length > 0) {
      const auto n = number(length);
      if (!n) return true;
      if (*n > size - i) return false;  // a length beyond the pickle: reserved before the read
      i += static_cast<std::size_t>(*n);
    }
  }
  return true;
}

// Each pickle of a zip archive starts after a local file header ("PK\3\4", name length at
// offset 26, extra length at 28) whose name ends in ".pkl"; LibTorch stores them uncompressed.
// Every such header is walked, whatever the central directory says, up to the pickle's STOP.
bool pickles_fit(const void* data, std::size_t size) {
  const auto* bytes = static_cast<const std::uint8_t*>(data);
  auto le16 = [&](std::size_t at) { return std::size_t{bytes[at]} | std::size_t{bytes[at + 1]} << 8; };
  for (std::size_t at = 0; at + 30 <= size; ++at) {
    if (std::memcmp(bytes + at, "PK\3\4", 4) != 0) continue;
    const std::size_t name = le16(at + 26), extra = le16(at + 28);
    const std::size_t start = at + 30 + name + extra;
    if (name < 4 || start > size) continue;
    if (std::memcmp(bytes + at + 30 + name - 4, ".pkl", 4) != 0) continue;
    if (!pickle_fits(bytes + start, size - start)) return false;
  }
  return true;
}

LoadRig* load_rig = nullptr;
std::string load_path;

// Input: a mode byte, then bytes. Mode even: the bytes are the file (what a damaged disk or copy
// gives; the trailer's checksum stands between them and LibTorch). Mode odd: the bytes are the
// archive, and the harness appends a valid trailer, so that LibTorch's zip reader and unpickler
// parse them (a deliberately forged file).
std::string with_trailer(const unsigned char* data, std::size_t size) {
  mp::detail::Checksum checksum;
  checksum.update(data, size);
  std::string file(reinterpret_cast<const char*>(data), size);
  file.append(mp::detail::checkpoint_magic.data(), mp::detail::checkpoint_magic.size());
  for (const std::uint64_t word : {checksum.length(), checksum.value()}) {
    for (int i = 0; i < 8; ++i) file.push_back(static_cast<char>((word >> (8 * i)) & 0xFF));
  }
  return file;
}

}  // namespace

void fuzz_trainer_load_init() {
  load_rig = new LoadRig();
  load_path = scratch_path("mixprec_fuzz_load.ckpt");
  if (const auto dir = seed_dir()) {
    load_rig->trainer.save(load_path);
    std::ifstream in(load_path, std::ios::binary);
    const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto body = file.substr(0, file.size() - mp::detail::checkpoint_trailer_size);
    std::ofstream(*dir / "file.ckpt", std::ios::binary) << '\0' << file;
    std::ofstream(*dir / "archive.ckpt", std::ios::binary) << '\1' << body;
  }
}

int fuzz_trainer_load(const std::uint8_t* data, std::size_t size) {
  if (size < 1) return 0;
  const bool forge = (data[0] & 1) != 0 && std::getenv("MIXPREC_FUZZ_RAW_ONLY") == nullptr;
  if (forge) {
    if (!pickles_fit(data + 1, size - 1)) return 0;
    const auto file = with_trailer(data + 1, size - 1);
    write_file(load_path, file.data(), file.size());
  } else {
    write_file(load_path, data + 1, size - 1);
  }
  auto& rig = *load_rig;
  const auto before = rig.state();
  const auto before_text = rig.text();
  try {
    rig.trainer.load(load_path);
  } catch (const mp::Error&) {
    if (!same_bits(rig.state(), before) || rig.text() != before_text) {
      violation("Trainer::load threw mixprec::Error but changed the state");
    }
  } catch (const std::exception& e) {
    violation(std::string("Trainer::load threw a non-mixprec exception: ") + e.what());
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// GradScaler::load_state_dict through torch::pickle_load

namespace {

mp::GradScaler* scaler = nullptr;
mp::StaticScaler* static_scaler = nullptr;

std::string scaler_state(const mp::GradScaler& s) {
  std::ostringstream out;
  out << std::hexfloat << s.get_scale() << " " << s.growth_tracker() << " "
      << s.hysteresis_tracker() << " " << s.options().growth_factor() << " "
      << s.options().backoff_factor() << " " << s.options().growth_interval() << " "
      << s.options().hysteresis();
  return out.str();
}

// torch::pickle_load's own steps, with LibTorch's bounds-checked MemoryReadAdapter in place of the
// VectorReader that pickle_load uses: VectorReader::read copies whatever range the zip directory
// names, so torch::pickle_load of damaged bytes reads out of bounds and crashes (found by this
// target; docs/reliability.md). MIXPREC_FUZZ_PICKLE_LOAD=1 calls torch::pickle_load itself.
c10::IValue pickle_load(const std::vector<char>& bytes) {
  if (!pickles_fit(bytes.data(), bytes.size())) return c10::IValue();  // not a dict: skipped
  if (std::getenv("MIXPREC_FUZZ_PICKLE_LOAD") != nullptr) return torch::pickle_load(bytes);
  caffe2::serialize::PyTorchStreamReader reader(std::make_shared<caffe2::serialize::MemoryReadAdapter>(
      bytes.data(), static_cast<off_t>(bytes.size())));
  return torch::jit::readArchiveAndTensors("data", "", "", std::nullopt, std::nullopt, std::nullopt,
                                           reader);
}

}  // namespace

void fuzz_scaler_load_init() {
  scaler = new mp::GradScaler(mp::GradScalerOptions().init_scale(1024).hysteresis(2).min_scale(1e-3));
  static_scaler = new mp::StaticScaler(8.0);
  if (const auto dir = seed_dir()) {
    auto save = [&](const std::string& name, const c10::impl::GenericDict& dict) {
      const auto bytes = torch::pickle_save(c10::IValue(dict));
      write_file((*dir / name).string(), bytes.data(), bytes.size());
    };
    save("default.pkl", mp::GradScaler().state_dict());
    mp::GradScaler grown(mp::GradScalerOptions().init_scale(2).growth_interval(3).hysteresis(3));
    save("hysteresis.pkl", grown.state_dict());
    save("static.pkl", mp::StaticScaler(4.0).state_dict());
    // As Python writes a hand-made dict: whole numbers as ints, no hysteresis keys.
    c10::impl::GenericDict python(c10::StringType::get(), c10::AnyType::get());
    python.insert("scale", std::int64_t{65536});
    python.insert("growth_factor", std::int64_t{2});
    python.insert("backoff_factor", 0.5);
    python.insert("growth_interval", std::int64_t{2000});
    python.insert("_growth_tracker", std::int64_t{17});
    save("python.pkl", python);
  }
}

int fuzz_scaler_load(const std::uint8_t* data, std::size_t size) {
  const std::vector<char> bytes(reinterpret_cast<const char*>(data),
                                reinterpret_cast<const char*>(data) + size);
  c10::IValue value;
  try {
    value = pickle_load(bytes);
  } catch (const std::exception&) {
    return 0;  // LibTorch refused the bytes: not a state dict, not mixprec's to judge
  }
  if (!value.isGenericDict()) return 0;
  const auto dict = value.toGenericDict();
  const auto before = scaler_state(*scaler);
  try {
    scaler->load_state_dict(dict);
    const double scale = scaler->get_scale();
    if (!(scale >= 0 && std::isfinite(scale)) || scaler->growth_tracker() < 0 ||
        scaler->growth_tracker() >= scaler->options().growth_interval()) {
      violation("GradScaler::load_state_dict accepted an impossible state: " + scaler_state(*scaler));
    }
  } catch (const mp::Error&) {
    if (scaler_state(*scaler) != before) {
      violation("GradScaler::load_state_dict threw mixprec::Error but changed the state");
    }
  } catch (const std::exception& e) {
    violation(std::string("GradScaler::load_state_dict threw a non-mixprec exception: ") + e.what());
  }
  const double static_before = static_scaler->get_scale();
  try {
    static_scaler->load_state_dict(dict);
  } catch (const mp::Error&) {
    if (static_scaler->get_scale() != static_before) {
      violation("StaticScaler::load_state_dict threw mixprec::Error but changed the scale");
    }
  } catch (const std::exception& e) {
    violation(std::string("StaticScaler::load_state_dict threw a non-mixprec exception: ") +
              e.what());
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The ops' mask validation

namespace {

// Reads the input as a little program: shapes, dtypes, an op, then values.
class Reader {
 public:
  Reader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t byte() { return pos_ < size_ ? data_[pos_++] : 0; }
  std::size_t left() const { return size_ - pos_; }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t pos_ = 0;
};

const c10::ScalarType vector_dtypes[] = {at::kFloat, at::kHalf, at::kBFloat16, at::kDouble,
                                         at::kLong, at::kInt, at::kBool, at::kByte};
const c10::ScalarType mask_dtypes[] = {at::kBool, at::kByte, at::kFloat, at::kLong,
                                       at::kInt, at::kHalf, at::kDouble, at::kChar};

at::Tensor make_tensor(Reader& in, std::vector<std::int64_t> shape, c10::ScalarType dtype,
                       bool as_mask) {
  auto t = at::zeros(shape, at::TensorOptions(at::kFloat));
  auto flat = t.view(-1);
  const auto n = flat.numel();
  const bool special = (in.byte() & 7) == 0;  // now and then: inf and NaN among the values
  for (std::int64_t i = 0; i < n && in.left() > 0; ++i) {
    const auto b = in.byte();
    float v = 0;
    if (as_mask) {
      v = b < 200 ? static_cast<float>(b & 1) : (b < 230 ? 2.0F : 0.5F);
    } else if (special && b >= 250) {
      v = b == 250 ? std::numeric_limits<float>::infinity()
                   : (b == 251 ? -std::numeric_limits<float>::infinity()
                               : std::numeric_limits<float>::quiet_NaN());
    } else {
      v = (static_cast<float>(b) - 128.0F) / 8.0F;
      if (b == 249) v = 60000.0F;  // near fp16's max
    }
    flat[i] = v;
  }
  if (dtype == at::kBool) return t != 0;
  if (!at::isFloatingType(dtype)) return at::nan_to_num(t, 0, 0, 0).to(dtype);
  return t.to(dtype);
}

std::vector<std::int64_t> make_shape(Reader& in, int rank) {
  std::vector<std::int64_t> shape;
  for (int i = 0; i < rank; ++i) shape.push_back(in.byte() % 5);  // 0 to 4: empty dims too
  return shape;
}

template <class P>
at::Tensor run_op(int op, const at::Tensor& vector, const at::Tensor& mask, std::int64_t dim,
                  bool flag, double value) {
  namespace ops = mp::ops;
  switch (op) {
    case 0: return ops::masked_softmax<P>(vector, mask, dim, flag);
    case 1: return ops::masked_log_softmax<P>(vector, mask, dim);
    case 2: return ops::masked_max<P>(vector, mask, dim, flag);
    case 3: return ops::masked_mean<P>(vector, mask, dim, flag);
    case 4: return ops::replace_masked_values<P>(vector, mask, value);
    default: return ops::logsumexp<P>(vector, mask, dim, flag);
  }
}

}  // namespace

void fuzz_ops_mask_init() {
  if (const auto dir = seed_dir()) {
    // Each seed: [op, policy, vector dtype, mask dtype, vector rank, mask rank, dim, flag, value,
    // shapes..., values...]: a masked softmax over [2, 3] with a [2, 3] mask, and the rest.
    for (std::uint8_t op = 0; op < 6; ++op) {
      std::vector<std::uint8_t> seed{op, 0, 0, 0, 2, 2, 1, 0, 3, 2, 3, 2, 3, 1};
      for (int i = 0; i < 6; ++i) seed.push_back(static_cast<std::uint8_t>(100 + 9 * i));
      seed.push_back(1);
      for (int i = 0; i < 6; ++i) seed.push_back(static_cast<std::uint8_t>(i % 3 == 0 ? 0 : 1));
      write_file((*dir / ("op" + std::to_string(op))).string(), seed.data(), seed.size());
    }
  }
}

int fuzz_ops_mask(const std::uint8_t* data, std::size_t size) {
  Reader in(data, size);
  const int op = in.byte() % 6;
  const int policy = in.byte() % 3;
  const auto vector_dtype = vector_dtypes[in.byte() % 8];
  const auto mask_dtype = mask_dtypes[in.byte() % 8];
  const int vector_rank = in.byte() % 5;  // 0-d included: the ops must refuse it
  const int mask_code = in.byte() % 7;    // 6: an undefined mask
  const std::int64_t dim = static_cast<std::int64_t>(in.byte() % 11) - 5;
  const bool flag = (in.byte() & 1) != 0;
  const double values[] = {0.0, -1.0, 1e4, -1e32, std::numeric_limits<double>::infinity(), 0.5, 1.0};
  const double value = values[in.byte() % 7];
  at::Tensor vector, mask;
  try {
    vector = make_tensor(in, make_shape(in, vector_rank), vector_dtype, false);
    if (mask_code < 6) mask = make_tensor(in, make_shape(in, mask_code), mask_dtype, true);
  } catch (const std::exception&) {
    return 0;  // the harness's own construction, not an op
  }
  const auto before = copies({vector});
  const auto mask_before = mask.defined() ? copies({mask}) : std::vector<at::Tensor>{};
  at::Tensor result;
  try {
    switch (policy) {
      case 0: result = run_op<mp::FullPrecision>(op, vector, mask, dim, flag, value); break;
      case 1: result = run_op<mp::MixedO1<at::BFloat16>>(op, vector, mask, dim, flag, value); break;
      default: result = run_op<mp::MixedO2<at::Half>>(op, vector, mask, dim, flag, value); break;
    }
  } catch (const mp::Error&) {
    result = at::Tensor();
  } catch (const std::exception& e) {
    std::ostringstream what;
    what << "op " << op << " (policy " << policy << ") on vector " << vector.scalar_type()
         << vector.sizes() << ", mask "
         << (mask.defined() ? c10::toString(mask.scalar_type()) : "undefined")
         << (mask.defined() ? mask.sizes() : at::IntArrayRef{}) << ", dim " << dim
         << " threw a non-mixprec exception: " << e.what();
    violation(what.str());
  }
  if (!same_bits(copies({vector}), before) ||
      (mask.defined() && !same_bits(copies({mask}), mask_before))) {
    violation("an op changed its input");
  }
  // Finite input gives finite output (DESIGN.md), for the ops whose output is not a fill value.
  if (result.defined() && at::isFloatingType(vector.scalar_type()) && op != 4 &&
      at::isfinite(vector).all().item<bool>() && result.numel() > 0 &&
      !at::isfinite(result).all().item<bool>()) {
    std::ostringstream what;
    what << "op " << op << " (policy " << policy << ") gave inf/NaN for finite input "
         << vector.scalar_type() << vector.sizes() << " with mask "
         << (mask.defined() ? mask.sizes() : at::IntArrayRef{});
    violation(what.str());
  }
  return 0;
}

// ---------------------------------------------------------------------------------------------
// The weight readers (mixprec/io/): any bytes give a state dict whose tensors fit the file, or a
// mixprec::Error; never another exception, a crash or a read out of bounds (ASan). A state dict
// read is then loaded into a small model (strict(false)): it loads, or the model is unchanged.

namespace {

torch::nn::Sequential* weights_model = nullptr;

void write_weight_seed(const std::string& name, const std::string& bytes) {
  if (const auto dir = seed_dir()) write_file((*dir / name).string(), bytes.data(), bytes.size());
}

void load_into_model(const mp::StateDict& dict, std::size_t input_size) {
  std::size_t bytes = 0, total = 0;
  std::set<const void*> storages;
  for (const auto& item : dict) {
    const auto& t = item.value();
    // What the tensor's bytes can reach: its storage, which the file holds.
    const auto nbytes = static_cast<std::size_t>(t.storage().nbytes());
    bytes = std::max(bytes, nbytes);
    if (storages.insert(t.storage().unsafeGetStorageImpl()).second) total += nbytes;
  }
  if (bytes > input_size) violation("a weight reader made a storage larger than its input");
  // Each byte of the input in one storage at most: zip records that overlap would hand the same
  // bytes to many (a zip bomb).
  if (total > input_size) violation("a weight reader made storages that add up to more than its input");
  auto& model = *weights_model;
  const auto before = copies(model->parameters());
  const auto buffers = copies(model->buffers());
  try {
    mp::load_state_dict(*model, dict, mp::LoadOptions().strict(false));
  } catch (const mp::Error&) {
    if (!same_bits(copies(model->parameters()), before) || !same_bits(copies(model->buffers()), buffers)) {
      violation("load_state_dict threw mixprec::Error but changed the model");
    }
  } catch (const std::exception& e) {
    violation(std::string("load_state_dict threw a non-mixprec exception: ") + e.what());
  }
}

}  // namespace

void fuzz_safetensors_init() {
  weights_model = new torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::BatchNorm1d(2));
  const auto file = [](const std::string& header, std::size_t data) {
    std::string bytes(8, '\0');
    const std::uint64_t n = header.size();
    std::memcpy(bytes.data(), &n, 8);
    return bytes + header + std::string(data, '\x3f');
  };
  write_weight_seed("two.safetensors", file(R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2,2],)"
                                            R"("data_offsets":[0,16]},"b":{"dtype":"I64","shape":[1],"data_offsets":[16,24]}})",
                                            24));
  write_weight_seed("bf16.safetensors", file(R"({"w":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]}})", 6));
  write_weight_seed("empty.safetensors", file(R"({"e":{"dtype":"F16","shape":[0,4],"data_offsets":[0,0]}})", 0));
  // As Python's save_file lays them out: empty tensors at the offsets of non-empty ones.
  write_weight_seed("shared_offsets.safetensors",
                    file(R"({"__metadata__":{"format":"pt"},"b":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},)"
                         R"("z":{"dtype":"F32","shape":[0,3],"data_offsets":[16,16]},"d":{"dtype":"F16","shape":[3],)"
                         R"("data_offsets":[16,22]},"c":{"dtype":"I8","shape":[2,0],"data_offsets":[22,22]}})", 22));
  write_weight_seed("empties_only.safetensors", file(R"({"x":{"dtype":"F32","shape":[0],"data_offsets":[0,0]},)"
                                                     R"("y":{"dtype":"BOOL","shape":[0,5],"data_offsets":[0,0]}})", 0));
  write_weight_seed("duplicate.safetensors", file(R"({"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},)"
                                                  R"("a":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}})", 4));
  // The model's own names: a file that loads.
  write_weight_seed("model.safetensors",
                    file(R"({"0.weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"0.bias":{"dtype":"F32",)"
                         R"("shape":[2],"data_offsets":[16,24]},"1.num_batches_tracked":{"dtype":"I64","shape":[],)"
                         R"("data_offsets":[24,32]},"1.running_mean":{"dtype":"F32","shape":[2],"data_offsets":[32,40]}})",
                         40));
}

int fuzz_safetensors(const std::uint8_t* data, std::size_t size) {
  mp::StateDict dict;
  try {
    dict = mp::parse_safetensors(data, size, "fuzz");
  } catch (const mp::Error&) {
    return 0;
  } catch (const std::exception& e) {
    violation(std::string("parse_safetensors threw a non-mixprec exception: ") + e.what());
  }
  load_into_model(dict, size);
  return 0;
}

// torch.save's files (zip archive, pickle, storages): seeds are the (name, tensor) pairs of
// Trainer::save_fp32's LibTorch pickle, written here, and the files of Python's torch.save (2.13
// and 1.13) in tests/fuzz/regressions/torch_save.
void fuzz_torch_save_init() {
  if (weights_model == nullptr) {
    weights_model = new torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::BatchNorm1d(2));
  }
  if (!seed_dir()) return;
  std::vector<c10::IValue> pairs;
  for (const auto& item : (*weights_model)->named_parameters()) {
    pairs.emplace_back(c10::ivalue::Tuple::create({c10::IValue(item.key()), c10::IValue(item.value())}));
  }
  for (const auto& item : (*weights_model)->named_buffers()) {
    pairs.emplace_back(c10::ivalue::Tuple::create({c10::IValue(item.key()), c10::IValue(item.value())}));
  }
  const auto bytes = torch::pickle_save(c10::IValue(c10::ivalue::Tuple::create(std::move(pairs))));
  write_weight_seed("libtorch_pairs.pt", std::string(bytes.begin(), bytes.end()));
}

int fuzz_torch_save(const std::uint8_t* data, std::size_t size) {
  mp::StateDict dict;
  // The file as a state dict, else as a checkpoint of one under "model" (the key path).
  for (const char* key : {"", "model"}) {
    try {
      dict = mp::parse_torch_save(data, size, "fuzz", key);
    } catch (const mp::Error&) {
      continue;
    } catch (const std::exception& e) {
      violation(std::string("parse_torch_save threw a non-mixprec exception: ") + e.what());
    }
    load_into_model(dict, size);
    return 0;
  }
  return 0;
}
