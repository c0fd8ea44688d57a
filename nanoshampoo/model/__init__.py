"""GPT model (modded-nanogpt style)."""
