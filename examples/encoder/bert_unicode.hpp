#pragma once
// Unicode as the reference BERT tokenizer sees it. Hugging Face's `tokenizers` (Rust) does not
// take its Unicode from one version: general categories come from the unicode_categories crate
// (Unicode 8.0), NFD from unicode-normalization-alignments (Unicode 9.0), white space and lower
// case from Rust's std (Unicode 17.0 in tokenizers 0.23.3). Debian 12's ICU 72 knows Unicode 15.0:
// asked directly, it disagrees with the reference on about 826,000 code points (unassigned ones,
// which the reference keeps; marks and punctuation assigned after 8.0, which to it are neither;
// a few whose category changed). The reference is what the model's users tokenize with, so these
// functions answer as it does, from ICU and each code point's Unicode age: the stability policy
// freezes a decomposition and a combining class once assigned, so ICU's data cut at an age is that
// version's. tests/test_encoder.cpp checks every code point against the reference.

#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/unistr.h>
#include <unicode/locid.h>

#include <mixprec/core/error.hpp>

#include <cstdint>

namespace encoder::bert_unicode {

/// Whether `c` was assigned in Unicode `major`.`minor` or earlier (ICU's DerivedAge).
inline bool assigned_by(UChar32 c, std::uint8_t major, std::uint8_t minor) {
  UVersionInfo age;
  u_charAge(c, age);
  const bool unassigned = age[0] == 0 && age[1] == 0;
  return !unassigned && (age[0] < major || (age[0] == major && age[1] <= minor));
}

/// `c`'s general category in Unicode 8.0, the reference's: unassigned if assigned later.
inline UCharCategory category(UChar32 c) {
  // The categories that changed after 8.0, as 8.0 had them.
  switch (c) {
    case 0x166D: return U_OTHER_PUNCTUATION;       // CANADIAN SYLLABICS CHI SIGN: So since 12.0
    case 0x1734: return U_NON_SPACING_MARK;        // HANUNOO SIGN PAMUDPOD: Mc since 14.0
    case 0x1885: case 0x1886: return U_OTHER_LETTER;  // MONGOLIAN ALI GALI BALUDA: Mn since 9.0
    case 0xA9BD: return U_COMBINING_SPACING_MARK;  // JAVANESE CONSONANT SIGN KERET: Mn since 12.0
    case 0x111C9: return U_OTHER_PUNCTUATION;      // SHARADA SANDHI MARK: Mn since 11.0
    default: break;
  }
  if (!assigned_by(c, 8, 0)) return U_UNASSIGNED;
  return static_cast<UCharCategory>(u_charType(c));
}

/// BertNormalizer's control characters, which clean_text removes: Cc, Cf, Co (and Cs), not Cn:
/// unassigned code points and noncharacters stay (and become [UNK]). Tab, LF, CR are white space.
inline bool is_control(UChar32 c) {
  if (c == '\t' || c == '\n' || c == '\r') return false;
  switch (category(c)) {
    case U_CONTROL_CHAR: case U_FORMAT_CHAR: case U_PRIVATE_USE_CHAR: case U_SURROGATE:
      return true;
    default:
      return false;
  }
}

/// White_Space, as Rust's char::is_whitespace (the same 25 code points in ICU 72 and Unicode 17).
inline bool is_whitespace(UChar32 c) { return u_isUWhiteSpace(c) != 0; }

/// BertPreTokenizer's punctuation: ASCII's symbols and punctuation, and Unicode 8.0's P*.
inline bool is_punctuation(UChar32 c) {
  if ((c >= 33 && c <= 47) || (c >= 58 && c <= 64) || (c >= 91 && c <= 96) ||
      (c >= 123 && c <= 126)) {
    return true;
  }
  switch (category(c)) {
    case U_CONNECTOR_PUNCTUATION: case U_DASH_PUNCTUATION: case U_START_PUNCTUATION:
    case U_END_PUNCTUATION: case U_INITIAL_PUNCTUATION: case U_FINAL_PUNCTUATION:
    case U_OTHER_PUNCTUATION:
      return true;
    default:
      return false;
  }
}

/// The ranges BertNormalizer spaces out as CJK ideographs, whether assigned or not. (Google's
/// and transformers' Python tokenizer start Extension E's range at 0x2B820; the reference, whose
/// ids the model's users get, at 0x2B920.)
inline bool is_chinese(UChar32 c) {
  return (c >= 0x4E00 && c <= 0x9FFF) || (c >= 0x3400 && c <= 0x4DBF) ||
         (c >= 0x20000 && c <= 0x2A6DF) || (c >= 0x2A700 && c <= 0x2B73F) ||
         (c >= 0x2B740 && c <= 0x2B81F) || (c >= 0x2B920 && c <= 0x2CEAF) ||
         (c >= 0xF900 && c <= 0xFAFF) || (c >= 0x2F800 && c <= 0x2FA1F);
}

/// The marks strip_accents drops after NFD: Unicode 8.0's Mn (not Mc, not Me).
inline bool is_stripped_mark(UChar32 c) { return category(c) == U_NON_SPACING_MARK; }

/// `text` in NFD as Unicode 9.0 decomposes it: a code point assigned later is, to the reference,
/// a starter without a decomposition, so ICU's NFD runs on the stretches between such points.
inline icu::UnicodeString nfd(const icu::UnicodeString& text) {
  UErrorCode status = U_ZERO_ERROR;
  const auto* normalizer = icu::Normalizer2::getNFDInstance(status);
  MIXPREC_CHECK(U_SUCCESS(status), "WordPiece: ICU has no NFD normalizer");
  icu::UnicodeString result, stretch;
  const auto flush = [&] {
    result.append(normalizer->normalize(stretch, status));
    MIXPREC_CHECK(U_SUCCESS(status), "WordPiece: ICU could not normalize the text");
    stretch.remove();
  };
  for (int32_t i = 0; i < text.length(); i = text.moveIndex32(i, 1)) {
    const UChar32 c = text.char32At(i);
    // Inert to ICU (no decomposition, combining class 0: all that ICU does not know either) is
    // what the reference sees; otherwise the point cuts the stretch and stays as it is.
    if (!assigned_by(c, 9, 0) && !normalizer->isInert(c)) {
      flush();
      result.append(c);
    } else {
      stretch.append(c);
    }
  }
  flush();
  return result;
}

/// `c`'s full lower case, context-free (a final capital sigma becomes σ), as Rust's
/// char::to_lowercase: ICU's, and the case pairs Unicode added after 15.0, which ICU 72 lacks.
inline void append_lower(UChar32 c, icu::UnicodeString& out) {
  if (c < 0x80) {
    out.append(static_cast<UChar32>(c >= 'A' && c <= 'Z' ? c + 32 : c));
    return;
  }
  struct Pair {
    UChar32 first, last, offset;  // c in [first, last] lowers to c + offset
  };
  static constexpr Pair kLater[] = {
      {0x1C89, 0x1C89, 1},           {0xA7CB, 0xA7CB, 0x0264 - 0xA7CB},
      {0xA7CC, 0xA7CC, 1},           {0xA7CE, 0xA7CE, 1},
      {0xA7D2, 0xA7D2, 1},           {0xA7D4, 0xA7D4, 1},
      {0xA7DA, 0xA7DA, 1},           {0xA7DC, 0xA7DC, 0x019B - 0xA7DC},
      {0x10D50, 0x10D65, 0x20},      {0x16EA0, 0x16EB8, 0x1B},
  };
  for (const auto& pair : kLater) {
    if (c >= pair.first && c <= pair.last) {
      out.append(c + pair.offset);
      return;
    }
  }
  out.append(icu::UnicodeString(c).toLower(icu::Locale::getRoot()));
}

}  // namespace encoder::bert_unicode
