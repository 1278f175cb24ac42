"""Prompt topics shared by the serving benchmarks (32 different short chat prompts)."""

TOPICS = [
    "the sea", "a mountain", "the city at night", "a cat", "autumn", "a robot", "coffee", "the moon",
    "a library", "trains", "a garden", "winter", "a lighthouse", "rain", "bread", "a violin",
    "the desert", "a river", "friendship", "a clock", "snow", "a bridge", "the forest", "a storm",
    "a market", "chess", "a kite", "the ocean floor", "a candle", "a mirror", "stars", "a harbour",
]  # fmt: skip
