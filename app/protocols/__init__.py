"""The wire formats shared by the runner and the gateway: no Flask, no engine."""
