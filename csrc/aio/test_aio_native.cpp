// Native tests of the torch-free I/O engine (ctest): round trips of odd sizes at odd offsets
// through each backend and several shapes of the queue, aligned and unaligned memory, many
// requests in flight, and the error paths. Usage: test_aio_native <scratch dir>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "aio/aligned_buffer.h"
#include "aio/io_context.h"
#include "aio/io_engine.h"
#include "aio/io_error.h"
#include "tests/check.h"

using namespace zc::aio;

namespace {


std::string g_dir;

std::vector<char> random_bytes(uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<char> v(n);
  for (auto& c : v) c = static_cast<char>(rng());
  return v;
}

uint64_t file_size(const std::string& p) {
  struct stat st {};
  return stat(p.c_str(), &st) == 0 ? static_cast<uint64_t>(st.st_size) : UINT64_MAX;
}

template <class F>
int expect_io_error(F&& f, const std::string& path, std::string* msg = nullptr) {
  try {
    f();
  } catch (const IoError& e) {
    CHECK(e.path() == path, "error names '%s', want '%s'", e.path().c_str(), path.c_str());
    if (msg) *msg = e.what();
    return e.err();
  } catch (const std::exception& e) {
    CHECK(false, "unexpected exception type: %s", e.what());
    return -2;
  }
  CHECK(false, "no error for %s", path.c_str());
  return -1;
}

// Writes n random bytes at `offset` (memory `shift` bytes past an aligned address), reads them
// back into differently shifted memory, and checks bytes and file size.
void round_trip(Engine& e, uint64_t n, int64_t offset, size_t shift_w, size_t shift_r, uint32_t seed) {
  const std::string path = g_dir + "/rt_" + std::to_string(seed);
  unlink(path.c_str());
  const std::vector<char> data = random_bytes(n, seed);
  AlignedBuffer wb(n + shift_w + 1), rb(n + shift_r + 1);
  std::memcpy(wb.data() + shift_w, data.data(), n);
  e.submit(true, wb.data() + shift_w, n, path, offset, nullptr);
  CHECK(e.wait() == 1, "write count");
  CHECK(file_size(path) == static_cast<uint64_t>(offset) + n, "size %llu after writing %llu at %lld",
        (unsigned long long)file_size(path), (unsigned long long)n, (long long)offset);
  std::memset(rb.data(), 0x5a, n + shift_r);
  e.run(false, rb.data() + shift_r, n, path, offset);
  CHECK(std::memcmp(rb.data() + shift_r, data.data(), n) == 0, "bytes differ: n=%llu offset=%lld shift=%zu/%zu",
        (unsigned long long)n, (long long)offset, shift_w, shift_r);
  unlink(path.c_str());
}

void test_round_trips(Backend b) {
  const uint64_t sizes[] = {1, 4095, 4096, 4097, 65536 + 7, (1u << 20) + 3, 5u << 20};
  const int64_t offsets[] = {0, 1, 4096, 12345};
  const EngineOptions shapes[] = {
      {4096, 1, 1, b, false, true, DirectMode::Auto},
      {65536, 4, 2, b, false, true, DirectMode::Auto},
      {1 << 20, 8, 3, b, true, false, DirectMode::Auto},
  };
  uint32_t seed = 1;
  for (const EngineOptions& o : shapes) {
    Engine e(o);
    for (uint64_t n : sizes)
      for (int64_t off : offsets) {
        round_trip(e, n, off, 0, 0, seed++);
        round_trip(e, n, off, 64, 8, seed++);
      }
  }
}

// A write into the middle of an existing file keeps the bytes around it.
void test_overwrite_keeps_neighbours(Backend b) {
  EngineOptions o;
  o.backend = b;
  Engine e(o);
  const std::string path = g_dir + "/keep";
  unlink(path.c_str());
  std::vector<char> base = random_bytes(20000, 7), patch = random_bytes(5000, 8);
  e.run(true, base.data(), base.size(), path, 0);
  e.run(true, patch.data(), patch.size(), path, 3001);
  std::memcpy(base.data() + 3001, patch.data(), patch.size());
  std::vector<char> back(base.size());
  e.run(false, back.data(), back.size(), path, 0);
  CHECK(back == base, "neighbouring bytes changed");
  CHECK(file_size(path) == base.size(), "size changed");
}

void test_many_in_flight(Backend b) {
  Engine e(EngineOptions{8192, 16, 2, b, false, true, DirectMode::Auto});
  const int files = 40;
  std::vector<std::vector<char>> data;
  for (int i = 0; i < files; ++i) {
    data.push_back(random_bytes(static_cast<uint64_t>(1000 + 7919 * i), 100 + i));
    e.submit(true, data.back().data(), data.back().size(), g_dir + "/many_" + std::to_string(i), i, nullptr);
  }
  CHECK(e.wait() == files, "count");
  std::vector<std::vector<char>> back(files);
  for (int i = 0; i < files; ++i) {
    back[i].resize(data[i].size());
    e.submit(false, back[i].data(), back[i].size(), g_dir + "/many_" + std::to_string(i), i, nullptr);
  }
  CHECK(e.wait() == files, "count");
  for (int i = 0; i < files; ++i) {
    CHECK(back[i] == data[i], "file %d differs", i);
    unlink((g_dir + "/many_" + std::to_string(i)).c_str());
  }
}

void test_errors(Backend b) {
  Engine e(EngineOptions{65536, 4, 1, b, false, true, DirectMode::Auto});
  std::vector<char> buf(10000);
  const std::string missing = g_dir + "/no_such_file";
  CHECK(expect_io_error([&] { e.run(false, buf.data(), buf.size(), missing, 0); }, missing) == ENOENT, "ENOENT");
  const std::string nodir = g_dir + "/no_such_dir/f";
  CHECK(expect_io_error([&] { e.submit(true, buf.data(), buf.size(), nodir, 0, nullptr); }, nodir) == ENOENT, "ENOENT");
  CHECK(expect_io_error([&] { e.run(false, buf.data(), buf.size(), g_dir, 0); }, g_dir) == EISDIR, "EISDIR read");
  CHECK(expect_io_error([&] { e.run(true, buf.data(), buf.size(), g_dir, 0); }, g_dir) == EISDIR, "EISDIR write");
  const std::string small = g_dir + "/small";
  e.run(true, buf.data(), 100, small, 0);
  std::string msg;
  CHECK(expect_io_error([&] { e.run(false, buf.data(), 101, small, 0); }, small, &msg) == 0, "past EOF");
  CHECK(msg.find("offset 0") != std::string::npos && msg.find("100") != std::string::npos, "message: %s", msg.c_str());
  CHECK(e.pending() == 0, "nothing left pending");
  // Still usable.
  e.submit(true, buf.data(), buf.size(), small, 0, nullptr);
  CHECK(e.wait() == 1, "usable after errors");
  bool threw = false;
  try {
    e.submit(true, buf.data(), buf.size(), small, -1, nullptr);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw, "negative offset");
  unlink(small.c_str());
}

void test_fallback(Backend b) {
  EngineOptions o;
  o.backend = b;
  o.direct = DirectMode::Require;
  Engine strict(o);
  strict.set_simulate_no_direct(true);
  std::vector<char> data = random_bytes(10001, 3);
  const std::string path = g_dir + "/nodirect";
  CHECK(expect_io_error([&] { strict.run(true, data.data(), data.size(), path, 0); }, path) == EINVAL, "refused");
  o.direct = DirectMode::Auto;
  Engine lax(o);
  lax.set_simulate_no_direct(true);
  const SubmitInfo info = lax.run(true, data.data(), data.size(), path, 5);
  CHECK(!info.direct, "fell back");
  std::vector<char> back(data.size());
  lax.run(false, back.data(), back.size(), path, 5);
  CHECK(back == data, "fallback round trip");
  unlink(path.c_str());
}

void test_options() {
  const EngineOptions bad[] = {{1000, 8, 1}, {0, 8, 1}, {4096, 0, 1}, {4096, 8, 0}};
  for (const EngineOptions& o : bad) {
    bool threw = false;
    try {
      Engine e(o);
    } catch (const std::invalid_argument&) {
      threw = true;
    }
    CHECK(threw, "bad options accepted");
  }
}

// Thread-pool backend: every pread/pwrite capped (the kernel returning short), so each op is a
// chain of short transfers the helper must continue; odd sizes and offsets, aligned and not.
void test_threadpool_short_transfers() {
  for (uint64_t cap : {4096u, 12288u, 1000u}) {
    testing::threadpool_max_syscall_bytes.store(cap);
    // 1000: not a multiple of the O_DIRECT alignment, so only the page cache can take it
    const DirectMode mode = cap % 4096 ? DirectMode::Off : DirectMode::Auto;
    Engine e(EngineOptions{65536, 4, 2, Backend::ThreadPool, false, true, mode});
    uint32_t seed = 900 + static_cast<uint32_t>(cap);
    for (uint64_t n : {1ull, 4097ull, 65536ull + 7, (1ull << 20) + 3})
      for (int64_t off : {0, 1, 12345}) round_trip(e, n, off, 0, 0, seed++), round_trip(e, n, off, 64, 8, seed++);
  }
  testing::threadpool_max_syscall_bytes.store(0);
}

// Errors through the thread-pool queue itself: errno kept, short reads at the end of a file
// reported as such, and the queue usable afterwards.
void test_threadpool_context_errors() {
  auto ctx = make_context(Backend::ThreadPool, 4);
  AlignedBuffer buf(8192);
  IoDone done[4];
  const int full = open("/dev/full", O_WRONLY);
  if (full >= 0) {  // a device that is always out of space
    IoOp op{full, true, buf.data(), 8192, 0, 7};
    CHECK(ctx->submit(&op, 1) == 1, "submit");
    CHECK(ctx->reap(done, 1, 4) == 1 && done[0].tag == 7 && done[0].res == -ENOSPC, "ENOSPC kept: %lld",
          (long long)done[0].res);
    close(full);
  }
  const std::string path = g_dir + "/tp_ctx";
  const int fd = open(path.c_str(), O_RDWR | O_CREAT | O_TRUNC, 0644);
  CHECK(fd >= 0, "open");
  CHECK(pwrite(fd, buf.data(), 5000, 0) == 5000, "lay out");
  IoOp ops[3] = {{fd, false, buf.data(), 8192, 0, 1},  // meets the end after 5000 bytes
                 {fd, false, buf.data(), 4096, 8192, 2},  // past the end: nothing
                 {-1, false, buf.data(), 4096, 0, 3}};    // a bad descriptor
  CHECK(ctx->submit(ops, 3) == 3, "submit 3");
  int got = 0;
  int64_t res[4] = {0, 0, 0, 0};
  while (got < 3) {
    const int n = ctx->reap(done, 1, 4);
    CHECK(n > 0, "reap");
    if (n <= 0) break;
    for (int i = 0; i < n; ++i) res[done[i].tag] = done[i].res;
    got += n;
  }
  CHECK(res[1] == 5000 && res[2] == 0 && res[3] == -EBADF, "results %lld %lld %lld", (long long)res[1],
        (long long)res[2], (long long)res[3]);
  // More ops than its depth: it takes what fits and says so, never blocks.
  IoOp many[6];
  for (int i = 0; i < 6; ++i) many[i] = IoOp{fd, false, buf.data(), 100, 0, static_cast<uint64_t>(i)};
  const int taken = ctx->submit(many, 6);
  CHECK(taken == 4, "took %d of 6 with depth 4", taken);
  for (int left = taken; left > 0;) left -= ctx->reap(done, left, 4);
  close(fd);
  unlink(path.c_str());
}

}  // namespace

int main(int argc, char** argv) {
  g_dir = argc > 1 ? argv[1] : "/tmp/zerocore_aio_native";
  mkdir(g_dir.c_str(), 0755);
  std::vector<Backend> backends;
  for (Backend b : kAllBackends) {
    std::string why;
    if (backend_available(b, &why)) backends.push_back(b);
    else std::printf("%s not tested: %s\n", backend_name(b), why.c_str());
  }
  try {
    for (Backend b : backends) {
      test_round_trips(b);
      test_many_in_flight(b);
      test_errors(b);
    }
    test_overwrite_keeps_neighbours(backends.front());
    test_fallback(backends.front());
    test_threadpool_short_transfers();
    test_threadpool_context_errors();
    test_options();
  } catch (const std::exception& e) {
    std::printf("FAIL: unexpected exception: %s\n", e.what());
    ++zc_test::failures;
  }
  rmdir(g_dir.c_str());
  return zc_test::summary();
}
