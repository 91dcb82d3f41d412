"""What reads a node's status: the HTTP client, the terminal views and the section formats. The node
serves the snapshot itself (prime_node/node/snapshot.py, status_api.py); nothing here imports node/."""
