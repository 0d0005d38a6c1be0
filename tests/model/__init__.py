"""Tests of model/."""
