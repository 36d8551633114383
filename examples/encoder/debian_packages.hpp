#pragma once
// Real labelled text that a Debian machine has without a download: the package list that
// `apt-get update` fetched for the release (Debian 12 "bookworm", main, amd64: 63,440 packages),
// each package's one-line description labelled by its archive section ("python", "libs",
// "doc", ...). The classes are the most common sections; a description that occurs under two of
// them is dropped, every other occurs once; the split is by a hash of the text, so it is the
// same on every machine with the same list, whatever order the list is read in.

#include <mixprec/core/error.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace encoder {

struct Example {
  std::string text;
  std::int64_t label = 0;
};

struct DataSet {
  std::vector<std::string> classes;  // the sections, label i is classes[i]
  std::vector<Example> train, test;
  std::string source;                // the package list read
};

namespace detail {

inline std::uint64_t fnv1a(const std::string& text) {
  std::uint64_t hash = 14695981039346656037ULL;
  for (const unsigned char c : text) hash = (hash ^ c) * 1099511628211ULL;
  return hash;
}

}  // namespace detail

/// The release's package list among apt's lists (not -updates, -security or -backports, which
/// change from day to day): the largest "*_main_binary-*_Packages*" file in `lists`.
inline std::string release_package_list(const std::string& lists = "/var/lib/apt/lists") {
  std::string best;
  std::uintmax_t best_size = 0;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(lists, error)) {
    const auto name = entry.path().filename().string();
    if (name.find("_main_binary-") == std::string::npos || name.find("_Packages") == std::string::npos ||
        name.find("-updates_") != std::string::npos || name.find("-security_") != std::string::npos ||
        name.find("-backports_") != std::string::npos) {
      continue;
    }
    const auto size = entry.file_size(error);
    if (!error && size > best_size) {
      best = entry.path().string();
      best_size = size;
    }
  }
  MIXPREC_CHECK(!best.empty(), "no Debian package list in '", lists, "': run `apt-get update` "
                "(the data set is the release's package descriptions), or pass a Packages file");
  return best;
}

/// The text of a package list, decompressed by apt's own helper (lz4, gz, xz or plain).
inline std::string read_package_list(const std::string& path) {
  const std::string command = "/usr/lib/apt/apt-helper cat-file '" + path + "' 2>/dev/null";
  std::unique_ptr<FILE, int (*)(FILE*)> pipe(::popen(command.c_str(), "r"), ::pclose);
  MIXPREC_CHECK(pipe != nullptr, "cannot run apt-helper to read '", path, "'");
  std::string text;
  char buffer[1 << 16];
  for (std::size_t n; (n = std::fread(buffer, 1, sizeof buffer, pipe.get())) > 0;) {
    text.append(buffer, n);
  }
  MIXPREC_CHECK(::pclose(pipe.release()) == 0 && !text.empty(), "apt-helper could not read the "
                "package list '", path, "'");
  return text;
}

/// (description, section) of every package in a package list's text.
inline std::vector<std::pair<std::string, std::string>> package_descriptions(const std::string& list) {
  std::vector<std::pair<std::string, std::string>> result;
  std::istringstream in(list);
  std::string line, description, section;
  const auto flush = [&] {
    if (!description.empty() && !section.empty()) result.emplace_back(description, section);
    description.clear();
    section.clear();
  };
  while (std::getline(in, line)) {
    if (line.empty()) {
      flush();
    } else if (line.rfind("Description: ", 0) == 0) {
      description = line.substr(13);
    } else if (line.rfind("Section: ", 0) == 0) {
      section = line.substr(9);
    }
  }
  flush();
  return result;
}

/// The data set of the `classes` most common sections: the examples whose text hashes to 0
/// modulo 10 are the test set. `max_train`/`max_test` (0: all) keep the first examples in hash
/// order, a fixed sample.
inline DataSet debian_sections(const std::string& package_list, std::size_t classes = 8,
                               std::size_t max_train = 0, std::size_t max_test = 0) {
  const auto pairs = package_descriptions(read_package_list(package_list));
  MIXPREC_CHECK(!pairs.empty(), "'", package_list, "' holds no package descriptions");
  std::map<std::string, std::set<std::string>> sections_of;  // a text, the sections it is under
  for (const auto& [text, section] : pairs) sections_of[text].insert(section);
  std::map<std::string, std::size_t> count;
  for (const auto& [text, sections] : sections_of) {
    if (sections.size() == 1) ++count[*sections.begin()];
  }
  std::vector<std::pair<std::size_t, std::string>> ranked;
  for (const auto& [section, n] : count) ranked.emplace_back(n, section);
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  MIXPREC_CHECK(ranked.size() >= classes, "'", package_list, "' has ", ranked.size(),
                " sections, fewer than ", classes);
  DataSet data;
  data.source = package_list;
  std::map<std::string, std::int64_t> label_of;
  for (std::size_t i = 0; i < classes; ++i) {
    label_of.emplace(ranked[i].second, static_cast<std::int64_t>(i));
    data.classes.push_back(ranked[i].second);
  }
  std::vector<std::pair<std::uint64_t, Example>> hashed;
  for (const auto& [text, sections] : sections_of) {
    if (sections.size() != 1 || label_of.count(*sections.begin()) == 0) continue;
    hashed.push_back({detail::fnv1a(text), {text, label_of.at(*sections.begin())}});
  }
  std::sort(hashed.begin(), hashed.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : a.second.text < b.second.text;
  });
  for (const auto& [hash, example] : hashed) {
    auto& part = hash % 10 == 0 ? data.test : data.train;
    const auto limit = hash % 10 == 0 ? max_test : max_train;
    if (limit == 0 || part.size() < limit) part.push_back(example);
  }
  return data;
}

}  // namespace encoder
