#include "runtime/data/text_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

#include "common/input_error.h"

namespace pf::data {

std::string read_text_file(const std::string& path) {
  // A directory opens as a stream whose size reads as 2^63 - 1: refuse anything but a file.
  std::error_code status_error;
  const auto status = std::filesystem::status(path, status_error);
  if (!status_error && status.type() != std::filesystem::file_type::regular &&
      status.type() != std::filesystem::file_type::not_found) {
    throw InputError("cannot read '" + path + "': " +
                     (status.type() == std::filesystem::file_type::directory
                          ? std::string("it is a directory, not a file")
                          : std::string("it is not a regular file")));
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw InputError("cannot open '" + path + "': " + std::strerror(errno));
  }
  std::string contents;
  in.seekg(0, std::ios::end);
  const auto size = in.tellg();
  if (size < 0) throw InputError("cannot determine the size of '" + path + "'");
  contents.resize(static_cast<std::size_t>(size));
  in.seekg(0, std::ios::beg);
  if (!contents.empty() && !in.read(contents.data(), static_cast<std::streamsize>(size))) {
    throw InputError("cannot read '" + path + "'");
  }
  return contents;
}

void write_text_file(const std::string& path, std::string_view contents) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) {
      throw InputError("cannot create '" + temporary + "': " + std::strerror(errno));
    }
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!out.flush()) throw InputError("cannot write '" + temporary + "'");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) {
    throw InputError("cannot rename '" + temporary + "' to '" + path + "': " + error.message());
  }
}

}  // namespace pf::data
