#pragma once
// StateStorage<T>: the storage, identity and byte format shared by every decode state.
//
// A state is a kind string (attention type + dtype), named sizes that fix its
// shape (batch, heads, ...), the absolute position of the next token and a few
// named fields of T. Mechanism states derive from it and add typed accessors.
// States belong to one batch of sequences; step them from one thread at a time.
//
// Bytes (format 3, docs/state-format.md): magic "latteST3", kind, sizes (name,
// value), position, field table (name, element count), the fields' data in
// host byte order, then the CRC-32C of everything before it. Reading checks
// the magic and the checksum, then kind, sizes and every length, then what the
// state type requires of its content (check_saved), before it touches the
// state: a rejected buffer leaves the state as it was.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "latte/core/crc32c.hpp"
#include "latte/core/error.hpp"
#include "latte/core/huge_page_allocator.hpp"
#include "latte/core/types.hpp"

namespace latte {

/// One named size of a state ("batch", "heads", "latents", ...).
struct StateSize {
  std::string name;
  std::int64_t value = 0;
  friend bool operator==(const StateSize&, const StateSize&) = default;
};

/// One named field of a state and its element count.
struct StateField {
  std::string name;
  std::size_t count = 0;
};

namespace detail {

inline std::string describe_sizes(const std::vector<StateSize>& sizes) {
  std::string text = "[";
  for (std::size_t i = 0; i < sizes.size(); ++i)
    text += (i ? ", " : "") + sizes[i].name + "=" + std::to_string(sizes[i].value);
  return text + "]";
}

/// Appends trivially copyable values to a byte vector.
class ByteSink {
 public:
  template <class V>
  void put(const V& value) { put_raw(&value, sizeof(V)); }
  void put_string(std::string_view text) {
    put<std::uint64_t>(text.size());
    put_raw(text.data(), text.size());
  }
  void put_raw(const void* data, std::size_t count) {
    const auto* first = static_cast<const std::byte*>(data);
    bytes.insert(bytes.end(), first, first + count);
  }
  std::vector<std::byte> bytes;
};

/// Reads values back, with every length checked against what is left.
class ByteSource {
 public:
  explicit ByteSource(std::span<const std::byte> bytes) : bytes_(bytes) {}
  template <class V>
  V get() {
    V value;
    get_raw(&value, sizeof(V));
    return value;
  }
  std::string get_string() {
    const auto count = get<std::uint64_t>();
    require(count <= remaining(), "bytes", "truncated state: a name runs past the buffer");
    std::string text(count, '\0');
    get_raw(text.data(), count);
    return text;
  }
  void get_raw(void* out, std::size_t count) {
    require(count <= remaining(), "bytes",
            expected_given("bytes left in the state buffer", ">= " + std::to_string(count),
                           remaining()));
    if (count) std::memcpy(out, bytes_.data() + offset_, count);
    offset_ += count;
  }
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size() - offset_; }

 private:
  std::span<const std::byte> bytes_;
  std::size_t offset_ = 0;
};

/// An attention type's state kinds for both dtypes, built once so that
/// checking a state on every step allocates nothing.
struct KindNames {
  std::string float32, float64;
  template <Real T>
  [[nodiscard]] const std::string& get() const noexcept {
    if constexpr (std::is_same_v<T, float>) return float32;
    else return float64;
  }
};

}  // namespace detail

template <Real T>
class StateStorage {
 public:
  /// The first 8 bytes of a saved state: "latteST" and the format's version digit.
  static constexpr std::string_view magic = "latteST3";

  /// What a saved buffer says about itself; read and fully length-checked
  /// before any state is allocated from it.
  struct Header {
    std::vector<StateSize> sizes;
    std::int64_t position = 0;
    std::vector<StateField> fields;
  };

  // Copy and move as before; declared because the destructor is (protected:
  // states are never deleted through a StateStorage pointer).
  StateStorage() = default;
  StateStorage(const StateStorage&) = default;
  StateStorage(StateStorage&&) = default;
  StateStorage& operator=(const StateStorage&) = default;
  StateStorage& operator=(StateStorage&&) = default;
  StateStorage(std::string kind, std::vector<StateSize> sizes, std::vector<StateField> fields,
               std::int64_t position)
      : kind_(std::move(kind)), sizes_(std::move(sizes)), fields_(std::move(fields)),
        position_(position) {
    data_.reserve(fields_.size());
    for (const StateField& field : fields_) data_.emplace_back(field.count);
  }

