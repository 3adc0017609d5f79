"""Opening a model: names and aliases, GGUF files, tokenizers, and skeletons whose blocks stay on disk."""
