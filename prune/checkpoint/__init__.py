"""Writing and reading what a run makes: checkpoint folders, the card, serving layouts, GGUF, DeciLM."""