  /// The attention type and dtype this state belongs to.
  [[nodiscard]] const std::string& kind() const noexcept { return kind_; }
  [[nodiscard]] const std::vector<StateSize>& sizes() const noexcept { return sizes_; }
  /// The named size `name` (0 when the state has none of that name).
  [[nodiscard]] std::int64_t size_of(std::string_view name) const noexcept {
    for (const StateSize& size : sizes_)
      if (size.name == name) return size.value;
    return 0;
  }
  [[nodiscard]] index_t batch() const noexcept { return size_of("batch"); }
  /// Absolute position of the next token.
  [[nodiscard]] std::int64_t position() const noexcept { return position_; }
  void advance(std::int64_t tokens) noexcept { position_ += tokens; }
  /// Throws latte::Error("state") unless `new_tokens` more tokens keep every
  /// position within int64 (a restored state may sit anywhere up to INT64_MAX).
  /// Allocation-free unless it throws: steps call it once per token.
  void require_room(std::int64_t new_tokens) const {
    if (new_tokens < 0 || position_ > std::numeric_limits<std::int64_t>::max() - new_tokens)
      throw Error("state", detail::expected_given(
                               "position + new tokens",
                               "<= " + std::to_string(std::numeric_limits<std::int64_t>::max()),
                               std::to_string(position_) + " + " + std::to_string(new_tokens)));
  }
  /// Bytes of state data held (what decode keeps in memory).
  [[nodiscard]] std::size_t bytes() const noexcept {
    std::size_t total = 0;
    for (const auto& field : data_) total += field.size() * sizeof(T);
    return total;
  }

  [[nodiscard]] T* field(std::size_t index) noexcept { return data_[index].data(); }
  [[nodiscard]] const T* field(std::size_t index) const noexcept { return data_[index].data(); }
  /// Elements of field `index`.
  [[nodiscard]] std::size_t field_size(std::size_t index) const noexcept { return data_[index].size(); }
  /// Number of fields.
  [[nodiscard]] std::size_t field_count() const noexcept { return data_.size(); }

  /// Throws latte::Error("state") unless this state has `kind` and `sizes`.
  void require_matches(std::string_view kind, const std::vector<StateSize>& sizes) const {
    detail::require(kind_ == kind, "state",
                    detail::expected_given("state kind", kind,
                                           kind_.empty() ? "<empty state>" : kind_));
    detail::require(sizes_ == sizes, "state",
                    detail::expected_given("state sizes", detail::describe_sizes(sizes),
                                           detail::describe_sizes(sizes_)));
  }

  /// Throws latte::Error("later") unless `later` is a state of this kind and
  /// these sizes whose position is not before this one's (append_state's
  /// checks), then moves this state's position to later's.
  void append_position(const StateStorage& later) {
    later.require_kind_and_sizes(kind_, sizes_, "later");
    detail::require(later.position_ >= position_, "later",
                    detail::expected_given("position", ">= " + std::to_string(position_),
                                           later.position_));
    position_ = later.position_;
  }

  /// Throws latte::Error(argument) unless this state has `kind` and `sizes`,
  /// both named in one message (the backward's state arguments).
  void require_kind_and_sizes(const std::string& kind, const std::vector<StateSize>& sizes,
                              std::string_view argument) const {
    detail::require(kind_ == kind && sizes_ == sizes, argument,
                    detail::expected_given("state of kind and sizes",
                                           kind + " " + detail::describe_sizes(sizes),
                                           (kind_.empty() ? std::string("<empty state>") : kind_) +
                                               " " + detail::describe_sizes(sizes_)));
  }

  [[nodiscard]] std::vector<std::byte> save() const {
    detail::ByteSink sink;
    sink.bytes.reserve(saved_size());
    sink.put_raw(magic.data(), magic.size());
    sink.put_string(kind_);
    sink.put<std::uint64_t>(sizes_.size());
    for (const StateSize& size : sizes_) {
      sink.put_string(size.name);
      sink.put<std::int64_t>(size.value);
    }
    sink.put<std::int64_t>(position_);
    sink.put<std::uint64_t>(fields_.size());
    for (const StateField& field : fields_) {
      sink.put_string(field.name);
      sink.put<std::uint64_t>(field.count);
    }
    for (const auto& field : data_) sink.put_raw(field.data(), field.size() * sizeof(T));
    sink.put<std::uint32_t>(crc32c(sink.bytes));
    return std::move(sink.bytes);
  }

  /// The length of save()'s bytes: header, data and the 4-byte checksum.
  [[nodiscard]] std::size_t saved_size() const noexcept {
    std::size_t header = magic.size() + 8 + kind_.size() + 8 + 8 + 8;
    for (const StateSize& size : sizes_) header += 8 + size.name.size() + 8;
    for (const StateField& field : fields_) header += 8 + field.name.size() + 8;
    return header + bytes() + sizeof(std::uint32_t);
  }

