"""Verifiable tasks: each gives a prompt for a task id and scores a completion from its text alone."""
