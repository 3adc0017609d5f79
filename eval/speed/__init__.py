"""Speed and memory of a model against its original, in each serving engine."""