  /// Reads and checks the header of saved bytes of `kind`: magic, checksum,
  /// kind, the field table, and that the buffer holds exactly the data it announces.
  [[nodiscard]] static Header read_header(std::span<const std::byte> bytes, std::string_view kind) {
    detail::ByteSource source(checked_body(bytes));
    Header header;
    read_header_into(source, kind, header);
    return header;
  }

  /// Throws latte::Error("bytes") unless a saved header has exactly `sizes` and `fields`.
  static void require_layout(const Header& header, const std::vector<StateSize>& sizes,
                             const std::vector<StateField>& fields) {
    detail::require(header.sizes == sizes, "bytes",
                    detail::expected_given("saved state sizes", detail::describe_sizes(sizes),
                                           detail::describe_sizes(header.sizes)));
    detail::require(header.fields.size() == fields.size(), "bytes",
                    detail::expected_given("saved field count", fields.size(),
                                           header.fields.size()));
    for (std::size_t i = 0; i < fields.size(); ++i)
      detail::require(
          header.fields[i].name == fields[i].name && header.fields[i].count == fields[i].count,
          "bytes",
          detail::expected_given("saved field " + std::to_string(i),
                                 fields[i].name + "[" + std::to_string(fields[i].count) + "]",
                                 header.fields[i].name + "[" +
                                     std::to_string(header.fields[i].count) + "]"));
  }

  /// The batch a saved header announces (its first size), refused unless it is
  /// >= 1, the other sizes are those of `sizes_of_one` (this attention's sizes
  /// at batch 1) and that many sequences fit in `bytes`: field counts computed
  /// from a corrupted batch would otherwise overflow (found by the fuzzer).
  /// `fields_for(b)` gives the field table of a batch-b state.
  template <class FieldsFor>
  [[nodiscard]] static index_t saved_batch(const Header& header, std::span<const std::byte> bytes,
                                           std::vector<StateSize> sizes_of_one,
                                           FieldsFor&& fields_for) {
    const index_t batch = header.sizes.empty() ? 0 : header.sizes.front().value;
    detail::require(batch >= 1, "bytes", detail::expected_given("saved batch", ">= 1", batch));
    sizes_of_one.front().value = batch;
    detail::require(header.sizes == sizes_of_one, "bytes",
                    detail::expected_given("saved state sizes",
                                           detail::describe_sizes(sizes_of_one),
                                           detail::describe_sizes(header.sizes)));
    auto elements = [](const std::vector<StateField>& fields) {
      std::size_t total = 0;
      for (const StateField& field : fields) total += field.count;
      return total;
    };
    const std::size_t per_sequence =
        elements(fields_for(index_t{2})) - elements(fields_for(index_t{1}));
    const std::size_t fits = bytes.size() / sizeof(T) / std::max<std::size_t>(per_sequence, 1);
    detail::require(static_cast<std::size_t>(batch) <= fits, "bytes",
                    detail::expected_given("saved batch", "<= " + std::to_string(fits) +
                                                              " (what the buffer can hold)",
                                           batch));
    return batch;
  }

  /// Overwrites this state with saved bytes of the same kind and sizes whose
  /// content this state type accepts (check_saved); all or nothing.
  void restore(std::span<const std::byte> bytes) {
    detail::ByteSource source(checked_body(bytes));
    Header header;
    read_header_into(source, kind_, header);
    require_layout(header, sizes_, fields_);
    std::vector<AlignedVector<T>> data;
    data.reserve(fields_.size());
    for (const StateField& field : fields_) {
      data.emplace_back(field.count);
      source.get_raw(data.back().data(), field.count * sizeof(T));
    }
    check_saved(header.position, data);
    data_.swap(data);
    position_ = header.position;
  }

 protected:
  ~StateStorage() = default;

  /// Throws latte::Error("bytes") unless a saved `position` and `fields` (of
  /// this state's layout) are content this state type can have written. The one
  /// content check of saved bytes: restore calls it, and load_state ends in restore.
  virtual void check_saved(std::int64_t /*position*/,
                           const std::vector<AlignedVector<T>>& /*fields*/) const {}

