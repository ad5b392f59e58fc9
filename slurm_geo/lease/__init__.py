"""The lease protocol (protocol.py) and the training job's side of it (client.py)."""
