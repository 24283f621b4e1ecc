"""gk.attribution: explanation methods as rule tables."""
