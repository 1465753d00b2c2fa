"""The household verdict: scenarios replayed in each mode, overlap from the request log, the decision."""
