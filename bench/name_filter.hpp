#pragma once
// NameFilter: the benchmark tools' `--only NAME,...` — a row runs when its
// mechanism's name starts with one of the given prefixes (every row when none);
// a NAME ending in `$` matches that name only (`latte$`: not latte_vapor).
#include <sstream>
#include <string>
#include <vector>

namespace latte::bench {

struct NameFilter {
  std::vector<std::string> prefixes;  // empty: every name

  /// Adds the prefixes of a comma-separated list ("macchiato,lavo"); empty names are skipped.
  void add_list(const std::string& comma_separated) {
    std::stringstream names(comma_separated);
    for (std::string name; std::getline(names, name, ',');)
      if (!name.empty()) prefixes.push_back(name);
  }

  [[nodiscard]] bool wanted(const std::string& name) const {
    if (prefixes.empty()) return true;
    for (const std::string& prefix : prefixes) {
      if (prefix.ends_with('$') ? name == prefix.substr(0, prefix.size() - 1) : name.starts_with(prefix))
        return true;
    }
    return false;
  }
};

}  // namespace latte::bench
