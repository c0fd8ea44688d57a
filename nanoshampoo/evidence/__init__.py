"""Evidence tools: statistics over repeated runs, the compare leaderboard, plots, trace analysis."""
