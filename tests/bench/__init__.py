"""The benchmarks' report and readers, without running the benchmarks."""
