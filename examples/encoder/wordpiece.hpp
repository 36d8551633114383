#pragma once
// BERT's tokenizer: the normalizer and pre-tokenizer of Hugging Face's BertTokenizer (clean the
// text, space out CJK ideographs, strip accents and lower-case when the model is uncased, split
// on whitespace and punctuation), then WordPiece's greedy longest-match against vocab.txt.
// Unicode's categories, case mapping and NFD come from ICU (Debian: libicu-dev).

#include <mixprec/error.hpp>

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/locid.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <unordered_map>
#include <vector>

namespace encoder {

class WordPiece {
 public:
  /// `vocab_path`: one token per line, its id its line number. `lower_case`: the model's
  /// do_lower_case (then accents are stripped too, as BertNormalizer does by default).
  explicit WordPiece(const std::string& vocab_path, bool lower_case = true)
      : lower_case_(lower_case) {
    std::ifstream in(vocab_path);
    MIXPREC_CHECK(in, "WordPiece: cannot open the vocabulary '", vocab_path, "'");
    std::string line;
    for (std::int64_t id = 0; std::getline(in, line); ++id) {
      if (!line.empty() && line.back() == '\r') line.pop_back();
      ids_.emplace(line, id);
    }
    for (const char* special : {"[UNK]", "[CLS]", "[SEP]", "[PAD]"}) {
      MIXPREC_CHECK(ids_.count(special) == 1, "WordPiece: '", vocab_path, "' lacks ", special,
                    ": not a BERT vocabulary");
    }
    unk_ = ids_.at("[UNK]");
    cls_ = ids_.at("[CLS]");
    sep_ = ids_.at("[SEP]");
    pad_ = ids_.at("[PAD]");
  }

  std::int64_t cls() const { return cls_; }
  std::int64_t sep() const { return sep_; }
  std::int64_t pad() const { return pad_; }
  std::size_t size() const { return ids_.size(); }

  /// The token ids of `text` (UTF-8), without [CLS] and [SEP].
  std::vector<std::int64_t> tokenize(const std::string& text) const {
    std::vector<std::int64_t> ids;
    for (const auto& word : words(normalize(text))) piece(word, ids);
    return ids;
  }

  /// [CLS] tokens [SEP], truncated to `max_length` ids (the tokens cut, not [SEP]).
  std::vector<std::int64_t> encode(const std::string& text, std::size_t max_length) const {
    auto tokens = tokenize(text);
    if (tokens.size() + 2 > max_length) tokens.resize(max_length >= 2 ? max_length - 2 : 0);
    std::vector<std::int64_t> ids{cls_};
    ids.insert(ids.end(), tokens.begin(), tokens.end());
    ids.push_back(sep_);
    return ids;
  }

