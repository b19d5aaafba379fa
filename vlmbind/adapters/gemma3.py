"""Placeholder: this family's adapter is being written."""
