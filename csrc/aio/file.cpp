#include "aio/file.h"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

#include "aio/io_error.h"

namespace zc::aio {
namespace {

int open_retry(const char* path, int flags) {
  int fd;
  do fd = ::open(path, flags | O_CLOEXEC, 0644);
  while (fd < 0 && errno == EINTR);
  return fd;
}

IoError open_error(int err, const std::string& path, bool write, bool direct) {
  std::string what = std::string("open for ") + (write ? "writing" : "reading") + (direct ? " (O_DIRECT)" : "") +
                     " failed: " + errno_text(err);
  return IoError(err, path, what);
}

}  // namespace

OpenFile::~OpenFile() {
  if (edge_fd >= 0) ::close(edge_fd);
  if (io_fd >= 0) ::close(io_fd);
}

std::shared_ptr<OpenFile> open_file(const std::string& path, bool write, DirectMode mode, bool need_edges,
                                    int64_t offset, uint64_t nbytes, bool simulate_no_direct) {
  auto f = std::make_shared<OpenFile>();
  f->path = path;
  const int base = write ? (O_WRONLY | O_CREAT) : O_RDONLY;
  if (mode != DirectMode::Off) {
    int fd = -1, err = EINVAL;
    if (!simulate_no_direct) {
      fd = open_retry(path.c_str(), base | O_DIRECT);
      err = errno;
    } else {  // the refusal comes after the path checks, as the kernel's does
      fd = open_retry(path.c_str(), base);
      err = fd < 0 ? errno : EINVAL;
      if (fd >= 0) ::close(fd), fd = -1;
    }
    if (fd >= 0) {
      f->io_fd = fd;
      f->direct = true;
    } else if (err != EINVAL || mode == DirectMode::Require) {
      if (err == EINVAL) {
        throw IoError(EINVAL, path,
                      "the file system refuses O_DIRECT (open failed: " + errno_text(EINVAL) +
                          "); use direct='auto' to fall back to buffered I/O, or put the file on a file "
                          "system that supports O_DIRECT (ext4, xfs)");
      }
      throw open_error(err, path, write, true);
    }
  }
  if (!f->direct) {
    f->io_fd = open_retry(path.c_str(), base);
    if (f->io_fd < 0) throw open_error(errno, path, write, false);
  } else if (need_edges) {
    f->edge_fd = open_retry(path.c_str(), write ? O_WRONLY : O_RDONLY);
    if (f->edge_fd < 0) throw open_error(errno, path, write, false);
  }

  struct stat st {};
  if (fstat(f->io_fd, &st) != 0) throw IoError(errno, path, "fstat failed: " + errno_text(errno));
  if (S_ISDIR(st.st_mode)) throw IoError(EISDIR, path, "is a directory, not a file");
  if (S_ISBLK(st.st_mode)) {
    uint64_t bytes = 0;
    if (ioctl(f->io_fd, BLKGETSIZE64, &bytes) != 0) {
      throw IoError(errno, path, "BLKGETSIZE64 failed: " + errno_text(errno));
    }
    f->size = bytes;
  } else if (S_ISREG(st.st_mode)) {
    f->size = static_cast<uint64_t>(st.st_size);
  } else {
    throw IoError(EINVAL, path, "is not a regular file or a block device");
  }
  if (!write && f->size < static_cast<uint64_t>(offset) + nbytes) {
    throw IoError(0, path,
                  "read past the end of the file: reading " + std::to_string(nbytes) + " bytes at offset " +
                      std::to_string(offset) + " needs " + std::to_string(static_cast<uint64_t>(offset) + nbytes) +
                      " bytes, the file has " + std::to_string(f->size));
  }
  return f;
}

void read_full(int fd, const std::string& path, char* buf, uint64_t len, int64_t offset) {
  uint64_t done = 0;
  while (done < len) {
    const ssize_t r = ::pread(fd, buf + done, len - done, offset + static_cast<int64_t>(done));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw io_error(errno, path, "pread", offset + static_cast<int64_t>(done), len - done);
    }
    if (r == 0) {
      throw IoError(0, path,
                    "pread at offset " + std::to_string(offset + static_cast<int64_t>(done)) + " (" +
                        std::to_string(len - done) + " bytes) met the end of the file (was it truncated?)");
    }
    done += static_cast<uint64_t>(r);
  }
}

void write_full(int fd, const std::string& path, const char* buf, uint64_t len, int64_t offset) {
  uint64_t done = 0;
  while (done < len) {
    const ssize_t r = ::pwrite(fd, buf + done, len - done, offset + static_cast<int64_t>(done));
    if (r < 0) {
      if (errno == EINTR) continue;
      throw io_error(errno, path, "pwrite", offset + static_cast<int64_t>(done), len - done);
    }
    if (r == 0) throw io_error(ENOSPC, path, "pwrite (wrote nothing)", offset + static_cast<int64_t>(done), len - done);
    done += static_cast<uint64_t>(r);
  }
}

}  // namespace zc::aio
