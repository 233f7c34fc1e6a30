#!/usr/bin/env bash
# latte-compare built the ways users build: g++ and clang++, -O2 and -O3, each with
# -march=native and OpenMP (a header-only user's flags; CMake's Release is -O3,
# RelWithDebInfo and most distributions -O2), into build-modes/.
#
#   scripts/build-modes.sh        the four builds, then the core forward rows of each
#                                 (causal Latte +- VAPOR, bidirectional Latte, elu+1,
#                                 cosFormer, softmax with a 128 window; B1 H8 L64 D64,
#                                 T = 8K) in alternating rounds; the best round of
#                                 each row to docs/build-modes.csv, and a table of
#                                 each build's GFLOP/s against the best build's.
#   scripts/build-modes.sh --ci   g++ -O2 and clang++ -O3 only, one short run each:
#                                 the kernels compile and run in those builds (CI).
#   --rounds N                    rounds of the measurement (default 3)
#   --no-build                    measure the builds already in build-modes/
set -euo pipefail
cd "$(dirname "$0")/.."

ci=0
rounds=3
build=1
while (($#)); do
  case "$1" in
    --ci) ci=1; shift ;;
    --rounds) rounds="$2"; shift 2 ;;
    --no-build) build=0; shift ;;
    *) echo "build-modes.sh: unknown argument '$1' (see the header of $0)" >&2; exit 2 ;;
  esac
done

out=build-modes
mkdir -p "$out"
common=(-std=gnu++20 -DNDEBUG -march=native -DLATTE_WITH_OPENMP=1 -DLATTE_WITH_XSIMD=1
        -Iinclude -isystem /usr/include/eigen3 bench/latte_compare.cpp)
if ((ci)); then
  modes=("g++ -O2" "clang++ -O3")
else
  modes=("g++ -O2" "g++ -O3" "clang++ -O2" "clang++ -O3")
fi
names=()
for mode in "${modes[@]}"; do
  read -r compiler level <<<"$mode"
  openmp=-fopenmp
  [[ "$compiler" == clang++ ]] && openmp=-fopenmp=libomp
  name="${compiler//+/p}${level}"
  names+=("$name")
  ((build)) || continue
  echo "build-modes.sh: $compiler $level" >&2
  "$compiler" "$level" "$openmp" "${common[@]}" -o "$out/latte-compare-$name" &
done
wait

rows=latte,linear,cosformer,softmax_window
if ((ci)); then
  for name in "${names[@]}"; do
    "$out/latte-compare-$name" --only "$rows" --t 1K --min-time 0.01 --csv >"$out/$name.csv" 2>/dev/null
    echo "build-modes.sh: $name ran $(($(wc -l <"$out/$name.csv") - 1)) rows" >&2
  done
  exit 0
fi

rm -f "$out"/*.round*.csv
for ((r = 1; r <= rounds; ++r)); do
  for name in "${names[@]}"; do
    "$out/latte-compare-$name" --only "$rows" --t 8K --csv >"$out/$name.round$r.csv" 2>/dev/null
  done
done
python3 - "$out" "${names[@]}" <<'EOF'
import csv, glob, sys
out, names = sys.argv[1], sys.argv[2:]
wanted = {("latte", "causal"), ("latte_vapor", "causal"), ("latte", "bidirectional"),
          ("linear_elu", "causal"), ("cosformer", "causal"), ("softmax_window128", "causal")}
best = {}  # (build, mechanism, direction) -> best GFLOP/s over the rounds
for name in names:
    for path in glob.glob(f"{out}/{name}.round*.csv"):
        for row in csv.DictReader(open(path)):
            key = (row["mechanism"], row["direction"])
            if key in wanted:
                g = float(row["gflops"])
                best[(name, *key)] = max(best.get((name, *key), 0.0), g)
with open("docs/build-modes.csv", "w") as f:
    f.write("build,mechanism,direction,B,T,H,L,D,gflops,of_best_build\n")
    print(f"{'row':34s}" + "".join(f"{n:>14s}" for n in names))
    for mechanism, direction in sorted(wanted):
        top = max(best[(n, mechanism, direction)] for n in names)
        cells = ""
        for n in names:
            g = best[(n, mechanism, direction)]
            f.write(f"{n},{mechanism},{direction},1,8192,8,64,64,{g:.1f},{g / top:.3f}\n")
            cells += f"{g:8.1f} {g / top:4.2f}x"
        print(f"{mechanism + ' ' + direction:34s}{cells}")
EOF
