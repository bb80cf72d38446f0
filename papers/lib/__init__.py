"""Shared pieces of the paper reproductions: tasks, MLP training, CLI."""
