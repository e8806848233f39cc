"""The unit tier (`make test-fast`): tests that call the code in this process and launch nothing."""
