"""Benchmark runners (also behind ``mlscale bench``): ours vs the anchors, side by side."""
