#!/usr/bin/env bash
# Installs the system packages latte builds against, when missing (Debian/Ubuntu):
# a C++20 compiler with OpenMP, CMake >= 3.25, Eigen 3.4, xsimd, doctest and
# Google Benchmark. Nothing is downloaded at configure time.
set -euo pipefail

packages=(g++ make cmake libeigen3-dev libxsimd-dev doctest-dev libbenchmark-dev)
missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done

if ((${#missing[@]})); then
  echo "latte setup: installing ${missing[*]}"
  sudo_cmd=()
  if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
  "${sudo_cmd[@]}" apt-get update -qq
  DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "latte setup: all system packages present"
fi
