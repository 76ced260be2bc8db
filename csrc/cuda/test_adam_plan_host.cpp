// Native test of the multi-tensor Adam's launch planning on the host (no GPU needed), linked into
// test_cuda_host (whose main() runs it): plan_adam's launches (sizes, keys, chunk counts, order,
// cover, the table capacities), each table lookup against a linear scan (the binary search the
// kernel uses, the coarse index, the resident grid's runs and walk), and the line-aligned chunk grid
// of LineAlignedAdamTable. The candidates' lookups are the ones csrc/bench/cuda_variants.cu times.
#include "cuda/test_adam_plan_host.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <stdexcept>
#include <vector>

#include "adam/adam.h"
#include "cuda/adam_table.h"
#include "cuda/api.h"
#include "tests/check.h"

#include <cuda_runtime_api.h>

namespace zc_cuda_test {
namespace {

// Every chunk's tensor as each table lookup finds it (the binary search the kernel uses, the coarse
// index the benchmark measures) against a linear scan: one tensor, many tiny ones (one chunk each,
// several per hint), sizes around the chunk size, and launches whose chunk count crosses a hint
// shift boundary.
template <class Table>
bool lookups_agree(const std::vector<int64_t>& sizes) {
  float dummy[4];
  const zc::AdamScalars s = zc::adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, true, 1.0);
  std::vector<zc::AdamTensor> ts;
  for (int64_t n : sizes) ts.push_back({dummy, dummy, dummy, dummy, nullptr, n, zc::DType::F32, zc::DType::F32, s});
  const auto plan = zc::cuda::plan_adam(ts.data(), static_cast<int64_t>(ts.size()), Table::kCapacity);
  auto tab = std::make_unique<Table>();
  for (const auto& l : plan) {
    zc::cuda::fill_adam_table(*tab, ts.data(), l);
    std::vector<int> owner(static_cast<size_t>(l.chunks));
    for (int32_t c = 0, k = 0; c < l.chunks; ++c) {
      while (k + 1 < tab->count && tab->chunk_start[k + 1] <= c) ++k;
      owner[c] = k;
      if (tab->find(c) != k) {
        std::fprintf(stderr, "  chunk %d of %lld: found tensor %d, lies in %d\n", c, static_cast<long long>(l.chunks),
                     tab->find(c), k);
        return false;
      }
    }
    // the resident grid's walk (adam_kernel_resident): block b of G takes a run of chunks, finds the
    // first one's tensor and walks on; every chunk once, each with its tensor
    for (int64_t grid : {int64_t(1), int64_t(7), int64_t(792), l.chunks, l.chunks + 5}) {
      std::vector<int> seen(static_cast<size_t>(l.chunks), 0);
      for (int32_t b = 0; b < grid; ++b) {
        int32_t c, end;
        zc::cuda::resident_run(static_cast<int32_t>(l.chunks), static_cast<int32_t>(grid), b, c, end);
        if (c >= end) continue;
        for (int k = tab->find(c); c < end; ++c) {
          k = zc::cuda::next_owner(tab->chunk_start, k, tab->count, c);
          ++seen[c];
          if (k != owner[c]) {
            std::fprintf(stderr, "  grid %lld block %d chunk %d: found tensor %d, lies in %d\n",
                         static_cast<long long>(grid), b, c, k, owner[c]);
            return false;
          }
        }
      }
      if (std::count(seen.begin(), seen.end(), 1) != l.chunks) {
        std::fprintf(stderr, "  grid %lld: the runs do not cover every chunk once\n", static_cast<long long>(grid));
        return false;
      }
    }
  }
  return true;
}

}  // namespace

void test_adam_table_lookups() {
  using Small = zc::cuda::AdamTable<zc::cuda::kAdamTableSmall>;
  using Large = zc::cuda::AdamTable<zc::cuda::kAdamTableLarge>;
  using Hinted = zc::cuda::HintedAdamTable<zc::cuda::kAdamTableLarge, 2048>;
  using TinyHint = zc::cuda::HintedAdamTable<zc::cuda::kAdamTableLarge, 4>;  // many tensors per hint
  const int64_t C = zc::cuda::kAdamChunkElems;
  std::mt19937 rng(11);
  std::lognormal_distribution<double> lognormal(0.0, 2.0);
  std::vector<std::vector<int64_t>> cases = {{1}, {C}, {C + 1}, {100000000}, std::vector<int64_t>(500, 7),
                                             std::vector<int64_t>(512, C), {2048 * C}, {2048 * C + 1}};
  for (int rep = 0; rep < 4; ++rep) {
    std::vector<int64_t> sizes;
    for (int i = 0; i < 200; ++i) sizes.push_back(1 + static_cast<int64_t>(lognormal(rng) * 200000));
    cases.push_back(sizes);
  }
  std::vector<int64_t> mixed;
  for (int i = 0; i < 300; ++i) mixed.push_back(i % 3 ? 5 : 3 * C + i);
  cases.push_back(mixed);
  for (size_t k = 0; k < cases.size(); ++k) {
    CHECK(lookups_agree<Small>(cases[k]), "AdamTable<64>::find, case %zu", k);
    CHECK(lookups_agree<Large>(cases[k]), "AdamTable<512>::find, case %zu", k);
    CHECK(lookups_agree<Hinted>(cases[k]), "HintedAdamTable<512, 2048>::find, case %zu", k);
    CHECK(lookups_agree<TinyHint>(cases[k]), "HintedAdamTable<512, 4>::find, case %zu", k);
  }
}

