#pragma once
// The doctest runner of every test binary. ctest runs one process per test file
// (`--file test_trainer.cpp`: doctest's --source-file filter), which loads LibTorch once for the
// file's cases instead of once per case. Cases skipped by their decorator (doctest::skip) are
// listed by name and counted; a file whose cases were all skipped exits 77, which ctest reports
// as "not run", never as passed. The last line is the file's count:
//   mixprec-tests: 12 passed, 0 failed, 2 skipped (test_trainer.cpp)
// scripts/test adds these lines up over all files.
// Include it in the one translation unit of a binary that defines DOCTEST_CONFIG_IMPLEMENT.

#include <doctest/doctest.h>

#include <cstring>
#include <iostream>
#include <string>
#include <vector>

namespace test::runner {

struct Counts {
  std::string file;  // the --file argument; empty: every file
  int ran = 0;
  int failed = 0;
  std::vector<std::string> skipped;
};

inline Counts& counts() {
  static Counts c;
  return c;
}

inline bool ends_with(const std::string& text, const std::string& suffix) {
  return text.size() >= suffix.size() &&
         text.compare(text.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Sees every case: run ones through test_case_end, skipped ones (by decorator or by the file
// filter) through test_case_skipped; only the decorator's skips of the selected file count.
struct Listener : doctest::IReporter {
  explicit Listener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& stats) override {
    ++counts().ran;
    if (!stats.testCaseSuccess) ++counts().failed;
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData& tc) override {
    const auto& file = counts().file;
    if (tc.m_skip && (file.empty() || ends_with(tc.m_file.c_str(), "/" + file))) {
      counts().skipped.emplace_back(tc.m_name);
    }
  }
};

inline int run(int argc, char** argv) {
  std::vector<std::string> storage;
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--file") == 0 && i + 1 < argc) {
      counts().file = argv[++i];
      storage.push_back("--source-file=*/" + counts().file);
      continue;
    }
    storage.emplace_back(argv[i]);
  }
  for (auto& s : storage) args.push_back(s.data());
  doctest::Context context(static_cast<int>(args.size()), args.data());
  const int rc = context.run();
  if (context.shouldExit()) return rc;  // --help, --list-test-cases, ...
  auto& c = counts();
  for (const auto& name : c.skipped) std::cout << "skipped: " << name << "\n";
  std::cout << "mixprec-tests: " << (c.ran - c.failed) << " passed, " << c.failed << " failed, "
            << c.skipped.size() << " skipped (" << (c.file.empty() ? "all files" : c.file)
            << ")\n";
  if (rc == 0 && c.ran == 0 && !c.skipped.empty()) return 77;
  if (rc == 0 && c.ran == 0) {
    std::cout << "no test case matched\n";
    return 1;
  }
  return rc;
}

}  // namespace test::runner

DOCTEST_REGISTER_LISTENER("mixprec_counts", 1, test::runner::Listener);
