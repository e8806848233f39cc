"""Models: built on the meta device, their weights read shard by shard, and what changes how a block
computes (mixture-of-experts routing and experts, float8 matmuls)."""