// The line-aligned chunk grid (LineAlignedAdamTable, adam.cu's launch table, both sizes): for tensors at
// every element offset within a line and sizes around the chunk size, each tensor's chunks cover its
// elements once, in order, none empty or longer than a chunk; every chunk after the first starts on a
// 128-byte line; the lookup finds each chunk's tensor; the launch's chunk count is the sum, at most one
// a tensor more than the plan's (the room plan_adam keeps under the int32 grid).
template <class Table>
void line_aligned_spans() {
  const int64_t C = zc::cuda::kAdamChunkElems;
  const zc::AdamScalars s = zc::adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, true, 1.0);
  const std::vector<int64_t> sizes = {1, 3, 4, C - 33, C - 32, C - 1, C, C + 1, 2 * C - 5, 3 * C + 31, 10 * C};
  alignas(128) static float buffer[64 + 11 * C];
  std::vector<zc::AdamTensor> ts;
  for (int64_t off = 0; off < 32; off += 1)  // every element offset in a line: 16-byte aligned ones and not
    for (int64_t n : sizes) ts.push_back({buffer + off, buffer, buffer, buffer, nullptr, n, zc::DType::F32,
                                          zc::DType::F32, s});
  const auto plan = zc::cuda::plan_adam(ts.data(), static_cast<int64_t>(ts.size()), Table::kCapacity);
  auto tab = std::make_unique<Table>();
  int64_t checked = 0;
  for (const auto& l : plan) {
    zc::cuda::fill_adam_table(*tab, ts.data(), l);
    int32_t total = 0;
    for (int k = 0; k < tab->count; ++k) {
      const int32_t first = tab->chunk_start[k];
      const int32_t last = k + 1 < tab->count ? tab->chunk_start[k + 1] : tab->chunks;
      int64_t next = 0;
      for (int32_t c = first; c < last; ++c) {
        int64_t begin, n;
        tab->span(k, c, begin, n);
        const uintptr_t addr = reinterpret_cast<uintptr_t>(tab->p[k] + begin);
        CHECK(begin == next && n > 0 && n <= C, "tensor %d chunk %d: [%lld, +%lld), expected to start at %lld", k, c,
              static_cast<long long>(begin), static_cast<long long>(n), static_cast<long long>(next));
        CHECK(c == first || addr % 128 == 0, "tensor %d chunk %d starts %d bytes into a line", k, c,
              static_cast<int>(addr % 128));
        CHECK(tab->find(c) == k, "chunk %d: found tensor %d, lies in %d", c, tab->find(c), k);
        next = begin + n;
      }
      CHECK(next == tab->numel[k], "tensor %d: chunks cover %lld of %lld elements", k, static_cast<long long>(next),
            static_cast<long long>(tab->numel[k]));
      total += last - first;
      ++checked;
    }
    CHECK(total == tab->chunks, "launch of %d tensors: %d chunks counted, the table says %d", tab->count, total,
          tab->chunks);
    CHECK(tab->chunks >= l.chunks && tab->chunks <= l.chunks + tab->count,
          "launch of %d tensors: %d shifted chunks against the plan's %lld", tab->count, tab->chunks,
          static_cast<long long>(l.chunks));
  }
  CHECK(checked == static_cast<int64_t>(ts.size()), "%lld of %zu tensors checked", static_cast<long long>(checked),
        ts.size());
}

void test_line_aligned_spans() {
  line_aligned_spans<zc::cuda::LineAlignedAdamTable<zc::cuda::kAdamTableSmall>>();
  line_aligned_spans<zc::cuda::LineAlignedAdamTable<zc::cuda::kAdamTableLarge>>();
}

