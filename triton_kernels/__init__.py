"""Triton kernels of dma-jax with thin torch launchers. Imports torch and triton only, never JAX."""
