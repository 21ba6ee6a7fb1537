"""Test support: fixtures for namespaces and other real resources."""
