"""Tests of decode/."""
