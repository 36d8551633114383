// The C++ port of train.py beside it: the same model, data, optimizer, schedule, accumulation,
// clipping, evaluation, checkpoint and export, with a mixprec::Trainer instead of the AMP loop.
// Where Python writes a line, the port has the line that does its job:
//
//   with torch.autocast("cpu", dtype=torch.float16)   Trainer<MixedO1<at::Half>> (the type)
//   scaler = torch.amp.GradScaler("cpu", ...)           TrainerOptions().scaler(...)
//   scaler.scale(loss / accumulation).backward()        trainer.step(loss_fn): divides, scales
//   scaler.unscale_(opt); clip_grad_norm_(..., 1.0)     TrainerOptions().max_grad_norm(1.0)
//   scaler.step(opt); scaler.update()                   trainer.step(...) (every 2nd call)
//   scheduler.step()                                    TrainerOptions().lr_scheduler(StepLR)
//   optimizer.zero_grad(set_to_none=True)               the Trainer does it
//   model.eval(); with torch.no_grad(), autocast        trainer.evaluate(forward)
//   torch.save({model, optimizer, scaler, ...})         trainer.save(path): all of it, atomically
//   torch.save(model.state_dict(), f)                   trainer.save_fp32(path, pickle)
//   csv.writer(...).writerow(...)                       mixprec::StepLogger (on_step)
//
//   ported_train --init init.pt --steps 60 --log steps.csv --eval eval.csv
//                [--stop-after 30 --checkpoint run.ckpt] [--resume run.ckpt] [--export final.pt]
//                [--precision bf16] [--seed 0]
//
// --init: where the initial fp32 weights go, for train.py to start from (a fresh run writes
// them). --precision bf16: MixedO1<BFloat16>, no loss scaling (LibTorch 1.13 has no CPU fp16).
// compare.py runs both programs and checks that their loss curves agree (README.md here).

#include <mixprec/mixprec.hpp>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <charconv>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>

namespace {

// The model of train.py: the same layers under the same names (fc1, fc2, head), so that the
// state_dict keys match.
struct NetImpl : torch::nn::Module {
  NetImpl()
      : fc1(register_module("fc1", torch::nn::Linear(20, 64))),
        fc2(register_module("fc2", torch::nn::Linear(64, 64))),
        head(register_module("head", torch::nn::Linear(64, 4))),
        drop(register_module("drop", torch::nn::Dropout(0.1))) {}
  at::Tensor forward(const at::Tensor& input) {
    auto x = drop(torch::relu(fc1(input)));
    x = drop(torch::relu(fc2(x)));
    return head(x);
  }
  torch::nn::Linear fc1, fc2, head;
  torch::nn::Dropout drop;
};
TORCH_MODULE(Net);

// train.py's make_data(): the same generator, seed and calls give the same tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> make_data() {
  torch::manual_seed(1234);
  const auto x = torch::randn({512, 20});
  // One draw per statement: C++ leaves the order of a + b's operands open, Python does not.
  const auto w = torch::randn({20, 4});
  const auto noise = torch::randn({512, 4});
  const auto y = (x.matmul(w) + 0.5 * noise).argmax(1);
  return {x.slice(0, 0, 448), y.slice(0, 0, 448), x.slice(0, 448), y.slice(0, 448)};
}

// Python's repr() of a float: the shortest text that reads back as the same double.
std::string repr(double value) {
  char buffer[64];
  return std::string(buffer, std::to_chars(buffer, buffer + sizeof buffer, value).ptr);
}

struct Args {
  std::string init, log, eval, checkpoint, resume, out, precision = "fp16";
  std::int64_t steps = 60, stop_after = 0;
  std::uint64_t seed = 0;
};

