"""The audit: gk.audit, its replay of the backward pass, and its verified fixes."""
