#pragma once
// Ordered module-path patterns applied to a model: the first pattern that matches a module's
// path decides it. What a precision map is made of; activation checkpointing and sharded units
// are to apply by the same rules and refuse the same two mistakes: a pattern that matches no
// module (a typo), and one that matches only modules an earlier pattern decides (shadowed).
// Either would otherwise silently do nothing.

#include <mixprec/core/error.hpp>

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace mixprec::detail {

// `*` matches any run of characters but '.', `**` any run, `?` one character but '.'.
inline bool glob_match(std::string_view pattern, std::string_view path) {
  if (pattern.empty()) return path.empty();
  if (pattern.substr(0, 2) == "**") {
    const auto rest = pattern.substr(2);
    for (std::size_t i = 0; i <= path.size(); ++i) {
      if (glob_match(rest, path.substr(i))) return true;
    }
    return false;
  }
  if (pattern.front() == '*') {
    const auto rest = pattern.substr(1);
    for (std::size_t i = 0; i <= path.size(); ++i) {
      if (glob_match(rest, path.substr(i))) return true;
      if (i < path.size() && path[i] == '.') return false;
    }
    return false;
  }
  if (path.empty()) return false;
  if (pattern.front() == '?' ? path.front() == '.' : pattern.front() != path.front()) return false;
  return glob_match(pattern.substr(1), path.substr(1));
}

inline std::size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diagonal = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t above = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

// The names closest to `pattern`, for an Error about a rule that matches nothing.
inline std::string closest_names(std::string_view pattern, const std::vector<std::string>& names) {
  std::vector<std::pair<std::size_t, std::string>> ranked;
  for (const auto& name : names) ranked.emplace_back(edit_distance(pattern, name), name);
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string result;
  for (std::size_t i = 0; i < ranked.size() && i < 5; ++i) {
    result += (i == 0 ? "'" : ", '") + ranked[i].second + "'";
  }
  return result.empty() ? "none (the model has no submodules)" : result;
}

// The index of the first of `patterns` that matches `path`, if any.
inline std::optional<std::size_t> first_match(const std::vector<std::string>& patterns,
                                              std::string_view path) {
  for (std::size_t i = 0; i < patterns.size(); ++i) {
    if (glob_match(patterns[i], path)) return i;
  }
  return std::nullopt;
}

/// Which of `patterns` decides each of `paths` (a model's named_modules() paths, in order): the
/// first that matches it, or none. Throws, before the caller changes anything, unless every
/// pattern decides at least one path: one that matches none is named with the closest paths;
/// one whose every match an earlier pattern decides is named with the patterns that shadow it
/// and the modules they take. `describe(i)` is how the Errors name rule i ("precision map rule
/// 'head' (fp32)").
template <class Describe>
std::vector<std::optional<std::size_t>> decide_paths(const std::vector<std::string>& patterns,
                                                     const std::vector<std::string>& paths,
                                                     Describe&& describe) {
  std::vector<std::optional<std::size_t>> decided;
  decided.reserve(paths.size());
  for (const auto& path : paths) decided.push_back(first_match(patterns, path));
  for (std::size_t rule = 0; rule < patterns.size(); ++rule) {
    std::vector<std::size_t> matched;  // indices into paths
    bool decides = false;
    for (std::size_t i = 0; i < paths.size() && !decides; ++i) {
      if (!glob_match(patterns[rule], paths[i])) continue;
      matched.push_back(i);
      decides = decided[i] == rule;
    }
    if (decides) continue;
    MIXPREC_CHECK(!matched.empty(), describe(rule), " matches no module of the model; the "
                  "closest names: ", closest_names(patterns[rule], paths),
                  " (`*` matches within one name, `**` across dots); nothing was changed");
    // Shadowed: the earlier rules that decide what it matches, each once, in order.
    std::vector<std::size_t> earlier;
    for (const auto i : matched) earlier.push_back(*decided[i]);
    std::sort(earlier.begin(), earlier.end());
    earlier.erase(std::unique(earlier.begin(), earlier.end()), earlier.end());
    std::string shadows, modules;
    for (std::size_t k = 0; k < earlier.size(); ++k) {
      shadows += (k == 0 ? "" : k + 1 == earlier.size() ? " and " : ", ") + describe(earlier[k]);
    }
    for (std::size_t k = 0; k < matched.size() && k < 5; ++k) {
      modules += (k == 0 ? "'" : ", '") + paths[matched[k]] + "'";
    }
    if (matched.size() > 5) modules += ", ... (" + std::to_string(matched.size()) + " modules)";
    fail(describe(rule), " decides no module: every module it matches (", modules, ") is "
         "decided by the earlier ", shadows, ", since the first rule that matches a module "
         "decides it. Put the narrower rule first, or drop one of them; nothing was changed");
  }
  return decided;
}

}  // namespace mixprec::detail