template <class P>
int train(const Args& args) {
  const std::int64_t batch = 32, accumulation = 2, eval_every = 10;
  torch::manual_seed(args.seed);  // the initial weights, which train.py loads from --init
  Net model;
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(2e-3).weight_decay(0.01));

  // The log train.py writes with csv.writer, and a progress line on stderr (redrawn on a
  // terminal; a plain line every 30 s, and the last, into a file or a CI log).
  const mixprec::StepLogger log(args.log, mixprec::StepLoggerOptions()
                                              .batch_size(batch)
                                              .append(!args.resume.empty()));
  const mixprec::ProgressLine progress(args.steps, mixprec::ProgressOptions().batch_size(batch));
  auto options = mixprec::TrainerOptions()
                     .accumulation_steps(accumulation)
                     .max_grad_norm(1.0)
                     .lr_scheduler(std::make_shared<torch::optim::StepLR>(optimizer, 20, 0.5))
                     .on_step([&](const mixprec::StepReport& report) {
                       log(report);
                       progress(report);
                     });
  if constexpr (std::is_same_v<typename P::scaler_type, mixprec::GradScaler>) {
    options.scaler(mixprec::GradScalerOptions().init_scale(std::ldexp(1.0, 24)).growth_interval(10));
  }
  mixprec::Trainer<P> trainer(model, optimizer, options);
  const auto [x_train, y_train, x_test, y_test] = make_data();

  if (!args.resume.empty()) {
    trainer.load(args.resume);  // model, optimizer, scaler, schedule, counters, RNG
  } else {
    trainer.save_fp32(args.init, mixprec::WeightsFormat::pickle);
    torch::manual_seed(1);  // the dropout masks
  }

  std::ofstream evals(args.eval, args.resume.empty() ? std::ios::trunc : std::ios::app);
  if (args.resume.empty()) evals << "step,loss,accuracy\n";
  for (std::int64_t step = trainer.stats().steps; step < args.steps; ++step) {
    for (std::int64_t micro = 0; micro < accumulation; ++micro) {
      const auto i = (step * accumulation + micro) * batch % x_train.size(0);
      const auto xb = x_train.slice(0, i, i + batch), yb = y_train.slice(0, i, i + batch);
      trainer.step([&] { return torch::nn::functional::cross_entropy(model->forward(xb), yb); });
    }
    if ((step + 1) % eval_every == 0) {
      const at::Tensor logits = trainer.evaluate([&] { return model->forward(x_test); });
      const double loss =
          torch::nn::functional::cross_entropy(logits.to(torch::kFloat), y_test).item<double>();
      const double accuracy = logits.argmax(1).eq(y_test).to(torch::kFloat).mean().item<double>();
      evals << step + 1 << ',' << repr(loss) << ',' << repr(accuracy) << '\n' << std::flush;
      std::cout << "step " << step + 1 << "  eval loss " << loss << "  accuracy "
                << 100 * accuracy << "%\n";
    }
    if (step + 1 == args.stop_after) {
      trainer.save(args.checkpoint);
      progress.finish();
      std::cout << "stopped after step " << step + 1 << ": " << args.checkpoint << "\n";
      return 0;
    }
  }
  progress.finish();
  if (!args.out.empty()) trainer.save_fp32(args.out, mixprec::WeightsFormat::pickle);
  const auto stats = trainer.stats();
  std::cout << "trained " << stats.steps << " steps (" << stats.skipped_steps
            << " skipped), final scale " << stats.scale << "\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"The C++ port of examples/ported/train.py"};
  app.add_option("--init", args.init, "where a fresh run writes its initial fp32 weights")->required();
  app.add_option("--steps", args.steps, "optimizer steps in all")->check(CLI::Range(1, 100000));
  app.add_option("--log", args.log, "the step log (CSV)")->required();
  app.add_option("--eval", args.eval, "the evaluation log (CSV)")->required();
  app.add_option("--stop-after", args.stop_after, "save a checkpoint after this step and stop");
  app.add_option("--checkpoint", args.checkpoint, "the checkpoint --stop-after writes");
  app.add_option("--resume", args.resume, "a checkpoint to resume from");
  app.add_option("--export", args.out, "where the final fp32 weights go (Python's torch.load)");
  app.add_option("--seed", args.seed, "the seed of the initial weights (0)");
  app.add_option("--precision", args.precision, "fp16 (default) or bf16")
      ->check(CLI::IsMember({"fp16", "bf16"}));
  CLI11_PARSE(app, argc, argv);
  if (args.stop_after > 0 && args.checkpoint.empty()) {
    std::cerr << "ported_train: --stop-after needs --checkpoint. Run with --help for more information.\n";
    return 2;
  }
  try {
    if (args.precision == "bf16") return train<mixprec::MixedO1<at::BFloat16>>(args);
    return train<mixprec::MixedO1<at::Half>>(args);  // an Error on LibTorch 1.13's CPU
  } catch (const std::exception& e) {
    std::cerr << "ported_train: " << e.what() << "\n";
    return 1;
  }
}
