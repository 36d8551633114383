// The pretrained encoder of examples/encoder: its weights loaded by name (mixprec::load_weights;
// the readers' own tests are tests/io/), the WordPiece tokenizer; and, against
// Hugging Face in the Python of MIXPREC_PYTHON (tests/parity_encoder.py, tests/tokenizer_sweep.py;
// LibTorch 2.x, whose wheel's Python has transformers): token ids on every code point, on a sweep
// of Unicode and on the whole data set, last_hidden_state, and fine-tuning loss for loss under
// FullPrecision, MixedO1<BFloat16> and MixedO1<Half> + GradScaler. The model is the directory
// MIXPREC_ENCODER_MODEL_DIR (all-MiniLM-L6-v2, which the scripts unpack from its PyPI wheel).
#include "encoder/finetune.hpp"

#include <mixprec/mixprec.hpp>

#include "support.hpp"

#include <torch/torch.h>
#include <unicode/uchar.h>
#include <unicode/uvernum.h>

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace mp = mixprec;

namespace {

const std::string kModelDir = MIXPREC_ENCODER_MODEL_DIR;
const bool kNoModel = kModelDir.empty() || !std::filesystem::exists(kModelDir + "/model.safetensors");
// Hugging Face's side needs a torch 2.x Python (transformers 5): the wheel's.
constexpr bool kNoPython = TORCH_VERSION_MAJOR < 2;

}  // namespace

TEST_CASE("WordPiece: BERT's normalization, punctuation, subwords, special tokens and [UNK] on a small vocabulary") {
  const auto vocab = test::temp_path("vocab.txt");
  const std::vector<std::string> tokens{"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", ",",
                                        "world", "!", "cafe", "un", "##aff", "##able", "\xe4\xb8\xad",
                                        "x", "[", "]", "mask", "##x"};
  {
    std::ofstream out(vocab);
    for (const auto& token : tokens) out << token << "\n";
  }
  const encoder::WordPiece tokenizer(vocab);
  using Ids = std::vector<std::int64_t>;
  CHECK(tokenizer.tokenize("Hello, WORLD!") == Ids{5, 6, 7, 8});
  CHECK(tokenizer.tokenize("Caf\xc3\xa9") == Ids{9});                 // accent stripped (NFD)
  CHECK(tokenizer.tokenize("unaffable") == Ids{10, 11, 12});           // greedy longest match
  CHECK(tokenizer.tokenize("unknown") == Ids{1});                      // a part in no entry
  CHECK(tokenizer.tokenize("x\xe4\xb8\xadx") == Ids{14, 13, 14});      // CJK spaced out
  CHECK(tokenizer.tokenize("hello\x01\tworld") == Ids{5, 7});          // control removed
  CHECK(tokenizer.tokenize(std::string(101, 'x')) == Ids{1});          // too long: [UNK]
  CHECK(tokenizer.encode("hello world", 3) == Ids{2, 5, 3});           // truncated, [SEP] kept
  // Special tokens as written are tokens; in another case they are text.
  CHECK(tokenizer.tokenize("hello[MASK]world") == Ids{5, 4, 7});
  CHECK(tokenizer.tokenize("[SEP][PAD]x [UNK]") == Ids{3, 0, 14, 1});
  CHECK(tokenizer.tokenize("[mask]") == Ids{15, 17, 16});
  CHECK(tokenizer.tokenize("[[MASK]]") == Ids{15, 4, 16});
  // Unassigned code points and noncharacters stay (unknown: [UNK]); private use goes. U+2B820 is
  // not spaced out as CJK (the reference's range starts at U+2B920), so xx U+2B820 is one word.
  CHECK(tokenizer.tokenize("x\xcd\xb8") == Ids{1});                   // U+0378, unassigned
  CHECK(tokenizer.tokenize("\xef\xbf\xbe") == Ids{1});                // U+FFFE
  CHECK(tokenizer.tokenize("x\xee\x80\x80x") == Ids{14, 18});          // U+E000, private use
  CHECK(tokenizer.tokenize("x\xf0\xab\xa0\xa0 x\xf0\xab\xa4\xa0") == Ids{1, 14, 1});
  CHECK(tokenizer.normalize("x\xf0\xab\xa4\xa0") == "x \xf0\xab\xa4\xa0 ");   // U+2B920 is CJK
  CHECK(tokenizer.pre_tokenize("a,b c") == std::vector<std::string>{"a", ",", "b", "c"});
  CHECK_THROWS_WITH_AS(encoder::WordPiece(test::temp_path("no-such-vocab.txt")),
                       doctest::Contains("cannot open"), mp::Error);
  {
    std::ofstream out(vocab);
    for (const auto& token : tokens) {
      if (token != "[MASK]") out << token << "\n";
    }
  }
  CHECK_THROWS_WITH_AS(encoder::WordPiece{vocab}, doctest::Contains("lacks [MASK]: not a BERT vocabulary"),
                       mp::Error);
}

