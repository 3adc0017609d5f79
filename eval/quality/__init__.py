"""Quality of a model: perplexity protocols, the lm-eval bridge, task specs, the evaluation report."""
