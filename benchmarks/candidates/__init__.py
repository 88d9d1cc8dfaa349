"""Kernels that lost their benchmark, kept to measure against the product's."""