namespace {

std::string u_plus(UChar32 c) {
  char hex[16];
  std::snprintf(hex, sizeof hex, "U+%04X", static_cast<unsigned>(c));
  return hex;
}

std::string code_points(const std::string& utf8) {
  const auto text = icu::UnicodeString::fromUTF8(utf8);
  std::string out;
  for (int32_t i = 0; i < text.length(); i = text.moveIndex32(i, 1)) {
    out += (i > 0 ? " " : "") + u_plus(text.char32At(i));
  }
  return out;
}

// ICU's category and Unicode age of `c`, for messages.
std::string icu_view(UChar32 c) {
  UVersionInfo age;
  u_charAge(c, age);
  return u_plus(c) + " (ICU: category " + std::to_string(u_charType(c)) + ", Unicode " +
         std::to_string(age[0]) + "." + std::to_string(age[1]) + ")";
}

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::size_t start = 0;
  for (auto at = text.find(separator); at != std::string::npos; at = text.find(separator, start)) {
    parts.push_back(text.substr(start, at - start));
    start = at + 1;
  }
  parts.push_back(text.substr(start));
  return parts;
}

struct TokenizerReference {
  std::string chars, cases;
};

// tests/tokenizer_sweep.py, run once for the tests below: Hugging Face's tokenizer on every code
// point, and on the sweep's strings, which take their block edges from ICU's blocks.
const TokenizerReference& tokenizer_reference() {
  static const TokenizerReference reference = [] {
    const TokenizerReference paths{test::temp_path("tokenizer_chars.txt"),
                                   test::temp_path("tokenizer_cases.txt")};
    const auto blocks = test::temp_path("unicode_blocks.txt");
    {
      std::ofstream out(blocks);
      int block = UBLOCK_NO_BLOCK;
      UChar32 first = 0;
      for (UChar32 c = 0; c <= 0x110000; ++c) {
        const int here = c < 0x110000 ? u_getIntPropertyValue(c, UCHAR_BLOCK) : UBLOCK_NO_BLOCK;
        if (here == block) continue;
        if (block != UBLOCK_NO_BLOCK) out << std::hex << first << " " << c - 1 << "\n";
        block = here;
        first = c;
      }
    }
    const auto script = std::filesystem::path(MIXPREC_PARITY_ENCODER_SCRIPT).parent_path() /
                        "tokenizer_sweep.py";
    const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + script.string() + " " +
                         kModelDir + " " + blocks + " " + paths.chars + " " + paths.cases;
    REQUIRE(std::system(command.c_str()) == 0);
    return paths;
  }();
  return reference;
}

}  // namespace

