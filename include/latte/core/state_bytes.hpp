#pragma once
// Saving and restoring decode states as bytes.
//
// Layout: 8-byte magic "latteST1", a length-prefixed kind string that names
// the attention type and dtype, then the fields in the order the state writes
// them (little-endian host layout; states are not meant to cross
// architectures). Reading checks the magic, the kind and every length, so a
// truncated or foreign buffer is a latte::Error, never a bad read.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "latte/core/error.hpp"

namespace latte::detail {

inline constexpr std::string_view state_magic = "latteST1";

/// A saved state claiming the product of `extents` elements of `element_size`
/// bytes must be at least that long; checked before a state is allocated from it.
inline void require_state_fits(std::size_t buffer_bytes, std::size_t element_size,
                               std::initializer_list<std::int64_t> extents) {
  std::size_t elements = 1;
  for (std::int64_t extent : extents) {
    require(extent >= 0 && static_cast<std::size_t>(extent) <= buffer_bytes, "bytes",
            expected_given("saved extent that fits the buffer", "<= " + std::to_string(buffer_bytes),
                           extent));
    elements *= static_cast<std::size_t>(extent);
    require(elements * element_size <= buffer_bytes, "bytes",
            expected_given("state buffer bytes", ">= " + std::to_string(elements * element_size),
                           buffer_bytes));
  }
}

class ByteWriter {
 public:
  explicit ByteWriter(std::string_view kind) {
    write_raw(state_magic.data(), state_magic.size());
    write_string(kind);
  }
  template <class T>
    requires std::is_trivially_copyable_v<T>
  void write(const T& value) {
    write_raw(&value, sizeof(T));
  }
  template <class T>
    requires std::is_trivially_copyable_v<T>
  void write_array(std::span<const T> values) {
    write<std::uint64_t>(values.size());
    write_raw(values.data(), values.size_bytes());
  }
  void write_string(std::string_view text) {
    write<std::uint64_t>(text.size());
    write_raw(text.data(), text.size());
  }
  [[nodiscard]] std::vector<std::byte> finish() && { return std::move(bytes_); }

 private:
  void write_raw(const void* data, std::size_t count) {
    const auto* first = static_cast<const std::byte*>(data);
    bytes_.insert(bytes_.end(), first, first + count);
  }
  std::vector<std::byte> bytes_;
};

class ByteReader {
 public:
  ByteReader(std::span<const std::byte> bytes, std::string_view expected_kind) : bytes_(bytes) {
    char magic[8] = {};
    read_raw(magic, sizeof magic);
    require(std::string_view(magic, sizeof magic) == state_magic, "bytes",
            "not a latte state (magic 'latteST1' missing)");
    const std::string kind = read_string();
    require(kind == expected_kind, "bytes",
            expected_given("state kind", expected_kind, kind.empty() ? "<empty>" : kind));
  }
  template <class T>
    requires std::is_trivially_copyable_v<T>
  T read() {
    T value;
    read_raw(&value, sizeof(T));
    return value;
  }
  template <class T>
    requires std::is_trivially_copyable_v<T>
  void read_array(std::vector<T>& values, std::size_t expected_count, std::string_view field) {
    const auto count = read<std::uint64_t>();
    require(count == expected_count, "bytes",
            expected_given(std::string("element count of state field '") + std::string(field) +
                               "'",
                           expected_count, count));
    values.resize(count);
    read_raw(values.data(), count * sizeof(T));
  }
  std::string read_string() {
    const auto count = read<std::uint64_t>();
    require(count <= remaining(), "bytes", "truncated state (string longer than the buffer)");
    std::string text(count, '\0');
    read_raw(text.data(), count);
    return text;
  }
  void finish() const {
    require(remaining() == 0, "bytes",
            expected_given("trailing bytes after the state", 0, remaining()));
  }

 private:
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - offset_; }
  void read_raw(void* out, std::size_t count) {
    require(count <= remaining(), "bytes",
            expected_given("bytes left in the state buffer", std::to_string(count) + " or more",
                           remaining()));
    if (count) std::memcpy(out, bytes_.data() + offset_, count);
    offset_ += count;
  }
  std::span<const std::byte> bytes_;
  std::size_t offset_ = 0;
};

}  // namespace latte::detail
