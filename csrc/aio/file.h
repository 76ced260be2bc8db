// Opening the file of one request, and the synchronous page-cache transfers used for the
// unaligned head and tail of a request.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

namespace zc::aio {

// O_DIRECT policy: Auto tries it and falls back to the page cache where the file system
// refuses it (EINVAL); Require makes that refusal an error; Off never asks for it.
enum class DirectMode { Auto, Require, Off };

struct OpenFile {
  std::string path;
  int io_fd = -1;    // bulk transfers: opened with O_DIRECT when `direct`
  int edge_fd = -1;  // page-cache descriptor for unaligned head/tail bytes (-1: not needed)
  bool direct = false;
  uint64_t size = 0;  // at open time (reads only)
  OpenFile() = default;
  OpenFile(const OpenFile&) = delete;
  OpenFile& operator=(const OpenFile&) = delete;
  ~OpenFile();
};

// Opens `path` for a read or a write (created 0644 if missing, never truncated). Reads check
// that the file holds [offset, offset+nbytes). `need_edges` opens the page-cache descriptor
// too. `simulate_no_direct` makes O_DIRECT fail with EINVAL (tests of the fallback).
// Throws IoError naming the path.
std::shared_ptr<OpenFile> open_file(const std::string& path, bool write, DirectMode mode, bool need_edges,
                                    int64_t offset, uint64_t nbytes, bool simulate_no_direct);

// pread/pwrite all of [offset, offset+len), retrying EINTR and short transfers. Throws IoError
// naming the path, offset and errno text; a read that meets the end of the file is an error.
void read_full(int fd, const std::string& path, char* buf, uint64_t len, int64_t offset);
void write_full(int fd, const std::string& path, const char* buf, uint64_t len, int64_t offset);

}  // namespace zc::aio
