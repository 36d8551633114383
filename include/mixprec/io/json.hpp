#pragma once
// A strict JSON reader (RFC 8259) for the header of safetensors files, so that mixprec needs no
// JSON library: UTF-8 text, no trailing commas or comments, nesting at most 64 deep (no stack
// exhaustion from a hostile file). Objects keep their members in order, repeated keys included:
// the caller decides what a repeated key means. Numbers keep their text; unsigned_integer()
// reads the whole non-negative ones.

#include <mixprec/core/error.hpp>

#include <charconv>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec::detail {

struct JsonMember;

struct Json {
  enum class Type { null, boolean, number, string, array, object };
  Type type = Type::null;
  bool boolean = false;
  std::string text;                  // a string's value, a number as written
  std::vector<Json> items;           // an array's
  std::vector<JsonMember> members;   // an object's, in order (a std::pair<std::string, Json>
                                     // here would need Json complete: clang refuses it)

  bool is_string() const noexcept { return type == Type::string; }
  bool is_array() const noexcept { return type == Type::array; }
  bool is_object() const noexcept { return type == Type::object; }

  /// The member `key` of an object (the first, if repeated); null if there is none.
  const Json* find(std::string_view key) const noexcept;

  /// The value of a number written as a whole number >= 0 that fits 64 bits ("12", not "-1",
  /// "1.0" or "1e3"); false for anything else.
  bool unsigned_integer(std::uint64_t& value) const noexcept {
    if (type != Type::number || text.empty()) return false;
    std::uint64_t v = 0;
    for (const char c : text) {
      if (c < '0' || c > '9') return false;
      const auto digit = static_cast<std::uint64_t>(c - '0');
      if (v > (UINT64_MAX - digit) / 10) return false;
      v = v * 10 + digit;
    }
    value = v;
    return true;
  }

  /// Compact JSON text, for messages.
  std::string dump() const;

  /// `s` as a JSON string: quotes and backslashes escaped, control characters as \u00XX (a
  /// checkpoint's index writes names that a parser must read back).
  static std::string quoted(const std::string& s) {
    std::string out = "\"";
    for (const char c : s) {
      if (static_cast<unsigned char>(c) < 0x20) {
        static constexpr char hex[] = "0123456789abcdef";
        out += "\\u00";
        out += hex[(c >> 4) & 0xF];
        out += hex[c & 0xF];
        continue;
      }
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  }

  /// `value` as JSON text that reads back as the same double: an integer where it is one (as
  /// Python's json writes PEFT's lora_alpha), else the shortest exact digits; NaN and the
  /// infinities, which JSON has no number for, as the strings "nan", "inf", "-inf".
  static std::string number(double value) {
    if (!std::isfinite(value)) return quoted(std::isnan(value) ? "nan" : value > 0 ? "inf" : "-inf");
    if (value == std::floor(value) && std::fabs(value) < 1e15) {
      return std::to_string(static_cast<long long>(value));
    }
    char text[32];
    return std::string(text, std::to_chars(text, text + sizeof text, value).ptr);
  }
};

/// One member of a JSON object.
struct JsonMember {
  std::string first;
  Json second;
};

inline const Json* Json::find(std::string_view key) const noexcept {
  for (const auto& [name, value] : members) {
    if (name == key) return &value;
  }
  return nullptr;
}

inline std::string Json::dump() const {
  switch (type) {
    case Type::null: return "null";
    case Type::boolean: return boolean ? "true" : "false";
    case Type::number: return text;
    case Type::string: return quoted(text);
    case Type::array: {
      std::string out = "[";
      for (std::size_t i = 0; i < items.size(); ++i) out += (i ? ", " : "") + items[i].dump();
      return out + "]";
    }
    case Type::object: {
      std::string out = "{";
      for (std::size_t i = 0; i < members.size(); ++i) {
        out += (i ? ", " : "") + quoted(members[i].first) + ": " + members[i].second.dump();
      }
      return out + "}";
    }
  }
  return {};
}

/// Parses [begin, end) as one JSON value (whitespace around it allowed); an Error that starts
/// with `what` and says where the text is not JSON.
class JsonParser {
 public:
  static constexpr int kMaxDepth = 64;

