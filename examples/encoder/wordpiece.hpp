#pragma once
// BERT's tokenizer as Hugging Face's `tokenizers` runs it (BertTokenizerFast, the model's
// tokenizer.json): the special tokens matched in the raw text, then on the text between them
// BertNormalizer (remove control characters, space out CJK ideographs, strip accents and lower-case
// when the model is uncased) and BertPreTokenizer (split on white space and punctuation), then
// WordPiece's greedy longest match against vocab.txt. Unicode as that reference sees it:
// bert_unicode.hpp (ICU underneath; Debian: libicu-dev).

#include "bert_unicode.hpp"

#include <mixprec/core/error.hpp>

#include <unicode/unistr.h>

#include <cstdint>
#include <fstream>
#include <string>
#include <unordered_map>
#include <utility>
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
    for (const char* special : {"[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"}) {
      MIXPREC_CHECK(ids_.count(special) == 1, "WordPiece: '", vocab_path, "' lacks ", special,
                    ": not a BERT vocabulary");
      specials_.emplace_back(special, ids_.at(special));
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

  /// The token ids of `text` (UTF-8; an ill-formed sequence reads as U+FFFD, which is removed),
  /// without [CLS] and [SEP] around it. A special token written in the text, exactly ("[MASK]",
  /// not "[mask]"), is that token, as in the reference: its added vocabulary splits the raw text
  /// on them (leftmost, then longest) before it normalizes the rest.
  std::vector<std::int64_t> tokenize(const std::string& text) const {
    std::vector<std::int64_t> ids;
    for (std::size_t start = 0;;) {
      auto at = std::string::npos;
      const Special* found = nullptr;
      for (const auto& special : specials_) {
        const auto position = text.find(special.first, start);
        if (position < at || (position == at && found != nullptr &&
                              special.first.size() > found->first.size())) {
          at = position;
          found = &special;
        }
      }
      const auto end = found != nullptr ? at : text.size();
      for (const auto& word : words(normalized(text.substr(start, end - start)))) piece(word, ids);
      if (found == nullptr) return ids;
      ids.push_back(found->second);
      start = at + found->first.size();
    }
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

  /// BertNormalizer's output for `text`, as the reference's normalize_str gives it.
  std::string normalize(const std::string& text) const {
    const auto n = normalized(text);
    return utf8(n, 0, n.size());
  }

  /// BertPreTokenizer's words of `text` (normally the normalizer's output): split on white space,
  /// which goes, and on punctuation, each mark a word of its own.
  static std::vector<std::string> pre_tokenize(const std::string& text) {
    const auto input = icu::UnicodeString::fromUTF8(text);
    std::u32string chars;
    for (int32_t i = 0; i < input.length(); i = input.moveIndex32(i, 1)) {
      chars.push_back(static_cast<char32_t>(input.char32At(i)));
    }
    std::vector<std::string> result;
    for (const auto& word : words(chars)) result.push_back(utf8(word, 0, word.size()));
    return result;
  }

 private:
  using Special = std::pair<std::string, std::int64_t>;

  // Clean, space out CJK, then (uncased) NFD without nonspacing marks, lower-cased: the order of
  // BertNormalizer, each step on the whole text.
  std::u32string normalized(const std::string& text) const {
    namespace uni = bert_unicode;
    const auto input = icu::UnicodeString::fromUTF8(text);
    icu::UnicodeString cleaned;
    for (int32_t i = 0; i < input.length(); i = input.moveIndex32(i, 1)) {
      const UChar32 c = input.char32At(i);
      if (c == 0 || c == 0xFFFD || uni::is_control(c)) continue;
      if (uni::is_whitespace(c)) {
        cleaned.append(UChar32{' '});
      } else if (uni::is_chinese(c)) {
        cleaned.append(UChar32{' '}).append(c).append(UChar32{' '});
      } else {
        cleaned.append(c);
      }
    }
    if (lower_case_) {
      const auto decomposed = uni::nfd(cleaned);
      cleaned.remove();
      for (int32_t i = 0; i < decomposed.length(); i = decomposed.moveIndex32(i, 1)) {
        const UChar32 c = decomposed.char32At(i);
        if (!uni::is_stripped_mark(c)) uni::append_lower(c, cleaned);
      }
    }
    std::u32string result;
    for (int32_t i = 0; i < cleaned.length(); i = cleaned.moveIndex32(i, 1)) {
      result.push_back(static_cast<char32_t>(cleaned.char32At(i)));
    }
    return result;
  }

  static std::vector<std::u32string> words(const std::u32string& text) {
    std::vector<std::u32string> result;
    std::u32string word;
    const auto flush = [&] {
      if (!word.empty()) result.push_back(word);
      word.clear();
    };
    for (const char32_t c : text) {
      const auto u = static_cast<UChar32>(c);
      if (bert_unicode::is_whitespace(u)) {
        flush();
      } else if (bert_unicode::is_punctuation(u)) {
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
  std::vector<Special> specials_;
  bool lower_case_;
  std::int64_t unk_ = 0, cls_ = 0, sep_ = 0, pad_ = 0;
};

}  // namespace encoder
