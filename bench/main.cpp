// One main for every bench_*.cpp linked into latte_bench.
#include <benchmark/benchmark.h>

BENCHMARK_MAIN();
