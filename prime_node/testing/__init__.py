"""Test helpers shipped with the package (as trio does): in-memory transports, message strategies, tiny
fixtures. Importable by the project's tests and by anyone testing code built on prime-node."""
