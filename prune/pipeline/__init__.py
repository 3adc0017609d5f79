"""One prune run: its config, the amounts resolved once, removal, recipes, post-surgery steps."""
