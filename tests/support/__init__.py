"""What tests share with each other (and benchmarks may import): model shapes, weights."""