TEST_CASE("WordPiece: every code point normalized and split as Hugging Face's BertNormalizer and BertPreTokenizer" *
          doctest::skip(kNoModel || kNoPython)) {
  const encoder::WordPiece tokenizer(kModelDir + "/vocab.txt");
  // The order tokenizer_sweep.py goes in: all but the surrogates and '|', 64 to a line.
  std::vector<UChar32> all;
  for (UChar32 c = 0; c < 0x110000; ++c) {
    if ((c < 0xD800 || c > 0xDFFF) && c != '|') all.push_back(c);
  }
  std::ifstream in(tokenizer_reference().chars);
  std::size_t start = 0, normalized = 0, split = 0;
  for (std::string line; std::getline(in, line); start += 64) {
    REQUIRE(start < all.size());
    const auto tab = line.rfind('\t');
    REQUIRE(tab != std::string::npos);
    const auto end = std::min(all.size(), start + 64);
    icu::UnicodeString joined;
    for (auto i = start; i < end; ++i) joined.append(all[i]).append(UChar32{'|'});
    joined.truncate(joined.length() - 1);
    std::string text;
    joined.toUTF8String(text);
    const auto ours = ::split(tokenizer.normalize(text), '|');
    const auto theirs = ::split(line.substr(0, tab), '|');
    const auto classes = line.substr(tab + 1);
    REQUIRE(theirs.size() == end - start);
    REQUIRE(classes.size() == end - start);
    for (auto i = start; i < end; ++i) {
      const auto c = all[i];
      const auto& want = theirs[i - start];
      const auto& got = i - start < ours.size() ? ours[i - start] : std::string("(missing)");
      if (got != want && ++normalized <= 8) {
        MESSAGE(icu_view(c), ": Hugging Face normalizes it to '", code_points(want), "', this to '",
                code_points(got), "'");
      }
      const char kind = encoder::bert_unicode::is_whitespace(c)    ? 'w'
                        : encoder::bert_unicode::is_punctuation(c) ? 'p'
                                                                   : 'l';
      if (kind != classes[i - start] && ++split <= 8) {
        MESSAGE(icu_view(c), ": Hugging Face splits it as '", classes[i - start], "', this as '", kind,
                "' (w: white space, p: punctuation, l: letter)");
      }
    }
  }
  MESSAGE(all.size(), " code points (ICU ", U_ICU_VERSION, ", Unicode ", U_UNICODE_VERSION,
          "): ", normalized, " normalized differently, ", split, " split differently");
  CHECK((start >= all.size() && start < all.size() + 64));
  CHECK(normalized == 0);
  CHECK(split == 0);
}

TEST_CASE("WordPiece: ids equal BertTokenizerFast's on a sweep of categories, block edges, special tokens, accents, long words and ill-formed UTF-8" *
          doctest::skip(kNoModel || kNoPython)) {
  const encoder::WordPiece uncased(kModelDir + "/vocab.txt");
  const encoder::WordPiece cased(kModelDir + "/vocab.txt", /*lower_case=*/false);
  std::ifstream in(tokenizer_reference().cases);
  std::size_t cases = 0, differ_uncased = 0, differ_cased = 0;
  const auto joined = [](const std::vector<std::int64_t>& ids) {
    std::ostringstream out;
    for (std::size_t i = 0; i < ids.size(); ++i) out << (i ? " " : "") << ids[i];
    return out.str();
  };
  for (std::string line; std::getline(in, line); ++cases) {
    const auto fields = ::split(line, '\t');
    REQUIRE(fields.size() == 4);
    std::string text;
    for (std::size_t i = 0; i + 1 < fields[1].size(); i += 2) {
      text.push_back(static_cast<char>(std::stoi(fields[1].substr(i, 2), nullptr, 16)));
    }
    const auto ours_uncased = joined(uncased.encode(text, std::size_t{1} << 20));
    const auto ours_cased = joined(cased.encode(text, std::size_t{1} << 20));
    if (ours_uncased != fields[2] && ++differ_uncased <= 6) {
      MESSAGE("uncased, ", fields[0], " [", code_points(text), "]: ", ours_uncased, " vs Hugging Face's ", fields[2]);
    }
    if (ours_cased != fields[3] && ++differ_cased <= 6) {
      MESSAGE("cased, ", fields[0], " [", code_points(text), "]: ", ours_cased, " vs Hugging Face's ", fields[3]);
    }
  }
  MESSAGE(cases, " strings of the sweep: ", differ_uncased, " give other ids than BertTokenizerFast uncased (the model's), ",
          differ_cased, " cased");
  CHECK(cases > 0);
  CHECK(differ_uncased == 0);
  CHECK(differ_cased == 0);
}

TEST_CASE("encoder: the pretrained weights load by name; a missing, extra or reshaped tensor is an Error" *
          doctest::skip(kNoModel)) {
  const auto config = encoder::BertConfig::from_file(kModelDir + "/config.json");
  CHECK(config.hidden_size == 384);
  CHECK(config.num_hidden_layers == 6);
  auto tensors = mp::read_safetensors(kModelDir + "/model.safetensors");
  encoder::BertModel model(config);
  std::int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();
  MESSAGE("all-MiniLM-L6-v2: ", tensors.size(), " tensors, ", parameters, " parameters");
  CHECK(parameters == 22713216);
  const auto before = test::snapshot(model->parameters());
  auto missing = tensors;
  missing.erase("encoder.layer.3.output.dense.weight");
  CHECK_THROWS_WITH_AS(mp::load_state_dict(*model, missing),
                       doctest::Contains("(missing keys: 'encoder.layer.3.output.dense.weight')"),
                       mp::Error);
  auto extra = tensors;
  extra.insert("classifier.weight", torch::zeros({2, 384}));
  CHECK_THROWS_WITH_AS(mp::load_state_dict(*model, extra),
                       doctest::Contains("(unexpected keys: 'classifier.weight')"), mp::Error);
  auto reshaped = tensors;
  reshaped["pooler.dense.bias"] = torch::zeros({383});
  CHECK_THROWS_WITH_AS(mp::load_state_dict(*model, reshaped),
                       doctest::Contains("'pooler.dense.bias' has shape [383] in the state dict"), mp::Error);
  CHECK(test::identical(model->parameters(), before));
  mp::load_weights(*model, kModelDir + "/model.safetensors");
  CHECK(torch::equal(model->embeddings->word_embeddings->weight,
                     tensors["embeddings.word_embeddings.weight"]));
}

