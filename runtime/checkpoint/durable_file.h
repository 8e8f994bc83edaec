#pragma once
// Small POSIX file operations for crash-safe checkpoints: a file's bytes reach the disk before
// the rename that publishes them, and a rename is itself made durable by syncing its directory.
#include <cstddef>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

namespace pf::ckpt {

// Creates (or truncates) `path`, writes all bytes and fsyncs the file before returning. Throws
// std::system_error naming the path.
void write_file_synced(const std::filesystem::path& path, std::span<const std::byte> bytes);
inline void write_file_synced(const std::filesystem::path& path, std::string_view text) {
  write_file_synced(path, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

// fsyncs a directory so that the entries created, renamed or removed in it are durable. Throws
// std::system_error naming the directory (a file system that cannot sync directories, EINVAL,
// is accepted: there is nothing more to do on it).
void sync_directory(const std::filesystem::path& directory);

// Renames `from` to `to` (same file system); when `to` already exists as a directory, the two are
// swapped atomically (Linux renameat2 RENAME_EXCHANGE) so that `to` never disappears, and the
// old content is left at `from`. Returns true when a swap took place. Throws std::system_error.
bool rename_or_exchange(const std::filesystem::path& from, const std::filesystem::path& to);

// The whole file. Throws std::system_error naming the path.
std::vector<std::byte> read_file_bytes(const std::filesystem::path& path);

}  // namespace pf::ckpt
