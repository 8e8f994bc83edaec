#include "runtime/data/text_file.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

namespace pf::data {

std::string read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw std::runtime_error("cannot open '" + path + "': " + std::strerror(errno));
  }
  std::string contents;
  in.seekg(0, std::ios::end);
  const auto size = in.tellg();
  if (size < 0) throw std::runtime_error("cannot determine the size of '" + path + "'");
  contents.resize(static_cast<std::size_t>(size));
  in.seekg(0, std::ios::beg);
  if (!contents.empty() && !in.read(contents.data(), static_cast<std::streamsize>(size))) {
    throw std::runtime_error("cannot read '" + path + "'");
  }
  return contents;
}

void write_text_file(const std::string& path, std::string_view contents) {
  const std::string temporary = path + ".tmp";
  {
    std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
    if (!out) {
      throw std::runtime_error("cannot create '" + temporary + "': " + std::strerror(errno));
    }
    out.write(contents.data(), static_cast<std::streamsize>(contents.size()));
    if (!out.flush()) throw std::runtime_error("cannot write '" + temporary + "'");
  }
  std::error_code error;
  std::filesystem::rename(temporary, path, error);
  if (error) {
    throw std::runtime_error("cannot rename '" + temporary + "' to '" + path +
                             "': " + error.message());
  }
}

}  // namespace pf::data