namespace {

std::vector<encoder::Example> parity_examples(std::size_t count) {
  return encoder::debian_sections(encoder::release_package_list(), 8, count, 0).train;
}

std::vector<std::pair<std::string, std::string>> described_packages() {
  return encoder::package_descriptions(encoder::read_package_list(encoder::release_package_list()));
}

void write_pickle(const std::string& path, const c10::impl::GenericDict& dict) {
  const auto bytes = torch::pickle_save(c10::IValue(dict));
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// The batch of the last_hidden_state case: the parity split's first 16 descriptions.
encoder::Batch hidden_batch(const encoder::WordPiece& tokenizer) {
  const auto examples = parity_examples(16);
  std::vector<std::int64_t> order(examples.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
  return encoder::make_batch(tokenizer, examples, order, 0, examples.size(), 64);
}

// The fine-tuning cases' recipe: `kSteps` batches of 8 (the parity split's first descriptions,
// 32 tokens at most), AdamW, clipping at 1, dropout off; the same for every policy. fp16 takes
// the first kHalfSteps: where the CPU has no fp16 arithmetic LibTorch emulates it, and 50 steps
// took 93 s in C++ and about as long in Python on the AMD EPYC of CI, against 19 s in fp32
// (tests/test_parity.cpp trains MixedO1<Half> against Python for 200 steps).
constexpr std::int64_t kSteps = 50, kHalfSteps = 20, kBatch = 8;
constexpr double kLr = 1e-4, kWeightDecay = 0.01, kInitScale = 65536.0;

std::vector<encoder::Batch> finetune_batches(const encoder::WordPiece& tokenizer) {
  const auto examples = parity_examples(static_cast<std::size_t>(kSteps * kBatch));
  std::vector<std::int64_t> order(examples.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = static_cast<std::int64_t>(i);
  std::vector<encoder::Batch> batches;
  for (std::int64_t k = 0; k < kSteps; ++k) {
    batches.push_back(encoder::make_batch(tokenizer, examples, order, static_cast<std::size_t>(k * kBatch),
                                          static_cast<std::size_t>((k + 1) * kBatch), 32));
  }
  return batches;
}

// The model every fine-tuning case starts from: the pretrained encoder and a head drawn from
// seed 3, the same for every policy and for Python's side (which is given the head's weights).
encoder::Classifier finetune_model() {
  torch::manual_seed(3);
  return encoder::pretrained_classifier(kModelDir, 8, /*dropout=*/false);
}

// Hugging Face's side of the cases below (tests/parity_encoder.py), run at the first case that
// needs it, for all of them in one Python process: importing torch and transformers takes
// seconds, which five processes paid five times. Writes every case's input and returns each
// mode's output file: "tokens" (ids per description), "hidden" (last_hidden_state),
// "finetune_fp32", "finetune_bf16", "finetune_fp16" (where this LibTorch has fp16 math on the
// CPU; the case is skipped elsewhere): one "loss scale skipped" line per step.
const std::map<std::string, std::string>& python_outputs() {
  static const std::map<std::string, std::string> outputs = [] {
    torch::set_num_threads(1);
    const encoder::WordPiece tokenizer(kModelDir + "/vocab.txt");
    std::map<std::string, std::string> files;
    const auto jobs = test::temp_path("encoder_jobs.txt");
    std::ofstream list(jobs);
    const auto job = [&](const std::string& mode, const std::string& input, const std::string& output) {
      list << mode << " " << input << " " << output << "\n";
      files[mode] = output;
    };
    const auto texts = test::temp_path("encoder_texts.txt");
    {
      std::ofstream out(texts);
      for (const auto& [text, section] : described_packages()) out << text << "\n";
    }
    job("tokens", texts, test::temp_path("encoder_tokens.txt"));
    const auto hidden = test::temp_path("encoder_hidden.pt");
    {
      const auto b = hidden_batch(tokenizer);
      c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
      dict.insert("ids", b.ids);
      dict.insert("mask", b.mask);
      write_pickle(hidden, dict);
    }
    job("hidden", hidden, test::temp_path("encoder_hidden_python.pt"));
    const auto finetune = test::temp_path("encoder_finetune.pt");
    {
      const auto batches = finetune_batches(tokenizer);
      const auto model = finetune_model();
      c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
      dict.insert("head.weight", model->head->weight.detach().clone());
      dict.insert("head.bias", model->head->bias.detach().clone());
      for (std::int64_t k = 0; k < kSteps; ++k) {
        const auto& b = batches[static_cast<std::size_t>(k)];
        dict.insert("ids." + std::to_string(k), b.ids);
        dict.insert("mask." + std::to_string(k), b.mask);
        dict.insert("labels." + std::to_string(k), b.labels);
      }
      dict.insert("steps", kSteps);
      dict.insert("steps.finetune_fp16", kHalfSteps);
      dict.insert("classes", std::int64_t{8});
      dict.insert("lr", kLr);
      dict.insert("weight_decay", kWeightDecay);
      dict.insert("max_grad_norm", 1.0);
      dict.insert("init_scale", kInitScale);
      write_pickle(finetune, dict);
    }
    for (const std::string mode : {"fp32", "bf16", "fp16"}) {
      if (mode == "fp16" && !mp::cpu_half_math) continue;
      job("finetune_" + mode, finetune, test::temp_path("encoder_finetune_" + mode + ".txt"));
    }
    list.close();
    const auto command = std::string(MIXPREC_SYSTEM_PYTHON) + " " + MIXPREC_PARITY_ENCODER_SCRIPT +
                         " jobs " + kModelDir + " " + jobs;
    REQUIRE(std::system(command.c_str()) == 0);
    return files;
  }();
  return outputs;
}

const std::string& python_output(const std::string& mode) {
  const auto& outputs = python_outputs();
  const auto it = outputs.find(mode);
  REQUIRE_MESSAGE(it != outputs.end(), "no Python job for ", mode);
  return it->second;
}

}  // namespace

TEST_CASE("encoder: token ids equal Python tokenizers' on every description of the package list" *
          doctest::skip(kNoModel || kNoPython)) {
  const encoder::WordPiece tokenizer(kModelDir + "/vocab.txt");
  const auto pairs = described_packages();
  std::ifstream in(python_output("tokens"));
  std::size_t differ = 0, non_ascii = 0, line = 0;
  for (std::string ids; std::getline(in, ids); ++line) {
    REQUIRE(line < pairs.size());
    const auto& text = pairs[line].first;
    const auto ours = tokenizer.encode(text, 1 << 20);
    std::ostringstream joined;
    for (std::size_t i = 0; i < ours.size(); ++i) joined << (i ? " " : "") << ours[i];
    if (joined.str() != ids && ++differ <= 5) {
      MESSAGE("differs: '", text, "': ", joined.str(), " vs ", ids);
    }
    for (const unsigned char c : text) non_ascii += c >= 0x80 ? 1 : 0;
  }
  MESSAGE(line, " descriptions (", non_ascii, " non-ASCII bytes): ", differ, " tokenized differently");
  CHECK(line == pairs.size());
  CHECK(differ == 0);
}

TEST_CASE("encoder: last_hidden_state equals transformers' BertModel within fp32 rounding" *
          doctest::skip(kNoModel || kNoPython)) {
  torch::set_num_threads(1);
  const encoder::WordPiece tokenizer(kModelDir + "/vocab.txt");
  const auto b = hidden_batch(tokenizer);
  std::ifstream in(python_output("hidden"), std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const auto theirs = torch::pickle_load(bytes).toTensor();
  auto model = encoder::pretrained_classifier(kModelDir, 8, /*dropout=*/false);
  model->eval();
  torch::NoGradGuard no_grad;
  const auto ours = model->bert->forward(b.ids, b.mask);
  REQUIRE(ours.sizes() == theirs.sizes());
  // Padded positions too: both attend to the real tokens only.
  const auto difference = (ours - theirs).abs();
  const double largest = difference.max().item<double>();
  const double real = difference.masked_select(b.mask.to(torch::kBool).unsqueeze(-1)).max().item<double>();
  const double scale = theirs.abs().max().item<double>();
  MESSAGE("last_hidden_state of ", b.ids.size(0), " descriptions x ", b.ids.size(1),
          " tokens: largest difference ", largest, " (at real tokens ", real,
          "; largest value ", scale, ")");
  CHECK(largest <= 1e-4);  // 6 layers of fp32 sums of 384 and 1536 products, values up to ~6
}

namespace {

struct StepRecord {
  double loss = 0, scale = 0;
  bool skipped = false;
};

// Fine-tunes the recipe above under P; in Python under `mode`. The same scales and skips; the
// losses within `tolerance` of each other, relative, as the other parity tests.
template <class P>
void check_finetune(const std::string& mode, double tolerance) {
  torch::set_num_threads(1);
  const std::int64_t steps = mode == "finetune_fp16" ? kHalfSteps : kSteps;
  const double lr = kLr, weight_decay = kWeightDecay, init_scale = kInitScale;
  const auto& output = python_output(mode);
  const encoder::WordPiece tokenizer(kModelDir + "/vocab.txt");
  const auto batches = finetune_batches(tokenizer);
  auto model = finetune_model();
  std::vector<StepRecord> python;
  {
    std::ifstream in(output);
    StepRecord r;
    int skipped = 0;
    while (in >> r.loss >> r.scale >> skipped) {
      r.skipped = skipped != 0;
      python.push_back(r);
    }
  }
  torch::optim::AdamW optimizer(model->parameters(),
                                torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
  auto options = mp::TrainerOptions().max_grad_norm(1.0);
  if constexpr (!std::is_same_v<typename P::scaler_type, mp::NoScaler>) {
    options.scaler(mp::GradScalerOptions().init_scale(init_scale));
  }
  mp::Trainer<P> trainer(model, optimizer, options);
  REQUIRE(python.size() == static_cast<std::size_t>(steps));
  double largest = 0, relative = 0;
  for (std::int64_t k = 0; k < steps; ++k) {
    const auto& b = batches[static_cast<std::size_t>(k)];
    const auto report = trainer.step([&] { return encoder::batch_loss<P>(model, b); });
    const auto& theirs = python[static_cast<std::size_t>(k)];
    CAPTURE(k);
    CHECK(report.scale == theirs.scale);
    CHECK((report.status == mp::StepStatus::skipped) == theirs.skipped);
    const double difference = std::abs(report.loss.template item<double>() - theirs.loss);
    largest = std::max(largest, difference);
    relative = std::max(relative, difference / std::max(std::abs(theirs.loss), 1e-3));
  }
  MESSAGE(P::name, " vs Python ", mode, ": ", steps, " fine-tuning steps, first loss ",
          python.front().loss, ", last ", python.back().loss, ", largest loss difference ", largest,
          " (relative ", relative, ", bound ", tolerance, ")");
  CHECK(relative <= tolerance);
  CHECK(python.back().loss < python.front().loss);
}

}  // namespace

TEST_CASE("encoder: fine-tuning, FullPrecision vs transformers in fp32, loss for loss" *
          doctest::skip(kNoModel || kNoPython)) {
  check_finetune<mp::FullPrecision>("finetune_fp32", 1e-5);
}

TEST_CASE("encoder: ... MixedO1<BFloat16> vs torch.autocast(bfloat16)" *
          doctest::skip(kNoModel || kNoPython)) {
  // Measured 0.0068 on the Xeon: the two round different intermediates to bf16 (CPU autocast's
  // softmax and its backward run in bf16, ops::masked_softmax's in fp32), about 1 bf16 ulp of
  // the loss after 50 steps.
  check_finetune<mp::MixedO1<at::BFloat16>>("finetune_bf16", std::ldexp(1.0, -6));
}

TEST_CASE("encoder: ... MixedO1<Half> + GradScaler vs torch.autocast(float16) + GradScaler(\"cpu\")" *
          doctest::skip(kNoModel || kNoPython || !mp::cpu_half_math)) {
  check_finetune<mp::MixedO1<at::Half>>("finetune_fp16", std::ldexp(1.0, -8));  // 4 fp16 ulps
}
