#pragma once
// A strict reader of the pickles torch.save writes (protocol 2, and the few opcodes of protocols
// 3-4 that `pickle_protocol=4` adds): MARK, the tuple, list and dict opcodes, ints (of any
// size, as Python's), floats, strings, None and bools, the memo, GLOBAL/STACK_GLOBAL, REDUCE,
// BUILD and BINPERSID. What a global, a REDUCE, a BUILD or a persistent id means is the
// caller's (PickleObjects): torch.save's reader allows a handful of globals and refuses every
// other, as torch.load(weights_only=True) does, so no Python class is ever "constructed".
//
// LibTorch's own unpickler cannot read these files: it maps collections.OrderedDict, the type of
// every state_dict(), to None. This one is written for hostile bytes: every length is checked
// against what is left before anything is reserved, containers nest at most 64 deep, and a
// container placed inside another is frozen, so that no pickle can build a cycle.

#include <mixprec/core/error.hpp>

#include <ATen/ATen.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace mixprec::detail {

struct PickleValue;
using PickleRef = std::shared_ptr<PickleValue>;

/// One value of an unpickled object graph.
struct PickleValue {
  enum class Kind {
    none, boolean, integer, big_integer, real, string, tuple, list, dict, tensor, global, storage
  };
  Kind kind = Kind::none;
  bool boolean = false;
  bool nested = false;  // placed inside another value: frozen from then on
  int depth = 1;        // 1 + the depth of its deepest item
  std::int64_t integer = 0;
  double real = 0;
  // A string; a global's "module.name"; a big_integer's two's-complement little-endian bytes,
  // in the shortest form (one value, one text).
  std::string text;
  std::vector<PickleRef> items;                      // a tuple's or a list's
  std::vector<std::pair<PickleRef, PickleRef>> entries;  // a dict's, in order
  std::unique_ptr<std::set<std::string>> keys;       // a dict's (kind-tagged), to refuse repeats
  PickleRef state;  // what BUILD gave a dict: an OrderedDict's attributes (state_dict()'s _metadata)
  at::Tensor tensor;  // a tensor; a storage's bytes (kByte)
  at::ScalarType dtype = at::ScalarType::Undefined;  // a typed storage's dtype

  static PickleRef make(Kind kind) {
    auto v = std::make_shared<PickleValue>();
    v->kind = kind;
    return v;
  }

  /// "an int", "a dict": what messages call a value of this kind.
  static const char* describe(Kind kind) {
    switch (kind) {
      case Kind::none: return "None";
      case Kind::boolean: return "a bool";
      case Kind::integer: return "an int";
      case Kind::big_integer: return "an int beyond 64 bits";
      case Kind::real: return "a float";
      case Kind::string: return "a string";
      case Kind::tuple: return "a tuple";
      case Kind::list: return "a list";
      case Kind::dict: return "a dict";
      case Kind::tensor: return "a tensor";
      case Kind::global: return "a Python class or function";
      case Kind::storage: return "a storage";
    }
    return "a value";
  }
  const char* describe() const { return describe(kind); }

  /// An int's value in decimal, as Python prints it (a big_integer's of up to 64 bytes).
  std::string int_text() const {
    if (kind == Kind::integer) return std::to_string(integer);
    if (text.size() > 64) return "an int of " + std::to_string(text.size()) + " bytes";
    // The magnitude, most significant byte first, divided by 10 until nothing is left.
    const bool negative = (static_cast<unsigned char>(text.back()) & 0x80U) != 0;
    std::vector<unsigned> magnitude(text.rbegin(), text.rend());
    for (auto& b : magnitude) b = (negative ? ~b : b) & 0xFFU;
    if (negative) {  // two's complement: the magnitude is ~v + 1
      for (auto it = magnitude.rbegin(); it != magnitude.rend(); ++it) {
        *it = (*it + 1) & 0xFFU;
        if (*it != 0) break;
      }
    }
    std::string digits;
    while (std::any_of(magnitude.begin(), magnitude.end(), [](unsigned b) { return b != 0; })) {
      unsigned rest = 0;
      for (auto& b : magnitude) {
        const unsigned value = rest * 256 + b;
        b = value / 10;
        rest = value % 10;
      }
      digits += static_cast<char>('0' + rest);
    }
    if (negative) digits += '-';
    return std::string(digits.rbegin(), digits.rend());
  }
};

