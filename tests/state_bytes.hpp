#pragma once
// Editing saved state bytes in tests. A CRC-32C trailer guards every byte of a
// saved state (docs/state-format.md), so a test that edits a field to reach one
// of the loaders' structural or content checks re-signs the buffer afterwards;
// without that the checksum refuses it first and the check is never reached.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <stdexcept>
#include <vector>

#include "latte/core/crc32c.hpp"

namespace latte::test {

/// Rewrites the CRC-32C trailer (the last 4 bytes) of edited saved bytes.
inline void resign(std::vector<std::byte>& bytes) {
  constexpr std::size_t crc_size = sizeof(std::uint32_t);
  if (bytes.size() < 8 + crc_size) throw std::logic_error("resign: not a saved state");
  const std::uint32_t crc = crc32c(std::span(bytes).first(bytes.size() - crc_size));
  std::memcpy(bytes.data() + bytes.size() - crc_size, &crc, crc_size);
}

/// `bytes` with its CRC-32C trailer rewritten.
[[nodiscard]] inline std::vector<std::byte> resigned(std::vector<std::byte> bytes) {
  resign(bytes);
  return bytes;
}

}  // namespace latte::test
