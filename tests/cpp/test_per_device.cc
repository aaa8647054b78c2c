// PerDevice: the FP8 GEMM's state per device (xla_ffi/per_device.h). Two devices
// get two states, each kept across calls; calls from several threads on several
// devices each find their own device's state.
#include <atomic>
#include <thread>
#include <vector>

#include "check.h"
#include "per_device.h"

using jax_comm_gemm::PerDevice;

namespace {
struct State {  // stands in for the FP8 GEMM's handle, workspace and algorithm
  int planned_on = -1;
  int calls = 0;
};
}  // namespace

TEST(TwoDevicesGetTwoStates) {
  PerDevice<State> states;
  State* first = states.Get(0);
  State* second = states.Get(1);
  CHECK(first != second);
  first->planned_on = 0;
  second->planned_on = 1;
  CHECK(states.Get(0) == first);  // kept across calls
  CHECK_EQ(states.Get(0)->planned_on, 0);
  CHECK_EQ(states.Get(1)->planned_on, 1);
  CHECK_EQ(static_cast<int>(states.size()), 2);
}

TEST(ThreadsOnEightDevicesEachFindTheirOwn) {
  PerDevice<State> states;
  std::vector<std::thread> threads;
  std::atomic<int> wrong{0};
  for (int device = 0; device < 8; ++device) {
    threads.emplace_back([&states, &wrong, device] {
      for (int i = 0; i < 1000; ++i) {
        State* s = states.Get(device);
        if (s->planned_on == -1) s->planned_on = device;  // only this thread uses device's
        if (s->planned_on != device) ++wrong;
        ++s->calls;
      }
    });
  }
  for (auto& t : threads) t.join();
  CHECK_EQ(wrong.load(), 0);
  CHECK_EQ(static_cast<int>(states.size()), 8);
  for (int device = 0; device < 8; ++device) CHECK_EQ(states.Get(device)->calls, 1000);
}
