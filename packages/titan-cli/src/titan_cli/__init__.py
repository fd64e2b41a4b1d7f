"""The `titan` command."""