/// What the globals, REDUCE, BUILD and persistent ids of a pickle mean; each throws
/// mixprec::Error for what it does not accept. A BUILD that build() accepts keeps its state in
/// the object's `state`.
class PickleObjects {
 public:
  virtual ~PickleObjects() = default;
  virtual PickleRef global(const std::string& module, const std::string& name) = 0;
  virtual PickleRef reduce(const PickleValue& callable, const PickleValue& args) = 0;
  virtual void build(const PickleValue& object, const PickleValue& state) = 0;
  virtual PickleRef persistent_load(const PickleValue& pid) = 0;
};

class Unpickler {
 public:
  static constexpr int kMaxDepth = 64;

  /// Unpickles `data`, which `what` names in errors ("the pickle of 'model.pt'").
  static PickleRef load(std::string_view data, const std::string& what, PickleObjects& objects) {
    Unpickler u(data, what, objects);
    return u.run();
  }

 private:
  Unpickler(std::string_view data, const std::string& what, PickleObjects& objects)
      : data_(data), what_(what), objects_(objects) {}

  [[noreturn]] void malformed(const std::string& problem) const {
    fail(what_, " is malformed: ", problem, " (opcode at byte ", op_at_, ")");
  }

  const unsigned char* take(std::uint64_t n) {
    if (n > data_.size() - pos_) malformed("it ends inside an opcode's argument");
    const auto* p = reinterpret_cast<const unsigned char*>(data_.data() + pos_);
    pos_ += static_cast<std::size_t>(n);
    return p;
  }
  std::uint64_t unsigned_le(int n) {
    const auto* p = take(static_cast<std::uint64_t>(n));
    std::uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
    return v;
  }
  std::string text(std::uint64_t n) {
    const auto* p = take(n);
    return std::string(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n));
  }
  std::string line() {
    const auto rest = data_.substr(pos_);
    const auto end = rest.find('\n');
    if (end == std::string_view::npos) malformed("a GLOBAL without the end of its line");
    pos_ += end + 1;
    return std::string(rest.substr(0, end));
  }

  // The first stack index above the innermost mark: what an opcode may pop.
  std::size_t floor() const { return marks_.empty() ? 0 : marks_.back(); }
  PickleRef pop() {
    if (stack_.size() <= floor()) malformed("an opcode pops from an empty stack");
    auto v = std::move(stack_.back());
    stack_.pop_back();
    return v;
  }
  const PickleRef& top() const {
    if (stack_.size() <= floor()) malformed("an opcode reads an empty stack");
    return stack_.back();
  }
  std::vector<PickleRef> pop_mark() {
    if (marks_.empty()) malformed("an opcode needs a MARK that is not there");
    const auto mark = marks_.back();
    marks_.pop_back();
    std::vector<PickleRef> items(std::make_move_iterator(stack_.begin() + static_cast<std::ptrdiff_t>(mark)),
                                 std::make_move_iterator(stack_.end()));
    stack_.resize(mark);
    return items;
  }

  // `child` goes inside `container`, which is frozen from then on; no cycles, no depth past 64.
  void adopt(PickleValue& container, const PickleRef& child) const {
    if (child.get() == &container) malformed("a container is put inside itself");
    child->nested = true;
    container.depth = std::max(container.depth, child->depth + 1);
    if (container.depth > kMaxDepth) malformed("containers nest deeper than 64");
  }
  PickleValue& mutable_container(PickleValue::Kind kind, const char* op) const {
    const auto& target = top();
    if (target->kind != kind) {
      malformed(std::string(op) + " on " + target->describe() + ", not on " +
                PickleValue::describe(kind));
    }
    if (target->nested) malformed(std::string(op) + " changes a container already inside another");
    return *target;
  }

  PickleRef tuple(std::vector<PickleRef> items) const {
    auto t = PickleValue::make(PickleValue::Kind::tuple);
    for (const auto& item : items) adopt(*t, item);
    t->items = std::move(items);
    return t;
  }

  void set_item(PickleValue& dict, const PickleRef& key, const PickleRef& value) const {
    // Each key once, in its kind: a string's text, an int's 8 bytes, a big int's shortest form.
    std::string tagged;
    if (key->kind == PickleValue::Kind::string) {
      tagged = "s" + key->text;
    } else if (key->kind == PickleValue::Kind::integer) {
      tagged = "i" + std::string(reinterpret_cast<const char*>(&key->integer), sizeof key->integer);
    } else if (key->kind == PickleValue::Kind::big_integer) {
      tagged = "b" + key->text;
    } else {
      malformed(std::string("a dict key that is ") + key->describe() + " (strings and ints are read)");
    }
    if (!dict.keys) dict.keys = std::make_unique<std::set<std::string>>();
    if (!dict.keys->insert(std::move(tagged)).second) {
      malformed("a dict gets the key " + (key->kind == PickleValue::Kind::string
                                              ? "'" + key->text + "'" : key->int_text()) + " twice");
    }
    adopt(dict, key);
    adopt(dict, value);
    dict.entries.emplace_back(key, value);
  }

  void push_int(std::int64_t v) {
    auto value = PickleValue::make(PickleValue::Kind::integer);
    value->integer = v;
    stack_.push_back(std::move(value));
  }
  void push_string(std::string s) {
    auto value = PickleValue::make(PickleValue::Kind::string);
    value->text = std::move(s);
    stack_.push_back(std::move(value));
  }
  void memo_put(std::uint64_t index) { memo_[index] = top(); }
  void memo_get(std::uint64_t index) {
    const auto it = memo_.find(index);
    if (it == memo_.end()) malformed("it reads memo entry " + std::to_string(index) + ", never written");
    stack_.push_back(it->second);
  }
  void push_global(const std::string& module, const std::string& name) {
    stack_.push_back(objects_.global(module, name));
  }

  // A two's-complement little-endian integer of n bytes (LONG1, LONG4): Python's ints have no
  // bound (torch.seed() is >= 2^63 half the time, and pickles as 9 bytes). An int64 where it
  // fits, else a big_integer, which only a value that must be an int64 refuses.
  void push_long(std::uint64_t n) {
    if (n == 0) return push_int(0);
    const auto* p = take(n);
    // The shortest form: high bytes that only repeat the sign go (a writer may pad).
    while (n > 1 && ((p[n - 1] == 0x00 && p[n - 2] < 0x80) || (p[n - 1] == 0xFF && p[n - 2] >= 0x80))) --n;
    if (n > 8) {
      auto value = PickleValue::make(PickleValue::Kind::big_integer);
      value->text.assign(reinterpret_cast<const char*>(p), static_cast<std::size_t>(n));
      stack_.push_back(std::move(value));
      return;
    }
    std::uint64_t v = 0;
    for (auto i = n; i-- > 0;) v = (v << 8) | p[i];
    if (n < 8 && (v >> (8 * n - 1)) != 0) v |= ~std::uint64_t{0} << (8 * n);  // sign-extend
    push_int(static_cast<std::int64_t>(v));
  }

  PickleRef run() {
    while (true) {
      op_at_ = pos_;
      const auto op = *take(1);
      switch (op) {
        case 0x80: {  // PROTO
          const auto version = *take(1);
          if (version > 5) malformed("pickle protocol " + std::to_string(version));
          break;
        }
        case 0x95: {  // FRAME: a length to skip, of bytes that follow anyway
          if (unsigned_le(8) > data_.size() - pos_) malformed("a FRAME longer than the pickle");
          break;
        }
        case '.': {  // STOP
          if (!marks_.empty() || stack_.size() != 1) malformed("STOP with the stack unfinished");
          if (pos_ != data_.size()) malformed("bytes after STOP");
          return stack_.back();
        }
        case '(': marks_.push_back(stack_.size()); break;  // MARK
        case '0':  // POP: the top item, or the innermost mark where there is none above it
          if (stack_.size() > floor()) {
            stack_.pop_back();
          } else {
            pop_mark();
          }
          break;
        case '1': pop_mark(); break;  // POP_MARK
        case '2': stack_.push_back(top()); break;  // DUP
        case 'N': stack_.push_back(PickleValue::make(PickleValue::Kind::none)); break;
        case 0x88:
        case 0x89: {  // NEWTRUE, NEWFALSE
          auto v = PickleValue::make(PickleValue::Kind::boolean);
          v->boolean = op == 0x88;
          stack_.push_back(std::move(v));
          break;
        }
        case 'J': push_int(static_cast<std::int32_t>(static_cast<std::uint32_t>(unsigned_le(4)))); break;
        case 'K': push_int(static_cast<std::int64_t>(unsigned_le(1))); break;
        case 'M': push_int(static_cast<std::int64_t>(unsigned_le(2))); break;
        case 0x8a: push_long(unsigned_le(1)); break;  // LONG1
        case 0x8b: push_long(unsigned_le(4)); break;  // LONG4
        case 'G': {  // BINFLOAT: big-endian
          const auto* p = take(8);
          std::uint64_t bits = 0;
          for (int i = 0; i < 8; ++i) bits = (bits << 8) | p[i];
          auto v = PickleValue::make(PickleValue::Kind::real);
          v->real = std::bit_cast<double>(bits);
          stack_.push_back(std::move(v));
          break;
        }
        case 'X': push_string(text(unsigned_le(4))); break;     // BINUNICODE
        case 0x8c: push_string(text(unsigned_le(1))); break;    // SHORT_BINUNICODE
        case 0x8d: push_string(text(unsigned_le(8))); break;    // BINUNICODE8
        case 'U': push_string(text(unsigned_le(1))); break;     // SHORT_BINSTRING
        case 'T': {                                             // BINSTRING
          const auto n = static_cast<std::int32_t>(static_cast<std::uint32_t>(unsigned_le(4)));
          if (n < 0) malformed("a string of negative length");
          push_string(text(static_cast<std::uint64_t>(n)));
          break;
        }
        case ')': stack_.push_back(tuple({})); break;  // EMPTY_TUPLE
        case 't': stack_.push_back(tuple(pop_mark())); break;  // TUPLE
        case 0x85:
        case 0x86:
        case 0x87: {  // TUPLE1, TUPLE2, TUPLE3
          const std::size_t n = op - 0x84U;
          if (stack_.size() - floor() < n) malformed("a TUPLE of more items than the stack holds");
          std::vector<PickleRef> items(stack_.end() - static_cast<std::ptrdiff_t>(n), stack_.end());
          stack_.resize(stack_.size() - n);
          stack_.push_back(tuple(std::move(items)));
          break;
        }
        case ']': stack_.push_back(PickleValue::make(PickleValue::Kind::list)); break;
        case '}': stack_.push_back(PickleValue::make(PickleValue::Kind::dict)); break;
        case 'a': {  // APPEND
          auto value = pop();
          auto& list = mutable_container(PickleValue::Kind::list, "APPEND");
          adopt(list, value);
          list.items.push_back(std::move(value));
          break;
        }
        case 'e': {  // APPENDS
          auto values = pop_mark();
          auto& list = mutable_container(PickleValue::Kind::list, "APPENDS");
          for (auto& value : values) {
            adopt(list, value);
            list.items.push_back(std::move(value));
          }
          break;
        }
        case 's': {  // SETITEM
          auto value = pop();
          auto key = pop();
          set_item(mutable_container(PickleValue::Kind::dict, "SETITEM"), key, value);
          break;
        }
        case 'u': {  // SETITEMS
          auto values = pop_mark();
          if (values.size() % 2 != 0) malformed("SETITEMS with a key but no value");
          auto& dict = mutable_container(PickleValue::Kind::dict, "SETITEMS");
          for (std::size_t i = 0; i < values.size(); i += 2) set_item(dict, values[i], values[i + 1]);
          break;
        }
        case 'q': memo_put(unsigned_le(1)); break;  // BINPUT
        case 'r': memo_put(unsigned_le(4)); break;  // LONG_BINPUT
        case 0x94: memo_put(memo_.size()); break;   // MEMOIZE
        case 'h': memo_get(unsigned_le(1)); break;  // BINGET
        case 'j': memo_get(unsigned_le(4)); break;  // LONG_BINGET
        case 'c': {  // GLOBAL
          auto module = line();
          auto name = line();
          push_global(module, name);
          break;
        }
        case 0x93: {  // STACK_GLOBAL
          const auto name = pop();
          const auto module = pop();
          if (name->kind != PickleValue::Kind::string || module->kind != PickleValue::Kind::string) {
            malformed("STACK_GLOBAL of values that are not strings");
          }
          push_global(module->text, name->text);
          break;
        }
        case 'R': {  // REDUCE
          const auto args = pop();
          const auto callable = pop();
          if (callable->kind != PickleValue::Kind::global || args->kind != PickleValue::Kind::tuple) {
            malformed("REDUCE of something other than a function and a tuple");
          }
          stack_.push_back(objects_.reduce(*callable, *args));
          break;
        }
        case 'b': {  // BUILD: kept as the object's state, which freezes it as a container does
          const auto state = pop();
          auto& object = *top();
          if (object.nested) malformed("BUILD changes a value already inside another");
          if (object.state) malformed("a second BUILD of one value");
          objects_.build(object, *state);
          adopt(object, state);
          object.state = state;
          break;
        }
        case 'Q': {  // BINPERSID
          const auto pid = pop();
          stack_.push_back(objects_.persistent_load(*pid));
          break;
        }
        default: {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02x", static_cast<unsigned>(op));
          malformed(std::string("opcode ") + hex + ", which torch.save does not write (or not in "
                    "a state dict)");
        }
      }
    }
  }

  std::string_view data_;
  const std::string& what_;
  PickleObjects& objects_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  std::vector<PickleRef> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, PickleRef> memo_;
};

}  // namespace mixprec::detail
