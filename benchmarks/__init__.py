"""rlpipe benchmarks: every figure is a ratio against a baseline measured side by side in the same run."""
