"""The integration tier: tests that launch train.py, torchrun or a Python of their own (marked slow
by tests/conftest.py)."""