 private:
  /// What the checksum of saved bytes covers (all but its last 4 bytes), once the
  /// magic names format 3 and the stored CRC-32C matches the computed one.
  static std::span<const std::byte> checked_body(std::span<const std::byte> bytes) {
    const std::string_view family = magic.substr(0, magic.size() - 1);  // "latteST"
    const std::string_view head(reinterpret_cast<const char*>(bytes.data()),
                                std::min(bytes.size(), magic.size()));
    detail::require(head.substr(0, family.size()) == family && head.size() == magic.size(),
                    "bytes", "not a latte state (magic 'latteST3' missing)");
    detail::require(head != "latteST2", "bytes",
                    "saved by state format 2 (magic 'latteST2'), which has no checksum; this "
                    "version reads format 3 only (docs/state-format.md)");
    detail::require(head == magic, "bytes",
                    detail::expected_given("state format (magic)", magic, head));
    constexpr std::size_t crc_size = sizeof(std::uint32_t);
    detail::require(bytes.size() >= magic.size() + crc_size, "bytes",
                    detail::expected_given("saved state bytes", ">= 12 (magic and checksum)",
                                           bytes.size()));
    const auto body = bytes.first(bytes.size() - crc_size);
    std::uint32_t stored = 0;
    std::memcpy(&stored, bytes.data() + body.size(), crc_size);
    const std::uint32_t computed = crc32c(body);
    if (stored != computed)
      throw Error("bytes", detail::expected_given(
                               "CRC-32C of the saved state (the bytes are corrupted or truncated)",
                               hex(stored), hex(computed)));
    return body;
  }
  static std::string hex(std::uint32_t value) {
    constexpr char digits[] = "0123456789abcdef";
    std::string text = "0x00000000";
    for (std::size_t i = 0; i < 8; ++i) text[9 - i] = digits[(value >> (4 * i)) & 0xF];
    return text;
  }

  static void read_header_into(detail::ByteSource& source, std::string_view kind, Header& header) {
    char head[magic.size()];
    source.get_raw(head, sizeof head);  // the magic, checked by checked_body
    const std::string saved_kind = source.get_string();
    detail::require(saved_kind == kind, "bytes",
                    detail::expected_given("state kind", kind,
                                           saved_kind.empty() ? "<empty>" : saved_kind));
    const auto size_count = source.get<std::uint64_t>();
    detail::require(size_count <= 16, "bytes",
                    detail::expected_given("number of saved sizes", "<= 16", size_count));
    for (std::uint64_t i = 0; i < size_count; ++i) {
      StateSize size;
      size.name = source.get_string();
      size.value = source.get<std::int64_t>();
      detail::require(size.value >= 0, "bytes",
                      detail::expected_given("saved " + size.name, ">= 0", size.value));
      header.sizes.push_back(std::move(size));
    }
    header.position = source.get<std::int64_t>();
    detail::require(header.position >= 0, "bytes",
                    detail::expected_given("saved position", ">= 0", header.position));
    const auto field_count = source.get<std::uint64_t>();
    detail::require(field_count <= 16, "bytes",
                    detail::expected_given("number of saved fields", "<= 16", field_count));
    std::size_t data_bytes = 0;
    for (std::uint64_t i = 0; i < field_count; ++i) {
      StateField field;
      field.name = source.get_string();
      field.count = source.get<std::uint64_t>();
      detail::require(field.count <= source.remaining() / sizeof(T), "bytes",
                      detail::expected_given("saved field '" + field.name + "' elements",
                                             "<= " + std::to_string(source.remaining() / sizeof(T)),
                                             field.count));
      data_bytes += field.count * sizeof(T);
      header.fields.push_back(std::move(field));
    }
    detail::require(data_bytes == source.remaining(), "bytes",
                    detail::expected_given("state data bytes", data_bytes, source.remaining()));
  }

  std::string kind_;
  std::vector<StateSize> sizes_;
  std::vector<StateField> fields_;
  std::int64_t position_ = 0;
  std::vector<AlignedVector<T>> data_;
};

namespace detail {

/// The state arguments of a causal backward ({initial, d_final, d_initial}):
/// each given state of `kind` and `sizes`, room for `tokens` more in initial,
/// and d_initial a state of its own. Errors name "states.<member>".
template <class States, class Sizes>
void require_backward_states(const States& states, const std::string& kind, const Sizes& sizes,
                             index_t tokens) {
  if (states.initial) states.initial->require_kind_and_sizes(kind, sizes, "states.initial");
  if (states.d_final) states.d_final->require_kind_and_sizes(kind, sizes, "states.d_final");
  if (states.initial) states.initial->require_room(tokens);
  require(states.d_initial == nullptr ||
              (states.d_initial != states.initial && states.d_initial != states.d_final),
          "states.d_initial", "must be a state of its own (not initial nor d_final)");
}

}  // namespace detail
}  // namespace latte
