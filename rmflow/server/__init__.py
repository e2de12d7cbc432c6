"""`rmflow serve`: the reward server (HTTP app, dynamic batcher, request protocols, metrics)."""
