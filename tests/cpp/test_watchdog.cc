// Watchdog: polls at its interval, survives a throwing poll, and stops at once
// when destroyed, however long its interval.
#include <atomic>
#include <chrono>
#include <stdexcept>
#include <thread>

#include "check.h"
#include "registry.h"

using jax_comm_gemm::Watchdog;
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

namespace {

// Waits up to `limit` for `count` to reach `target`.
bool Reaches(const std::atomic<int>& count, int target, milliseconds limit) {
  const auto until = Clock::now() + limit;
  while (count.load() < target && Clock::now() < until) {
    std::this_thread::sleep_for(milliseconds(1));
  }
  return count.load() >= target;
}

}  // namespace

TEST(PollsRepeatedly) {
  std::atomic<int> polls{0};
  Watchdog watchdog([&] { ++polls; }, milliseconds(5));
  CHECK(Reaches(polls, 3, milliseconds(5000)));
}

TEST(StopsPollingWhenDestroyed) {
  std::atomic<int> polls{0};
  {
    Watchdog watchdog([&] { ++polls; }, milliseconds(1));
    CHECK(Reaches(polls, 1, milliseconds(5000)));
  }
  const int after = polls.load();
  std::this_thread::sleep_for(milliseconds(20));
  CHECK_EQ(polls.load(), after);
}

TEST(DestructionDoesNotWaitForTheInterval) {
  const auto start = Clock::now();
  { Watchdog watchdog([] {}, milliseconds(3600 * 1000)); }
  CHECK(Clock::now() - start < std::chrono::seconds(2));
}

TEST(AThrowingPollDoesNotStopIt) {
  std::atomic<int> polls{0};
  Watchdog watchdog([&] {
    if (++polls == 1) throw std::runtime_error("first poll fails");
  }, milliseconds(1));
  CHECK(Reaches(polls, 3, milliseconds(5000)));
}
