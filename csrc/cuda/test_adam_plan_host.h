// The Adam launch-planning checks of test_adam_plan_host.cpp, run by test_cuda_host's main().
#pragma once

namespace zc_cuda_test {
void test_adam_table_lookups();
void test_line_aligned_spans();
void test_plan_adam();
}  // namespace zc_cuda_test
