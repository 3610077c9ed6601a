"""Model towers and heads. Free of parallelism, precision and checkpoint logic."""
