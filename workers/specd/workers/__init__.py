"""specd data plane: engine, actors, gateway, CLI.  See docs/structure.md for the module map."""
