"""The node's read-only status: a JSON snapshot and Prometheus metrics on 127.0.0.1, and the TUI."""
