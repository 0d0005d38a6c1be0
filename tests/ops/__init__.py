"""Tests of ops/."""
