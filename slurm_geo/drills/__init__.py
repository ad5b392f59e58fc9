"""Drills: lose a cluster on purpose in the sandbox and measure the recovery. They drive
the sandbox, checkpoint-sync and the federation daemon from outside, the way an operator
would; the daemons never import them."""
