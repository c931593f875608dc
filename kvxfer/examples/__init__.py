"""Runnable examples of kvxfer."""
