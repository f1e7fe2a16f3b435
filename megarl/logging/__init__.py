"""Metrics: the TensorBoard writer, console progress and the metric names."""
