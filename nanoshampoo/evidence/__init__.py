"""Evidence tools: statistics over repeated runs, plots, profiler trace analysis."""
