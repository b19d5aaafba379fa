"""Placeholder: builder added with the family adapter."""
