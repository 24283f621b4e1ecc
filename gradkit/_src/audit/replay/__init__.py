"""The replay: a reverse-mode gradient evaluated equation by equation, with provenance."""
