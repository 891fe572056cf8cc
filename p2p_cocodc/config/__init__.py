"""Options: one schema for the command line, TOML profiles and the environment."""