void test_plan_adam() {
  const zc::AdamScalars s1 = zc::adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 1, true, 1.0);
  const zc::AdamScalars s2 = zc::adam_scalars(1e-3, 0.9, 0.999, 1e-8, 0.01, 2, true, 1.0);
  float dummy[4];
  std::vector<zc::AdamTensor> ts;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int64_t> size(0, 50000);
  for (int i = 0; i < 300; ++i) {
    zc::AdamTensor t{dummy, dummy, dummy, dummy, nullptr, i % 50 == 0 ? 0 : size(rng), zc::DType::F32,
                     zc::DType::F32, (i % 7 == 0) ? s2 : s1};
    if (i % 5 == 0) t.grad_dtype = zc::DType::BF16;
    if (i % 11 == 0) { t.param_out = dummy; t.out_dtype = zc::DType::F16; }
    ts.push_back(t);
  }
  ts.push_back({dummy, dummy, dummy, dummy, nullptr, int64_t(3) << 31, zc::DType::F16, zc::DType::F32, s1});
  for (int cap : {zc::cuda::kAdamTableSmall, zc::cuda::kAdamTableLarge}) {
    const auto plan = zc::cuda::plan_adam(ts.data(), static_cast<int64_t>(ts.size()), cap);
    std::vector<int> seen(ts.size(), 0);
    bool ok_size = true, ok_key = true, ok_chunks = true, ok_order = true;
    for (const auto& l : plan) {
      ok_size &= !l.tensors.empty() && l.tensors.size() <= static_cast<size_t>(cap);
      int64_t chunks = 0;
      for (size_t k = 0; k < l.tensors.size(); ++k) {
        const auto& a = ts[l.tensors[0]];
        const auto& b = ts[l.tensors[k]];
        ok_key &= a.grad_dtype == b.grad_dtype && (a.param_out == nullptr) == (b.param_out == nullptr) &&
                  std::memcmp(&a.s, &b.s, sizeof(a.s)) == 0;
        ok_order &= k == 0 || l.tensors[k] > l.tensors[k - 1];
        chunks += (b.numel + zc::cuda::kAdamChunkElems - 1) / zc::cuda::kAdamChunkElems;
        ++seen[l.tensors[k]];
      }
      ok_chunks &= chunks == l.chunks && l.chunks <= 0x7fffffff;
    }
    bool ok_cover = true;
    for (size_t i = 0; i < ts.size(); ++i) ok_cover &= seen[i] == (ts[i].numel > 0 ? 1 : 0);
    CHECK(ok_size && ok_key && ok_chunks && ok_order && ok_cover,
          "plan_adam(cap %d): size %d key %d chunks %d order %d cover %d", cap, ok_size, ok_key, ok_chunks, ok_order,
          ok_cover);
  }
  // One key: the usual call. 200 tensors are one launch with the large table, 4 with the small
  // one; 600 are two launches (512 + 88) with the large table.
  std::vector<zc::AdamTensor> same;
  for (int i = 0; i < 600; ++i)
    same.push_back({dummy, dummy, dummy, dummy, nullptr, 1 + 997 * i, zc::DType::F32, zc::DType::F32, s1});
  const auto big200 = zc::cuda::plan_adam(same.data(), 200, zc::cuda::kAdamTableLarge);
  CHECK(big200.size() == 1 && big200[0].tensors.size() == 200, "plan_adam: 200 tensors in %zu launches (large table)",
        big200.size());
  CHECK(zc::cuda::plan_adam(same.data(), 200, zc::cuda::kAdamTableSmall).size() == 4,
        "plan_adam: 200 tensors with the small table are not 4 launches");
  const auto big600 = zc::cuda::plan_adam(same.data(), 600, zc::cuda::kAdamTableLarge);
  CHECK(big600.size() == 2 && big600[0].tensors.size() == 512 && big600[1].tensors.size() == 88 &&
            big600[1].tensors[0] == 512,
        "plan_adam: 600 tensors in %zu launches (large table)", big600.size());
  const int cap = zc::cuda::adam_table_capacity();
  CHECK(cap == zc::cuda::kAdamTableSmall || cap == zc::cuda::kAdamTableLarge, "adam_table_capacity %d", cap);
#if CUDART_VERSION >= 12010
  int driver = 0;
  if (cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12010)
    CHECK(cap == zc::cuda::kAdamTableLarge, "driver %d but adam_table_capacity %d", driver, cap);
#endif
  zc::AdamTensor bad{dummy, dummy, dummy, dummy, dummy, 10, zc::DType::F32, zc::DType::F32, s1};
  bool threw = false;
  try { zc::cuda::plan_adam(&bad, 1, zc::cuda::kAdamTableSmall); } catch (const std::invalid_argument&) { threw = true; }
  CHECK(threw, "plan_adam accepts an fp32 param_out");
}

}  // namespace zc_cuda_test
