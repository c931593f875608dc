"""Shared test set-up. Its folder is put on sys.path, so tests import `helpers` from here, also
the Triton tests in tests/triton, which run in their own pytest invocation (see Makefile)."""
