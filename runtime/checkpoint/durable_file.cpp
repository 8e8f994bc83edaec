#include "runtime/checkpoint/durable_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <string>
#include <system_error>

namespace pf::ckpt {

namespace {

[[noreturn]] void throw_errno(int error, const std::string& what) {
  throw std::system_error(error, std::generic_category(), what);
}

// Closes the descriptor on every path out of a function.
class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }
  // Closing reports write-back errors on some file systems, so it is checked where it matters.
  int close() {
    const int result = ::close(fd_);
    fd_ = -1;
    return result;
  }

 private:
  int fd_;
};

}  // namespace

void write_file_synced(const std::filesystem::path& path, std::span<const std::byte> bytes) {
  FileDescriptor fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  if (fd.get() < 0) throw_errno(errno, "creating " + path.string());
  const std::byte* data = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const auto written = ::write(fd.get(), data, left);
    if (written < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "writing " + path.string());
    }
    data += written;
    left -= static_cast<std::size_t>(written);
  }
  if (::fsync(fd.get()) != 0) throw_errno(errno, "syncing " + path.string());
  if (fd.close() != 0) throw_errno(errno, "closing " + path.string());
}

void sync_directory(const std::filesystem::path& directory) {
  FileDescriptor fd(::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.get() < 0) throw_errno(errno, "opening directory " + directory.string());
  if (::fsync(fd.get()) != 0 && errno != EINVAL) {
    throw_errno(errno, "syncing directory " + directory.string());
  }
}

bool rename_or_exchange(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE) == 0) {
    return false;
  }
  const int no_replace_error = errno;
  if (no_replace_error == EEXIST) {
    if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
      return true;
    }
    throw_errno(errno, "exchanging " + from.string() + " with " + to.string());
  }
  if (no_replace_error != EINVAL && no_replace_error != ENOSYS) {
    throw_errno(no_replace_error, "renaming " + from.string() + " to " + to.string());
  }
  // A file system without renameat2 flags: plain rename (it replaces only an empty directory).
  if (::rename(from.c_str(), to.c_str()) != 0) {
    throw_errno(errno, "renaming " + from.string() + " to " + to.string());
  }
  return false;
}

std::vector<std::byte> read_file_bytes(const std::filesystem::path& path) {
  FileDescriptor fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) throw_errno(errno, "opening " + path.string());
  struct stat info {};
  if (::fstat(fd.get(), &info) != 0) throw_errno(errno, "reading the size of " + path.string());
  std::vector<std::byte> bytes(static_cast<std::size_t>(info.st_size));
  std::size_t filled = 0;
  while (filled < bytes.size()) {
    const auto got = ::read(fd.get(), bytes.data() + filled, bytes.size() - filled);
    if (got < 0) {
      if (errno == EINTR) continue;
      throw_errno(errno, "reading " + path.string());
    }
    if (got == 0) break;  // shrank while reading: return what is there
    filled += static_cast<std::size_t>(got);
  }
  bytes.resize(filled);
  return bytes;
}

}  // namespace pf::ckpt
