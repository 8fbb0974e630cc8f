"""Step-time benchmarks of the ZeRO strategies against Lightning's own (see docs/benchmarks.md)."""
