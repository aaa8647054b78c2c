// A test framework small enough to read in a minute (GoogleTest is not on PyPI,
// and nothing else may be downloaded). TEST(name) { ... } registers a test;
// CHECK* record a failure and go on; check_main.cc runs every test and exits
// non-zero if any check failed. One executable per test file, run by CTest.
#ifndef JAX_COMM_GEMM_TESTS_CHECK_H_
#define JAX_COMM_GEMM_TESTS_CHECK_H_

#include <functional>
#include <iostream>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace jcg_test {

inline std::vector<std::pair<const char*, std::function<void()>>>& Tests() {
  static std::vector<std::pair<const char*, std::function<void()>>> tests;
  return tests;
}

inline int& Failures() {
  static int failures = 0;
  return failures;
}

struct Register {
  Register(const char* name, std::function<void()> body) {
    Tests().emplace_back(name, std::move(body));
  }
};

inline void Fail(const char* file, int line, const std::string& what) {
  ++Failures();
  std::cerr << file << ":" << line << ": FAILED: " << what << "\n";
}

template <typename A, typename B>
void CheckEq(const A& a, const B& b, const char* as, const char* bs, const char* file, int line) {
  if (a == b) return;
  std::ostringstream m;
  m << as << " == " << bs << "\n    left:  " << a << "\n    right: " << b;
  Fail(file, line, m.str());
}

inline void CheckContains(const std::string& text, const std::string& part, const char* file,
                          int line) {
  if (text.find(part) != std::string::npos) return;
  Fail(file, line, "\"" + text + "\"\n    does not contain \"" + part + "\"");
}

}  // namespace jcg_test

#define JCG_TEST_CAT2(a, b) a##b
#define JCG_TEST_CAT(a, b) JCG_TEST_CAT2(a, b)
#define TEST(name)                                                                  \
  static void name();                                                               \
  static ::jcg_test::Register JCG_TEST_CAT(register_, name)(#name, name);           \
  static void name()

#define CHECK(cond) \
  ((cond) ? (void)0 : ::jcg_test::Fail(__FILE__, __LINE__, "CHECK(" #cond ")"))
#define CHECK_EQ(a, b) ::jcg_test::CheckEq((a), (b), #a, #b, __FILE__, __LINE__)
#define CHECK_CONTAINS(text, part) ::jcg_test::CheckContains((text), (part), __FILE__, __LINE__)

#endif  // JAX_COMM_GEMM_TESTS_CHECK_H_