  static Json parse(std::string_view text, const std::string& what) {
    JsonParser parser(text, what);
    parser.skip_space();
    Json value = parser.value(0);
    parser.skip_space();
    if (parser.pos_ != text.size()) parser.fail_at("text after the JSON value");
    return value;
  }

 private:
  JsonParser(std::string_view text, const std::string& what) : text_(text), what_(what) {}

  [[noreturn]] void fail_at(const char* problem) const {
    fail(what_, " is not valid JSON: ", problem, " at byte ", pos_);
  }

  bool at_end() const noexcept { return pos_ >= text_.size(); }
  char peek() const noexcept { return at_end() ? '\0' : text_[pos_]; }

  void skip_space() noexcept {
    while (!at_end() && (peek() == ' ' || peek() == '\t' || peek() == '\n' || peek() == '\r')) ++pos_;
  }

  void expect(char c, const char* problem) {
    if (peek() != c || at_end()) fail_at(problem);
    ++pos_;
  }

  void literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) fail_at("an unknown word");
    pos_ += word.size();
  }

  Json value(int depth) {
    if (depth >= kMaxDepth) fail_at("nesting deeper than 64");
    Json v;
    if (at_end()) fail_at("the end of the text where a value belongs");
    switch (peek()) {
      case '{': object(v, depth); break;
      case '[': array(v, depth); break;
      case '"':
        v.type = Json::Type::string;
        v.text = string();
        break;
      case 't': literal("true"); v.type = Json::Type::boolean; v.boolean = true; break;
      case 'f': literal("false"); v.type = Json::Type::boolean; break;
      case 'n': literal("null"); break;
      default: number(v); break;
    }
    return v;
  }

  void object(Json& v, int depth) {
    v.type = Json::Type::object;
    ++pos_;
    skip_space();
    if (peek() == '}' && !at_end()) {
      ++pos_;
      return;
    }
    while (true) {
      skip_space();
      if (peek() != '"' || at_end()) fail_at("an object key that is not a string");
      auto key = string();
      skip_space();
      expect(':', "a missing ':' after an object key");
      skip_space();
      v.members.push_back(JsonMember{std::move(key), value(depth + 1)});
      skip_space();
      if (peek() == ',' && !at_end()) {
        ++pos_;
        continue;
      }
      expect('}', "a missing ',' or '}' in an object");
      return;
    }
  }

  void array(Json& v, int depth) {
    v.type = Json::Type::array;
    ++pos_;
    skip_space();
    if (peek() == ']' && !at_end()) {
      ++pos_;
      return;
    }
    while (true) {
      skip_space();
      v.items.push_back(value(depth + 1));
      skip_space();
      if (peek() == ',' && !at_end()) {
        ++pos_;
        continue;
      }
      expect(']', "a missing ',' or ']' in an array");
      return;
    }
  }

  void number(Json& v) {
    const auto start = pos_;
    const auto digits = [&] {
      const auto from = pos_;
      while (!at_end() && peek() >= '0' && peek() <= '9') ++pos_;
      return pos_ - from;
    };
    if (peek() == '-') ++pos_;
    if (peek() == '0' && !at_end()) {
      ++pos_;
    } else if (digits() == 0) {
      fail_at("a character that starts no JSON value");
    }
    if (peek() == '.' && !at_end()) {
      ++pos_;
      if (digits() == 0) fail_at("a number without digits after '.'");
    }
    if ((peek() == 'e' || peek() == 'E') && !at_end()) {
      ++pos_;
      if ((peek() == '+' || peek() == '-') && !at_end()) ++pos_;
      if (digits() == 0) fail_at("a number without digits in its exponent");
    }
    v.type = Json::Type::number;
    v.text = std::string(text_.substr(start, pos_ - start));
  }

  unsigned hex4() {
    unsigned code = 0;
    for (int i = 0; i < 4; ++i, ++pos_) {
      const char c = peek();
      if (at_end()) fail_at("a \\u escape cut short");
      code <<= 4;
      if (c >= '0' && c <= '9') {
        code |= static_cast<unsigned>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        code |= static_cast<unsigned>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        code |= static_cast<unsigned>(c - 'A' + 10);
      } else {
        fail_at("a \\u escape with a character that is not hexadecimal");
      }
    }
    return code;
  }

  static void append_utf8(std::string& out, unsigned code) {
    if (code < 0x80) {
      out += static_cast<char>(code);
    } else if (code < 0x800) {
      out += static_cast<char>(0xC0 | (code >> 6));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else if (code < 0x10000) {
      out += static_cast<char>(0xE0 | (code >> 12));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    } else {
      out += static_cast<char>(0xF0 | (code >> 18));
      out += static_cast<char>(0x80 | ((code >> 12) & 0x3F));
      out += static_cast<char>(0x80 | ((code >> 6) & 0x3F));
      out += static_cast<char>(0x80 | (code & 0x3F));
    }
  }

  // One UTF-8 sequence starting at pos_ (a byte >= 0x80), copied to `out`: no overlong forms,
  // surrogates or code points past U+10FFFF, as a UTF-8 validator refuses them.
  void utf8(std::string& out) {
    const auto lead = static_cast<unsigned char>(peek());
    int extra = 0;
    unsigned code = 0, min = 0;
    if (lead >= 0xC2 && lead <= 0xDF) {
      extra = 1, code = lead & 0x1F, min = 0x80;
    } else if (lead >= 0xE0 && lead <= 0xEF) {
      extra = 2, code = lead & 0x0F, min = 0x800;
    } else if (lead >= 0xF0 && lead <= 0xF4) {
      extra = 3, code = lead & 0x07, min = 0x10000;
    } else {
      fail_at("a byte that is not UTF-8");
    }
    const auto start = pos_++;
    for (int i = 0; i < extra; ++i, ++pos_) {
      const auto c = static_cast<unsigned char>(peek());
      if (at_end() || (c & 0xC0) != 0x80) fail_at("a UTF-8 sequence cut short");
      code = (code << 6) | (c & 0x3F);
    }
    if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) {
      pos_ = start;
      fail_at("a byte sequence that is not UTF-8");
    }
    out.append(text_.substr(start, pos_ - start));
  }

  std::string string() {
    ++pos_;  // the opening quote
    std::string out;
    while (true) {
      if (at_end()) fail_at("a string without its closing quote");
      const auto c = static_cast<unsigned char>(peek());
      if (c == '"') {
        ++pos_;
        return out;
      }
      if (c < 0x20) fail_at("a control character inside a string");
      if (c >= 0x80) {
        utf8(out);
        continue;
      }
      ++pos_;
      if (c != '\\') {
        out += static_cast<char>(c);
        continue;
      }
      const char e = peek();
      if (at_end()) fail_at("a string without its closing quote");
      ++pos_;
      switch (e) {
        case '"': out += '"'; break;
        case '\\': out += '\\'; break;
        case '/': out += '/'; break;
        case 'b': out += '\b'; break;
        case 'f': out += '\f'; break;
        case 'n': out += '\n'; break;
        case 'r': out += '\r'; break;
        case 't': out += '\t'; break;
        case 'u': {
          unsigned code = hex4();
          if (code >= 0xDC00 && code <= 0xDFFF) fail_at("a lone low surrogate in a \\u escape");
          if (code >= 0xD800 && code <= 0xDBFF) {
            if (text_.substr(pos_, 2) != "\\u") fail_at("a high surrogate without its low one");
            pos_ += 2;
            const unsigned low = hex4();
            if (low < 0xDC00 || low > 0xDFFF) fail_at("a high surrogate without its low one");
            code = 0x10000 + ((code - 0xD800) << 10) + (low - 0xDC00);
          }
          append_utf8(out, code);
          break;
        }
        default: --pos_; fail_at("an unknown escape in a string");
      }
    }
  }

  std::string_view text_;
  const std::string& what_;
  std::size_t pos_ = 0;
};

}  // namespace mixprec::detail
