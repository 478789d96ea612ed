"""Models that use dma_jax attention. Nothing in dma_jax imports this package."""
