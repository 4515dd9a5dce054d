"""Pure array functions for post-training losses: SFT weighting, advantages, objectives, KL, aggregation."""
