"""The speedrun trainer."""
