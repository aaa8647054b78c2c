// Runs every TEST of the executable; exits non-zero if a check failed.
#include "check.h"

int main() {
  for (const auto& [name, body] : ::jcg_test::Tests()) {
    const int before = ::jcg_test::Failures();
    body();
    std::cout << (::jcg_test::Failures() == before ? "ok      " : "FAILED  ") << name << "\n";
  }
  std::cout << ::jcg_test::Tests().size() << " tests, " << ::jcg_test::Failures()
            << " failed checks\n";
  return ::jcg_test::Failures() == 0 ? 0 : 1;
}
