#pragma once
// latte::crc32c: the CRC-32C (Castagnoli) checksum that guards saved states.
//
// Reflected polynomial 0x82F63B78, initial value 0xFFFFFFFF, final xor
// 0xFFFFFFFF (the CRC of iSCSI, ext4 and SSE4.2's crc32 instruction);
// crc32c("123456789") = 0xE3069283. With SSE4.2 (`__SSE4_2__`) the
// instruction computes it 8 bytes at a time; otherwise slicing-by-8 tables do.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#if defined(__SSE4_2__)
#include <nmmintrin.h>
#endif

namespace latte {
namespace detail {

/// Slicing-by-8 tables: row 0 is the byte-at-a-time table, row k the CRC of a
/// byte followed by k zero bytes.
inline constexpr std::array<std::array<std::uint32_t, 256>, 8> crc32c_tables = [] {
  std::array<std::array<std::uint32_t, 256>, 8> tables{};
  for (std::uint32_t byte = 0; byte < 256; ++byte) {
    std::uint32_t crc = byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
    tables[0][byte] = crc;
  }
  for (std::size_t k = 1; k < 8; ++k)
    for (std::size_t byte = 0; byte < 256; ++byte)
      tables[k][byte] = (tables[k - 1][byte] >> 8) ^ tables[0][tables[k - 1][byte] & 0xFFu];
  return tables;
}();

/// The portable path on the raw (pre- and post-inverted) register `crc`.
inline std::uint32_t crc32c_portable_update(std::uint32_t crc, const unsigned char* data,
                                            std::size_t count) noexcept {
  const auto& t = crc32c_tables;
  for (; count >= 8; count -= 8, data += 8) {
    std::uint32_t low, high;  // little-endian words, whatever the host's order
    low = std::uint32_t(data[0]) | std::uint32_t(data[1]) << 8 | std::uint32_t(data[2]) << 16 |
          std::uint32_t(data[3]) << 24;
    high = std::uint32_t(data[4]) | std::uint32_t(data[5]) << 8 | std::uint32_t(data[6]) << 16 |
           std::uint32_t(data[7]) << 24;
    low ^= crc;
    crc = t[7][low & 0xFF] ^ t[6][(low >> 8) & 0xFF] ^ t[5][(low >> 16) & 0xFF] ^ t[4][low >> 24] ^
          t[3][high & 0xFF] ^ t[2][(high >> 8) & 0xFF] ^ t[1][(high >> 16) & 0xFF] ^
          t[0][high >> 24];
  }
  for (; count > 0; --count, ++data) crc = (crc >> 8) ^ t[0][(crc ^ *data) & 0xFF];
  return crc;
}

/// CRC-32C of `bytes` by the tables, on every host.
inline std::uint32_t crc32c_portable(std::span<const std::byte> bytes) noexcept {
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  return ~crc32c_portable_update(~std::uint32_t{0}, data, bytes.size());
}

#if defined(__SSE4_2__)
/// CRC-32C of `bytes` by SSE4.2's crc32 instruction.
inline std::uint32_t crc32c_sse42(std::span<const std::byte> bytes) noexcept {
  const auto* data = reinterpret_cast<const unsigned char*>(bytes.data());
  std::size_t count = bytes.size();
  std::uint32_t crc = ~std::uint32_t{0};
#if defined(__x86_64__) || defined(_M_X64)
  std::uint64_t wide = crc;
  for (; count >= 8; count -= 8, data += 8) {
    std::uint64_t word;
    std::memcpy(&word, data, sizeof word);
    wide = _mm_crc32_u64(wide, word);
  }
  crc = static_cast<std::uint32_t>(wide);
#endif
  for (; count > 0; --count, ++data) crc = _mm_crc32_u8(crc, *data);
  return ~crc;
}
#endif

}  // namespace detail

/// CRC-32C (Castagnoli) of `bytes`.
[[nodiscard]] inline std::uint32_t crc32c(std::span<const std::byte> bytes) noexcept {
#if defined(__SSE4_2__)
  return detail::crc32c_sse42(bytes);
#else
  return detail::crc32c_portable(bytes);
#endif
}

}  // namespace latte
