"""Test helpers shared by the test suites (spawning gloo process groups)."""