 private:
  // Unicode's "Other" categories (Cc, Cf, Cn, Co, Cs), as the reference's is_control.
  static bool is_control(UChar32 c) {
    if (c == '\t' || c == '\n' || c == '\r') return false;
    switch (u_charType(c)) {
      case U_CONTROL_CHAR: case U_FORMAT_CHAR: case U_UNASSIGNED: case U_PRIVATE_USE_CHAR:
      case U_SURROGATE:
        return true;
      default:
        return false;
    }
  }
  static bool is_whitespace(UChar32 c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || u_isUWhiteSpace(c);
  }
  static bool is_punctuation(UChar32 c) {
    if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
        (c >= 123 && c <= 126)) {
      return true;  // ASCII punctuation and symbols
    }
    return u_ispunct(c);  // Unicode's P* categories
  }
  static bool is_cjk(UChar32 c) {
    return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
           (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
           (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B820 && c <= 0x2CEAF) ||
           (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
  }

  // Clean, space out CJK, strip accents (NFD, drop Mn), lower-case: BertNormalizer's order.
  std::u32string normalize(const std::string& text) const {
    const auto input = icu::UnicodeString::fromUTF8(text);
    icu::UnicodeString cleaned;
    for (int32_t i = 0; i < input.length(); i = input.moveIndex32(i, 1)) {
      const UChar32 c = input.char32At(i);
      if (c == 0 || c == 0xFFFD || is_control(c)) continue;
      if (is_whitespace(c)) {
        cleaned.append(UChar32{' '});
      } else if (is_cjk(c)) {
        cleaned.append(UChar32{' '}).append(c).append(UChar32{' '});
      } else {
        cleaned.append(c);
      }
    }
    if (lower_case_) {
      UErrorCode status = U_ZERO_ERROR;
      const auto* nfd = icu::Normalizer2::getNFDInstance(status);
      MIXPREC_CHECK(U_SUCCESS(status), "WordPiece: ICU has no NFD normalizer");
      const auto decomposed = nfd->normalize(cleaned, status);
      MIXPREC_CHECK(U_SUCCESS(status), "WordPiece: ICU could not normalize the text");
      cleaned.remove();
      for (int32_t i = 0; i < decomposed.length(); i = decomposed.moveIndex32(i, 1)) {
        const UChar32 c = decomposed.char32At(i);
        if (u_charType(c) == U_NON_SPACING_MARK) continue;
        if (c < 0x80) {
          cleaned.append(static_cast<UChar32>(c >= 'A' && c <= 'Z' ? c + 32 : c));
        } else {
          // Each character's full lower case on its own, as the reference maps them: no
          // context (a final capital sigma becomes σ, not ς).
          cleaned.append(icu::UnicodeString(c).toLower(icu::Locale::getRoot()));
        }
      }
    }
    std::u32string result;
    for (int32_t i = 0; i < cleaned.length(); i = cleaned.moveIndex32(i, 1)) {
      result.push_back(static_cast<char32_t>(cleaned.char32At(i)));
    }
    return result;
  }

  // Split on whitespace (dropped) and punctuation (each its own word).
  static std::vector<std::u32string> words(const std::u32string& text) {
    std::vector<std::u32string> result;
    std::u32string word;
    const auto flush = [&] {
      if (!word.empty()) result.push_back(word);
      word.clear();
    };
    for (const char32_t c : text) {
      const auto u = static_cast<UChar32>(c);
      if (is_whitespace(u)) {
        flush();
      } else if (is_punctuation(u)) {
        flush();
        result.emplace_back(1, c);
      } else {
        word.push_back(c);
      }
    }
    flush();
    return result;
  }

  static std::string utf8(const std::u32string& s, std::size_t begin, std::size_t end) {
    icu::UnicodeString u;
    for (std::size_t i = begin; i < end; ++i) u.append(static_cast<UChar32>(s[i]));
    std::string out;
    u.toUTF8String(out);
    return out;
  }

  // WordPiece: the longest vocabulary entry from the start, then "##"-prefixed ones; a word
  // with a part in no entry, or longer than 100 characters, is one [UNK].
  void piece(const std::u32string& word, std::vector<std::int64_t>& ids) const {
    if (word.size() > 100) {
      ids.push_back(unk_);
      return;
    }
    std::vector<std::int64_t> pieces;
    for (std::size_t start = 0; start < word.size();) {
      std::size_t end = word.size();
      std::int64_t found = -1;
      for (; end > start; --end) {
        const auto candidate = (start > 0 ? "##" : "") + utf8(word, start, end);
        const auto it = ids_.find(candidate);
        if (it != ids_.end()) {
          found = it->second;
          break;
        }
      }
      if (found < 0) {
        ids.push_back(unk_);
        return;
      }
      pieces.push_back(found);
      start = end;
    }
    ids.insert(ids.end(), pieces.begin(), pieces.end());
  }

  std::unordered_map<std::string, std::int64_t> ids_;
  bool lower_case_;
  std::int64_t unk_ = 0, cls_ = 0, sep_ = 0, pad_ = 0;
};

}  // namespace encoder
